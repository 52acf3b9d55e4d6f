"""Peak memory of a shuffle far larger than the host budget: mpshuffle vs Dask's P2P.

Not a test. On a LocalCluster of 2 workers x 1 thread (explicit memory
limit) it shuffles data of at least 4x the sum of the workers' mpshuffle host
budgets, generated on the workers with numpy (int64 key, float64, string),
while a background thread samples every worker's RSS with psutil. Then it
runs Dask's P2P shuffle of the same data on a fresh cluster of the same
shape, sampled the same way. For each worker it prints the peak RSS next to the bound

    idle RSS (after bootstrap and a tiny warm-up shuffle) + host budget
    + 2 x the largest input or output partition's in-memory size

and writes everything to ``benchmarks/results/memory_budget.json``.

Run: ``python benchmarks/memory_budget.py [--gb 0.6] [--budget-mib 64]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import threading
import time
from typing import Any

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import psutil
import pyarrow as pa
import pyarrow.compute as pc
from distributed import Client, LocalCluster

import mpshuffle
from mpshuffle.dask import bootstrap_dask_cluster, gather_statistics, shuffle

MiB = 2**20
# Bytes per row in memory: int64 + float64 + an 11-character pyarrow string
# (11 bytes of data + a 4-byte offset) — the generator below aims at this.
ROW_BYTES = 8 + 8 + 15


def make_partition(i: int, nrows: int) -> pd.DataFrame:
    """Input partition ``i``: ``nrows`` rows of int64 key, float64 and string columns.

    The strings are the key's last ten digits after a ``1``, made by Arrow's
    cast (~0.1 s a partition of 800k rows; formatting them in numpy took
    ~2 s, which both shuffles paid and which hid the difference between them).
    """
    rng = np.random.default_rng(i)
    keys = rng.integers(0, 2**40, nrows, dtype=np.int64)
    strings = pc.cast(pa.array(keys % 10**10 + 10**10), pa.string())
    return pd.DataFrame(
        {
            "k": keys,
            "x": rng.random(nrows),
            "s": strings.to_pandas(types_mapper=lambda _: pd.StringDtype("pyarrow", na_value=np.nan)),
        }
    )


def partition_sizes(df: pd.DataFrame) -> pd.DataFrame:
    """One row per partition: its row count and in-memory size in bytes."""
    return pd.DataFrame({"rows": [len(df)], "nbytes": [int(df.memory_usage(deep=True, index=True).sum())]})


class RSSSampler:
    """Samples the RSS of a set of processes in a background thread.

    Parameters
    ----------
    pids
        Worker address -> process id.
    interval
        Seconds between samples.
    """

    def __init__(self, pids: dict[str, int], interval: float = 0.02) -> None:
        self.procs = {w: psutil.Process(pid) for w, pid in pids.items()}
        self.interval = interval
        self.peak = {w: 0 for w in pids}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for w, p in self.procs.items():
                try:
                    rss = p.memory_info().rss
                except psutil.Error:
                    continue
                self.peak[w] = max(self.peak[w], rss)
            self.samples += 1
            self._stop.wait(self.interval)

    def __enter__(self) -> RSSSampler:  # noqa: PYI034
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def worker_pids(client: Client) -> dict[str, int]:
    return client.run(os.getpid)  # type: ignore[no-any-return]


def idle_rss(client: Client) -> dict[str, int]:
    """RSS of every worker after letting it settle for a moment."""
    time.sleep(1.0)
    return {w: psutil.Process(pid).memory_info().rss for w, pid in worker_pids(client).items()}


def build_input(nparts: int, rows: int) -> dd.DataFrame:
    return dd.from_map(make_partition, range(nparts), nrows=rows, enforce_metadata=False)


def run_phase(name: str, client: Client, shuffled: dd.DataFrame) -> dict[str, Any]:
    """Compute the sizes of ``shuffled``'s partitions while sampling RSS."""
    pids = worker_pids(client)
    with RSSSampler(pids) as sampler:
        t0 = time.perf_counter()
        sizes = shuffled.map_partitions(partition_sizes, meta={"rows": "i8", "nbytes": "i8"}).compute()
        seconds = time.perf_counter() - t0
    return {
        "name": name,
        "seconds": seconds,
        "rows": int(sizes["rows"].sum()),
        "largest_output_partition_bytes": int(sizes["nbytes"].max()),
        "peak_rss": sampler.peak,
        "samples": sampler.samples,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=0.6, help="in-memory size of the data, GB (1e9 bytes)")
    parser.add_argument("--partitions", type=int, default=40, help="input and output partitions")
    parser.add_argument("--budget-mib", type=int, default=64, help="mpshuffle host budget per worker, MiB")
    parser.add_argument("--memory-limit", default="4GiB", help="memory_limit of each worker")
    parser.add_argument(
        "--arrow-pool", default="system",
        help="ARROW_DEFAULT_MEMORY_POOL of the workers (both shuffles): 'system' returns freed "
        "memory at once; Arrow's default allocator keeps it for reuse, which hides the peak",
    )
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results", "memory_budget.json")
    )
    args = parser.parse_args()

    if args.arrow_pool:
        # Inherited by the worker processes (and set the same for both shuffles).
        os.environ["ARROW_DEFAULT_MEMORY_POOL"] = args.arrow_pool
    nworkers = 2
    budget = args.budget_mib * MiB
    rows = int(args.gb * 1e9 / ROW_BYTES / args.partitions)
    result: dict[str, Any] = {
        "workers": nworkers,
        "threads_per_worker": 1,
        "memory_limit": args.memory_limit,
        "host_budget_bytes": budget,
        "partitions": args.partitions,
        "arrow_memory_pool": args.arrow_pool,
        "rows_per_partition": rows,
        "versions": {
            "mpshuffle": getattr(mpshuffle, "__version__", "?"),
            "dask": dask.__version__,
            "pandas": pd.__version__,
            "python": platform.python_version(),
        },
        "cpus": os.cpu_count(),
    }
    df = build_input(args.partitions, rows)
    # Each shuffle gets a fresh cluster of the same shape, so that neither
    # starts from the other's leftovers.
    for kind in ("mpshuffle", "p2p"):
        with LocalCluster(
            n_workers=nworkers, threads_per_worker=1, processes=True,
            memory_limit=args.memory_limit, dashboard_address=":0",
        ) as cluster, Client(cluster) as client:
            warm = dd.from_pandas(make_partition(0, 1000), npartitions=2)
            if kind == "mpshuffle":
                inputs = df.map_partitions(partition_sizes, meta={"rows": "i8", "nbytes": "i8"}).compute()
                total = int(inputs["nbytes"].sum())
                result["data_bytes"] = total
                result["largest_input_partition_bytes"] = int(inputs["nbytes"].max())
                result["data_over_budgets"] = total / (nworkers * budget)
                print(
                    f"data: {total / MiB:.0f} MiB in {args.partitions} partitions "
                    f"(largest {inputs['nbytes'].max() / MiB:.1f} MiB) = "
                    f"{result['data_over_budgets']:.1f} x the sum of the host budgets "
                    f"({nworkers} x {args.budget_mib} MiB)",
                    flush=True,
                )
                bootstrap_dask_cluster(client, spill_host=budget)
                shuffle(warm, "k", npartitions=2).compute()
                idle = idle_rss(client)
                phase = run_phase(kind, client, shuffle(df, "k", npartitions=args.partitions))
                stats = gather_statistics(client)
                phase["statistics"] = {w: runs[-1] for w, runs in stats.items() if runs}
            else:
                warm.shuffle("k", npartitions=2, shuffle_method="p2p").compute()
                idle = idle_rss(client)
                shuffled = df.shuffle("k", npartitions=args.partitions, shuffle_method="p2p")
                phase = run_phase(kind, client, shuffled)
            phase["idle_rss"] = idle
            result[kind] = phase
            print(f"{kind}: {phase['seconds']:.1f} s, peak RSS {phase['peak_rss']}", flush=True)
    mps, p2p = result["mpshuffle"], result["p2p"]

    largest = max(
        result["largest_input_partition_bytes"],
        mps["largest_output_partition_bytes"],
        p2p["largest_output_partition_bytes"],
    )
    result["largest_partition_bytes"] = largest
    ok = True
    print(f"\n{'':>10} {'worker':<24} {'idle':>9} {'peak':>9} {'bound':>9} {'within':>7}   seconds")
    for phase in (mps, p2p):
        phase["bound"] = {}
        phase["within_bound"] = {}
        for i, w in enumerate(sorted(phase["peak_rss"])):
            # Each shuffle ran on its own cluster: match workers by their sorted order.
            idle_w = sorted(phase["idle_rss"].items())[i][1]
            bound = idle_w + budget + 2 * largest
            phase["bound"][w] = bound
            phase["within_bound"][w] = phase["peak_rss"][w] <= bound
            print(
                f"{phase['name']:>10} {w:<24} {idle_w / MiB:7.0f}Mi {phase['peak_rss'][w] / MiB:7.0f}Mi "
                f"{bound / MiB:7.0f}Mi {phase['within_bound'][w]!s:>7}   {phase['seconds']:.1f}"
            )
        assert phase["rows"] == args.partitions * rows, (phase["name"], phase["rows"])
    ok = all(mps["within_bound"].values())
    mps_peak, p2p_peak = max(mps["peak_rss"].values()), max(p2p["peak_rss"].values())
    result["mpshuffle_within_bound"] = ok
    result["mpshuffle_peak_below_p2p"] = mps_peak < p2p_peak
    spilled = sum(s["bytes_spilled_disk"] for s in mps["statistics"].values())
    print(
        f"\nmpshuffle: spilled {spilled / MiB:.0f} MiB; peak {mps_peak / MiB:.0f} MiB vs P2P peak "
        f"{p2p_peak / MiB:.0f} MiB (ratio {mps_peak / p2p_peak:.2f}); within bound on every worker: {ok}; "
        f"seconds mpshuffle {mps['seconds']:.1f} vs P2P {p2p['seconds']:.1f}"
    )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2, sort_keys=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
