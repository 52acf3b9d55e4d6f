"""What a shuffle graph costs before any data moves: mpshuffle next to Dask's own.

For each number of output partitions, builds ``shuffle(df, "k", npartitions=n)``
(mpshuffle) and ``df.shuffle("k", npartitions=n, shuffle_method=...)`` (Dask's
P2P and task shuffles) on a 2,000-row frame of 4 partitions, submits it to a
scheduler without workers and waits until the scheduler holds the output
tasks (nothing runs). Prints seconds (wall) and client CPU seconds for the
build and for the submission, min / median / max over the repetitions;
methods alternate within each repetition.

    .venv/bin/python benchmarks/graph_cost.py --sizes 10000 100000 --repeat 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import dask.dataframe as dd
import pandas as pd
from distributed import Client, LocalCluster

from mpshuffle.dask import shuffle


def _build(method: str, df: dd.DataFrame, n: int) -> Any:
    if method == "mpshuffle":
        return shuffle(df, "k", npartitions=n)
    return df.shuffle("k", npartitions=n, shuffle_method=method)


def _scheduler_tasks(dask_scheduler: Any) -> int:
    return len(dask_scheduler.tasks)


def _one(client: Client, method: str, df: dd.DataFrame, n: int) -> tuple[float, float, float, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    out = _build(method, df, n)
    t1, c1 = time.perf_counter(), time.process_time()
    fut = client.compute(out)
    # Submitted once the scheduler holds at least one task per output partition.
    while client.run_on_scheduler(_scheduler_tasks) < n:
        time.sleep(0.01)
    t2, c2 = time.perf_counter(), time.process_time()
    client.cancel(fut)
    del fut
    while client.run_on_scheduler(_scheduler_tasks):
        time.sleep(0.01)
    return t1 - t0, c1 - c0, t2 - t1, c2 - c1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--methods", nargs="+", default=["mpshuffle", "p2p", "tasks"])
    args = parser.parse_args()
    pdf = pd.DataFrame({"k": range(2000), "v": range(2000)})
    df = dd.from_pandas(pdf, npartitions=4)
    with LocalCluster(n_workers=0, dashboard_address=":0") as cluster, Client(cluster) as client:
        for n in args.sizes:
            runs: dict[str, list[tuple[float, float, float, float]]] = {m: [] for m in args.methods}
            for r in range(args.repeat + 1):
                order = args.methods if r % 2 == 0 else list(reversed(args.methods))
                for m in order:
                    result = _one(client, m, df, n)
                    if r:  # the first repetition warms up
                        runs[m].append(result)
            for m, rs in runs.items():
                cols = list(zip(*rs, strict=True))
                summary = "  ".join(
                    f"{name} {min(c):.2f}/{statistics.median(c):.2f}/{max(c):.2f}"
                    for name, c in zip(("build_s", "build_cpu_s", "submit_s", "submit_cpu_s"), cols, strict=True)
                )
                print(f"n={n:>7} {m:<9} min/median/max  {summary}", flush=True)


if __name__ == "__main__":
    main()
