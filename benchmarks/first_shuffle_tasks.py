"""Where a fresh cluster's first config-line shuffle loses time: Dask's task stream, first against second.

Not a test. Starts a fresh ``LocalCluster`` (``--workers`` x 1 thread), persists
``config_line_bench``'s synthetic input (``--partitions`` x ``--rows``), then runs
``df.shuffle(..., ignore_index=True)`` with ``dataframe.shuffle.method = "mpshuffle"``
twice, each under :func:`distributed.get_task_stream`. Per shuffle and task prefix
(``mpshuffle-insert``, ``-start``, ``-extract``, ...) it prints the number of tasks,
the seconds of compute summed over workers, the longest task, and when the
first of them started and the last ended (seconds from the ``persist`` call),
plus the workers' CPU-seconds. Comparing the two shuffles shows whether the
first one's extra time is in longer tasks (one-time work inside them) or in
gaps between them (waiting).

Run: ``python benchmarks/first_shuffle_tasks.py [--workers 16] [--preload] [--json PATH]``
(``--preload``: bootstrap and load the kernels on every worker first, to tell that one-time
work from the rest).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict
from typing import Any

import dask
import psutil
from distributed import Client, LocalCluster, get_task_stream, wait

import mpshuffle.dask  # registers the method

try:
    from config_line_bench import synthetic
except ImportError:  # pragma: no cover
    from benchmarks.config_line_bench import synthetic


def _prefix(key: Any) -> str:
    name = str(key[0] if isinstance(key, tuple) else key)
    parts = name.split("-")
    return "-".join(p for p in parts if not (len(p) >= 16 and all(c in "0123456789abcdef" for c in p)))


def summarize(records: list[dict[str, Any]], t0: float) -> dict[str, dict[str, float]]:
    """Per task prefix: count, summed compute seconds, longest task, first start and last stop after ``t0``."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: {"n": 0, "compute_s": 0.0, "max_s": 0.0,
                                                         "first_start": 1e18, "last_stop": 0.0})
    for r in records:
        for ss in r.get("startstops", ()):
            if ss["action"] != "compute":
                continue
            d = out[_prefix(r["key"])]
            dur = ss["stop"] - ss["start"]
            d["n"] += 1
            d["compute_s"] += dur
            d["max_s"] = max(d["max_s"], dur)
            d["first_start"] = min(d["first_start"], ss["start"] - t0)
            d["last_stop"] = max(d["last_stop"], ss["stop"] - t0)
    return {k: {kk: round(vv, 3) for kk, vv in v.items()} for k, v in out.items()}


def _warmed_up() -> float | None:
    from mpshuffle.table.warm import warmed_up

    return warmed_up()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--partitions", type=int, default=120)
    p.add_argument("--rows", type=int, default=None, help="rows per partition (default: 0.7 GB per worker)")
    p.add_argument("--memory-limit", type=float, default=6.0, help="GiB per worker")
    p.add_argument("--preload", action="store_true",
                   help="bootstrap mpshuffle and wait for every worker's kernels before the first shuffle")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = args.rows or 700_000_000 * args.workers // 44 // args.partitions
    df, on = synthetic(args.partitions, rows)
    result: dict[str, Any] = {"args": vars(args) | {"rows": rows}, "shuffles": []}
    with (
        LocalCluster(n_workers=args.workers, threads_per_worker=1, memory_limit=f"{args.memory_limit}GiB",
                     dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        data = df.persist()
        wait(data)
        pids = list(client.run(os.getpid).values())
        if args.preload:
            t = time.time()
            mpshuffle.dask.bootstrap_dask_cluster(client)
            while None in client.run(_warmed_up).values():
                time.sleep(0.05)
            result["preload_s"] = round(time.time() - t, 3)
            print(f"bootstrap and kernels loaded on every worker in {result['preload_s']:.2f} s")
        for i in range(2):
            cpu0 = sum(sum(psutil.Process(q).cpu_times()[:2]) for q in pids)
            with get_task_stream(client) as ts:
                t0 = time.time()
                with dask.config.set({"dataframe.shuffle.method": "mpshuffle"}):
                    out = data.shuffle(on, npartitions=args.partitions, ignore_index=True).optimize()
                built = time.time() - t0  # the first graph also bootstraps a generation (early, best effort)
                out = out.persist()
                wait(out)
                seconds = time.time() - t0
            cpu = sum(sum(psutil.Process(q).cpu_times()[:2]) for q in pids) - cpu0
            stages = summarize(ts.data, t0)
            result["shuffles"].append({"seconds": round(seconds, 3), "graph_s": round(built, 3), "cpu_s": round(cpu, 2), "stages": stages})
            print(f"shuffle {i}: {seconds:.2f} s (graph built in {built:.2f} s), workers' CPU {cpu:.1f} s")
            for k, v in sorted(stages.items(), key=lambda kv: kv[1]["first_start"]):
                print(f"  {k:40s} n={v['n']:5.0f} compute {v['compute_s']:8.2f} s max {v['max_s']:6.2f} s "
                      f"start {v['first_start']:6.2f} stop {v['last_stop']:6.2f}")
            del out
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
