"""Time the TPC-H join (Q3 without customer) with mpshuffle and with Dask's P2P.

Not a test. Generates ``lineitem`` and ``orders`` with ``tpchgen-cli`` (parquet,
``--parts`` files per table) into a temporary directory, starts one
LocalCluster (2 workers x 1 thread by default), and runs
:func:`mpshuffle.demo.tpch.q_join` alternately with :func:`mpshuffle.dask.merge`
and with Dask's ``merge(..., shuffle_method="p2p", broadcast=False)`` on the
same cluster, ``--repeat`` times each, after one small warm-up of each. Both
answers are checked to agree (rows, revenue sum). Each timing covers reading
the parquet files, the join and the aggregate, up to the result on the client.

Writes ``benchmarks/results/tpch_join.json`` and prints a summary.

Run: ``python benchmarks/tpch_join.py [--sf 1] [--parts 8] [--repeat 2]``
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

import dask.dataframe as dd
import numpy as np
import psutil
from distributed import Client, LocalCluster

import mpshuffle
from mpshuffle.dask import bootstrap_dask_cluster
from mpshuffle.dask import merge as mpshuffle_merge
from mpshuffle.demo.tpch import generate, q_join, read_tables


def p2p_merge(left: dd.DataFrame, right: dd.DataFrame, **kwargs: Any) -> dd.DataFrame:
    """Dask's own hash join through its P2P shuffle (never a broadcast join)."""
    return dd.merge(left, right, shuffle_method="p2p", broadcast=False, **kwargs)


METHODS = {"mpshuffle": mpshuffle_merge, "p2p": p2p_merge}


def run_once(directory: Path, method: str, npartitions: int | None) -> tuple[float, int, float]:
    """Seconds for one query (read + join + aggregate), and its row count and revenue sum."""
    start = time.perf_counter()
    lineitem, orders = read_tables(directory)
    result = q_join(lineitem, orders, merge=METHODS[method], npartitions=npartitions).compute()
    seconds = time.perf_counter() - start
    return seconds, len(result), float(result["revenue"].sum())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sf", type=float, default=1.0, help="TPC-H scale factor")
    parser.add_argument(
        "--parts", type=int, default=8, help="parquet files per table (input partitions)"
    )
    parser.add_argument(
        "--npartitions", type=int, default=None, help="output partitions of the join"
    )
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--memory-limit", default="8GiB", help="per worker")
    parser.add_argument(
        "--out", default=str(Path(__file__).with_name("results") / "tpch_join.json")
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="mpshuffle-tpch-") as tmp:
        t0 = time.perf_counter()
        directory = generate(args.sf, Path(tmp) / "data", parts=args.parts)
        warm_dir = generate(0.01, Path(tmp) / "warm", parts=2)
        gen_s = time.perf_counter() - t0
        print(f"generated sf={args.sf} in {gen_s:.1f} s")
        with (
            LocalCluster(
                n_workers=args.workers,
                threads_per_worker=1,
                processes=True,
                dashboard_address=":0",
                memory_limit=args.memory_limit,
            ) as cluster,
            Client(cluster) as client,
        ):
            bootstrap_dask_cluster(client)
            for method in METHODS:
                run_once(warm_dir, method, None)
            times: dict[str, list[float]] = {m: [] for m in METHODS}
            answers: dict[str, tuple[int, float]] = {}
            for _ in range(args.repeat):
                for method in METHODS:
                    seconds, rows, revenue = run_once(directory, method, args.npartitions)
                    times[method].append(seconds)
                    answers[method] = (rows, revenue)
                    print(f"{method:>9}: {seconds:7.2f} s  ({rows} orders, revenue {revenue:.2f})")
    (rows_a, rev_a), (rows_b, rev_b) = answers["mpshuffle"], answers["p2p"]
    if rows_a != rows_b or not np.isclose(rev_a, rev_b, rtol=1e-9):
        raise SystemExit(
            f"answers differ: mpshuffle {answers['mpshuffle']} vs p2p {answers['p2p']}"
        )
    summary = {
        m: {"min_s": min(t), "median_s": statistics.median(t), "all_s": t} for m, t in times.items()
    }
    ratio = summary["p2p"]["median_s"] / summary["mpshuffle"]["median_s"]
    record = {
        "scale_factor": args.sf,
        "parts": args.parts,
        "npartitions": args.npartitions,
        "workers": args.workers,
        "threads_per_worker": 1,
        "orders_in_result": rows_a,
        "times": summary,
        "p2p_over_mpshuffle_median": ratio,
        "mpshuffle_version": mpshuffle.__version__,
        "machine": {
            "cpus": os.cpu_count(),
            "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "python": platform.python_version(),
            "load_average_at_end": os.getloadavg(),
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(
        f"median: mpshuffle {summary['mpshuffle']['median_s']:.2f} s, p2p {summary['p2p']['median_s']:.2f} s "
        f"(p2p / mpshuffle = {ratio:.2f}); written to {out}"
    )


if __name__ == "__main__":
    main()
