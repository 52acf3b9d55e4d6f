"""Soak across network namespaces: many shuffles and merges on one client, every worker sampled (issue 18).

A scheduler and ``--workers`` ``dask worker --nthreads 1`` processes, each in
its own network namespace (the harness of ``tests/netns.py``: veth pairs to a
bridge, ``shared_memory=False``, so every byte between ranks crosses a link).
One client runs ``--shuffles`` consecutive shuffles (output partitions
cycling 3..6) and, spread among them, ``--merges`` hash joins, each checked
(shuffles: row count and the sum of a unique column; merges: exact against
pandas). Every ``--every`` rounds it samples each worker: threads, open file
descriptors, RSS and the entries in its spill directory. With
``--spill-host`` small (64 KiB by default) most received chunks are spilled
to disk, so spill directories are made and removed all along.

Printed per worker: the least-squares slope of each metric against the
number of shuffles done (per 100 shuffles), its first, last, min and max.
A flat worker has slopes near 0 (RSS moves by allocator noise).
``--method tasks`` (or ``p2p``) runs the same rounds with one of Dask's own
shuffles: the drift of the worker processes themselves, to compare with.
The run's configuration, samples and slopes go to ``--out`` as JSON.

Needs root and ``ip`` (iproute2), as the tests in ``tests/dask/test_netns.py``.

    sudo .venv/bin/python benchmarks/soak_bench.py --out benchmarks/results/soak-2core.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import dask
import dask.dataframe as dd
import distributed
import numpy as np
import pandas as pd
from distributed import Client

import mpshuffle
from mpshuffle.dask import bootstrap_dask_cluster, merge, shuffle

# The namespace harness lives with the tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from netns import can_make_namespaces, new_hosts

METRICS = ("threads", "fds", "rss_mib", "spill_entries")


def sample(dask_worker: Any = None) -> dict[str, float]:
    """One worker's threads, open fds, RSS (MiB) and mpshuffle entries in its spill directory (client.run)."""
    import os
    import threading

    import psutil

    plugin = dask_worker.plugins.get("mpshuffle")
    ctx = getattr(plugin, "context", None)
    directory = ctx.resource.spill_dir if ctx is not None else dask_worker.local_directory
    entries = 0
    if directory and os.path.isdir(directory):
        entries = sum(n.startswith("mpshuffle") for n in os.listdir(directory))
    return {
        "threads": threading.active_count(),
        "fds": len(os.listdir("/proc/self/fd")),
        "rss_mib": psutil.Process().memory_info().rss / 2**20,
        "spill_entries": entries,
        "spilled_runs": sum(
            s.get("bytes_spilled_disk", 0) > 0 for _, s in (ctx.history if ctx is not None else [])
        ),
    }


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ``ys`` against ``xs`` (0 for fewer than two points)."""
    if len(xs) < 2:
        return 0.0
    return float(np.polyfit(np.asarray(xs, dtype=float), np.asarray(ys, dtype=float), 1)[0])


def frame(n: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame({"k": rng.integers(0, 500, n), "v": np.arange(n), "x": rng.normal(size=n)})


def soak(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    bootstrap_dask_cluster(client, timeout=args.timeout, shared_memory=False, spill_host=args.spill_host)
    pdf = frame(args.rows, seed=7)
    right = pd.DataFrame({"k": np.arange(0, 500, 3), "w": np.arange(167)})
    want_join = pdf.merge(right, on="k").sort_values("v").reset_index(drop=True)
    ddf = dd.from_pandas(pdf, npartitions=4)
    dright = dd.from_pandas(right, npartitions=2)
    merge_every = max(1, args.shuffles // max(1, args.merges)) if args.merges else 0
    merges = 0

    def one_shuffle(npartitions: int) -> pd.DataFrame:
        if args.method == "mpshuffle":
            return shuffle(ddf, "k", npartitions=npartitions).compute()
        return ddf.shuffle("k", npartitions=npartitions, shuffle_method=args.method).compute()

    def one_merge() -> pd.DataFrame:
        if args.method == "mpshuffle":
            return merge(ddf, dright, on="k").compute()
        return dd.merge(ddf, dright, on="k", shuffle_method=args.method, broadcast=False).compute()

    def one_round(i: int) -> None:
        nonlocal merges
        out = one_shuffle(3 + i % 4)
        if len(out) != len(pdf) or out["v"].sum() != pdf["v"].sum():
            raise AssertionError(f"shuffle {i}: {len(out)} rows, sum {out['v'].sum()}")
        if merge_every and i % merge_every == 0 and merges < args.merges:
            joined = one_merge().sort_values("v").reset_index(drop=True)
            pd.testing.assert_frame_equal(joined[list(want_join.columns)], want_join)
            merges += 1

    for i in range(args.warmup):  # kernels compiled, pools and connections made
        one_round(i)
    samples: list[dict[str, Any]] = []

    def look(done: int) -> None:
        for worker, values in client.run(sample).items():
            samples.append({"shuffles": done, "worker": worker, "t": time.monotonic() - t0, **values})

    t0 = time.monotonic()
    look(0)
    merges = 0
    for i in range(args.shuffles):
        one_round(i)
        if (i + 1) % args.every == 0 or i + 1 == args.shuffles:
            look(i + 1)
    elapsed = time.monotonic() - t0
    return {"samples": samples, "elapsed_s": elapsed, "merges_done": merges}


def summarize(samples: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per worker and metric: slope per 100 shuffles, first, last, min, max."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for worker in sorted({s["worker"] for s in samples}):
        rows = [s for s in samples if s["worker"] == worker]
        xs = [r["shuffles"] for r in rows]
        out[worker] = {}
        for m in METRICS:
            ys = [float(r[m]) for r in rows]
            out[worker][m] = {
                "slope_per_100": 100 * slope(xs, ys), "first": ys[0], "last": ys[-1], "min": min(ys), "max": max(ys),
            }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shuffles", type=int, default=200, help="consecutive shuffles (default 200)")
    parser.add_argument("--merges", type=int, default=50, help="merges spread among them (default 50)")
    parser.add_argument("--every", type=int, default=10, help="sample the workers every N shuffles (default 10)")
    parser.add_argument("--warmup", type=int, default=4, help="rounds before the first sample (default 4)")
    parser.add_argument("--rows", type=int, default=5000, help="rows of the shuffled frame (default 5000)")
    parser.add_argument("--workers", type=int, default=3, help="worker namespaces (default 3)")
    parser.add_argument("--timeout", type=float, default=30.0, help="mpshuffle's timeout, s (default 30)")
    parser.add_argument(
        "--spill-host", default="64KiB", help="host budget per worker; small so that chunks spill (default 64KiB)"
    )
    parser.add_argument(
        "--method", choices=("mpshuffle", "tasks", "p2p"), default="mpshuffle",
        help="shuffle with mpshuffle, or with one of Dask's own methods as a baseline of the workers' own drift",
    )
    parser.add_argument("--out", default=None, help="write the run's JSON here")
    args = parser.parse_args()
    if args.shuffles < 1 or args.every < 1 or args.merges < 0:
        parser.error("--shuffles and --every must be >= 1, --merges >= 0")
    reason = can_make_namespaces()
    if reason:
        sys.exit(f"cannot run the soak here: {reason}")
    hosts = new_hosts(nworkers=args.workers, timeout=args.timeout)
    try:
        hosts.up()
        hosts.start()
        with Client(hosts.scheduler, timeout=30) as client:
            client.wait_for_workers(args.workers, timeout=60)
            result = soak(client, args)
    finally:
        hosts.down()
    summary = summarize(result["samples"])
    print(
        f"soak ({args.method}): {args.shuffles} shuffles, {result['merges_done']} merges on one client across {args.workers} "
        f"namespaces in {result['elapsed_s']:.1f} s (spill_host {args.spill_host}, sampled every {args.every})"
    )
    print(f"{'worker':<28} {'metric':<14} {'slope/100':>10} {'first':>9} {'last':>9} {'min':>9} {'max':>9}")
    for worker, metrics in summary.items():
        for m, v in metrics.items():
            print(
                f"{worker:<28} {m:<14} {v['slope_per_100']:>10.3f} {v['first']:>9.1f} {v['last']:>9.1f} "
                f"{v['min']:>9.1f} {v['max']:>9.1f}"
            )
    if args.out:
        record = {
            "config": {k.replace("-", "_"): v for k, v in vars(args).items() if k != "out"},
            "versions": {
                "python": platform.python_version(), "dask": dask.__version__,
                "distributed": distributed.__version__, "mpshuffle": mpshuffle.__version__,
            },
            "machine": {"cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg()},
            "elapsed_s": result["elapsed_s"],
            "merges_done": result["merges_done"],
            "summary": summary,
            "samples": result["samples"],
        }
        Path(args.out).write_text(json.dumps(record, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
