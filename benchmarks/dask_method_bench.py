"""Plain Dask code with only the shuffle method changed: mpshuffle, P2P and tasks in one run.

Not a test. The query is ordinary Dask: a TPC-H ``lineitem ⋈ orders`` hash
join (``dd.merge``) followed by ``groupby(...).agg(..., split_out=n)``
(revenue and quantity per customer). Each run sets only
``dask.config.set({"dataframe.shuffle.method": METHOD})``. Data: ``tpchgen-cli``
parquet, ``--parts`` files per table, in a temporary directory; one
LocalCluster for all runs; the methods take turns (``--repeat`` rounds, each
in a rotated order) after one warm-up of each on a small scale factor. The
three answers are checked to agree (groups, sums). Each timing covers reading
the parquet files, the join and the aggregation, up to the result on the
client; CPU seconds are the workers' (user + system) over the run.

Writes ``benchmarks/results/dask_method.json`` and prints a summary.

Run: ``python benchmarks/dask_method_bench.py [--sf 1] [--parts 8] [--split-out 8] [--repeat 3]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import dask
import dask.dataframe as dd
import pandas as pd
import psutil
from distributed import Client, LocalCluster

import mpshuffle
import mpshuffle.dask
from mpshuffle.demo.tpch import generate, read_tables

METHODS = ("mpshuffle", "p2p", "tasks")


def query(directory: Path, split_out: int) -> dd.DataFrame:
    """Revenue and quantity per customer: lineitem ⋈ orders, then a split_out groupby."""
    lineitem, orders = read_tables(directory)
    items = lineitem[["l_orderkey", "l_extendedprice", "l_discount", "l_quantity"]]
    items = items.assign(
        revenue=items["l_extendedprice"].astype("float64")
        * (1.0 - items["l_discount"].astype("float64")),
        quantity=items["l_quantity"].astype("float64"),
    )[["l_orderkey", "revenue", "quantity"]]
    heads = orders[["o_orderkey", "o_custkey"]]
    joined = items.merge(heads, left_on="l_orderkey", right_on="o_orderkey")
    return joined.groupby("o_custkey").agg(
        {"revenue": "sum", "quantity": "sum"}, split_out=split_out
    )


def _cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def run_once(client: Client, directory: Path, method: str, split_out: int) -> dict[str, Any]:
    pids = list(client.run(os.getpid).values())
    cpu0, start = _cpu(pids), time.perf_counter()
    with dask.config.set({"dataframe.shuffle.method": method}):
        q = query(directory, split_out).optimize()
        result = q.compute()
    seconds = time.perf_counter() - start
    names = [str(k[0] if isinstance(k, tuple) else k) for k in dict(q.dask)]
    mps_tasks = sum(n.startswith("mpshuffle") for n in names)
    # The graph of the mpshuffle run has mpshuffle's tasks, the others none.
    assert (mps_tasks > 0) == (method == "mpshuffle"), (method, mps_tasks)
    return {
        "seconds": seconds,
        "worker_cpu_seconds": _cpu(pids) - cpu0,
        "mpshuffle_tasks_in_graph": mps_tasks,
        "groups": len(result),
        "revenue": float(result["revenue"].sum()),
        "quantity": float(result["quantity"].sum()),
        "result": result,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sf", type=float, default=1.0, help="TPC-H scale factor")
    parser.add_argument("--parts", type=int, default=8, help="parquet files per table")
    parser.add_argument("--split-out", type=int, default=8, help="output partitions of the groupby")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--memory-limit", default="6GiB", help="per worker")
    parser.add_argument(
        "--out", default=str(Path(__file__).with_name("results") / "dask_method.json")
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="mpshuffle-dask-method-") as tmp:
        directory = generate(args.sf, Path(tmp) / "data", parts=args.parts)
        warm = generate(0.01, Path(tmp) / "warm", parts=2)
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in METHODS}
        with LocalCluster(
            n_workers=args.workers, threads_per_worker=1, memory_limit=args.memory_limit,
            dashboard_address=":0",
        ) as cluster, Client(cluster) as client:
            for m in METHODS:
                run_once(client, warm, m, 2)
            for r in range(args.repeat):
                order = METHODS[r % len(METHODS):] + METHODS[: r % len(METHODS)]
                for m in order:
                    out = run_once(client, directory, m, args.split_out)
                    runs[m].append(out)
                    print(f"round {r} {m:9s} {out['seconds']:7.2f} s "
                          f"(workers' CPU {out['worker_cpu_seconds']:6.1f} s)", flush=True)
        ref = runs["tasks"][0]["result"].sort_index()
        for m in METHODS:
            for out in runs[m]:
                got = out.pop("result").sort_index()
                pd.testing.assert_frame_equal(got, ref, check_exact=False, rtol=1e-9)

    def stats(values: list[float]) -> dict[str, float]:
        return {"min": min(values), "median": statistics.median(values), "max": max(values)}

    results = {
        "query": "lineitem ⋈ orders (dd.merge) -> groupby(o_custkey).agg(sum, split_out)",
        "sf": args.sf, "parts": args.parts, "split_out": args.split_out, "repeat": args.repeat,
        "workers": args.workers, "threads_per_worker": 1, "memory_limit": args.memory_limit,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "load_average_at_end": os.getloadavg()},
        "versions": {"mpshuffle": mpshuffle.__version__, "dask": dask.__version__,
                     "pandas": pd.__version__},
        "groups": runs["tasks"][0]["groups"],
        "methods": {
            m: {
                "seconds": stats([o["seconds"] for o in runs[m]]),
                "worker_cpu_seconds": stats([o["worker_cpu_seconds"] for o in runs[m]]),
                "runs": runs[m],
            }
            for m in METHODS
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    for m in METHODS:
        s = results["methods"][m]["seconds"]
        print(f"{m:9s} min {s['min']:7.2f}  median {s['median']:7.2f}  max {s['max']:7.2f} s")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
