"""Command line: ``mpshuffle demo | bench | info``.

``mpshuffle demo`` is the README's main job: it generates TPC-H ``lineitem``
and ``orders`` with tpchgen-cli, starts a LocalCluster sized to the machine,
shuffles lineitem on ``l_orderkey`` with mpshuffle, verifies the result and
prints its throughput, then computes TPC-H Q3's join (without ``customer``)
with mpshuffle and checks it against DuckDB on the same files.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from mpshuffle._cliargs import positive_float, positive_int

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``mpshuffle`` command line.

    Parameters
    ----------
    argv
        Arguments without the program name; by default ``sys.argv[1:]``.

    Returns
    -------
    int
        The exit status: 0 on success, 1 if a verification failed.
    """
    parser = argparse.ArgumentParser(
        prog="mpshuffle",
        description="mpshuffle: fast, memory-bounded shuffles of dataframe partitions across a Dask cluster",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="shuffle TPC-H lineitem on a LocalCluster and report throughput")
    demo.add_argument("--scale-factor", "-s", type=positive_float, default=0.5,
                      help="TPC-H scale factor, > 0 (default 0.5: 3M rows, about 1 minute on 2 cores)")
    demo.add_argument("--workers", type=positive_int, default=None,
                      help="workers, >= 1 (default: one per core, at least 2)")
    demo.add_argument("--partitions", type=positive_int, default=None,
                      help="output partitions, >= 1 (default: as many as input)")
    demo.add_argument("--data-dir", default=None,
                      help="where to write the generated data (default: a temporary dir, deleted after); "
                           "lineitem and orders that an earlier run left there are deleted and generated anew")
    demo.add_argument("--no-progress", action="store_true", help="do not draw progress bars")
    sub.add_parser("info", help="print versions and available backends")
    from mpshuffle import bench

    bench.add_arguments(sub.add_parser("bench", help="mpshuffle vs Dask's P2P and task shuffles (JSON + PNG)"))
    args = parser.parse_args(argv)
    if args.command == "info":
        return _info()
    if args.command == "bench":
        return bench.run_and_report(args)
    return _demo(args)


def _info() -> int:
    import importlib
    import platform

    import mpshuffle

    print(f"mpshuffle   {mpshuffle.__version__}")
    print(f"python      {platform.python_version()} ({sys.executable})")
    for name in ("dask", "distributed", "pandas", "pyarrow", "numpy", "psutil"):
        mod = importlib.import_module(name)
        print(f"{name:<11} {getattr(mod, '__version__', '?')}")
    print("communicators:")
    print("  tcp         yes (distributed.comm: tcp://, tls://)")
    print("  local       yes (one process)")
    print("frame types:")
    print("  pandas      yes")
    print("  pyarrow     yes")
    for name, what in (("cupy", "GPU device tables, NCCL transport"), ("cudf", "cudf DataFrames")):
        try:
            importlib.import_module(name)
            print(f"  {name:<11} yes ({what})")
        except ImportError:
            print(f"  {name:<11} no  ({what}; not installed)")
        except Exception as e:  # noqa: BLE001 - e.g. CuPy installed but no CUDA driver: say so, go on
            print(f"  {name:<11} no  ({what}; import failed: {type(e).__name__}: {e})")
    return 0


def _demo(args: Any) -> int:
    import tempfile

    import dask
    import dask.dataframe as dd
    import psutil
    from distributed import Client, LocalCluster, wait

    from mpshuffle import tpch
    from mpshuffle.dask import bootstrap_dask_cluster, shuffle

    ncores = psutil.cpu_count(logical=True) or 2
    nworkers = max(2, ncores) if args.workers is None else args.workers
    memory_limit = int(psutil.virtual_memory().total * 0.8 / nworkers)
    tmp = None
    data_dir = args.data_dir
    if data_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="mpshuffle-demo-")
        data_dir = tmp.name
    try:
        print(f"generating TPC-H lineitem and orders at scale factor {args.scale_factor:g} "
              "with tpchgen-cli ...", flush=True)
        t0 = time.perf_counter()
        parts = max(nworkers * 8, 16)
        root = tpch.generate(args.scale_factor, data_dir, parts=parts)
        print(f"  done in {time.perf_counter() - t0:.1f} s: {root}")
        with dask.config.set({"distributed.worker.memory.target": False,
                              "distributed.worker.memory.spill": False}), \
                LocalCluster(n_workers=nworkers, threads_per_worker=1, memory_limit=memory_limit,
                             dashboard_address=":0") as cluster, Client(cluster) as client:
            print(f"LocalCluster: {nworkers} workers x 1 thread, memory_limit {memory_limit / 2**30:.1f} GiB each")
            df = dd.from_map(tpch.load_parquet, _parquet_files(root, "lineitem")).persist()
            wait(df)
            rows = int(df.shape[0].compute())
            nbytes = int(df.memory_usage(deep=True).sum().compute())
            print(f"input: {rows:,} rows, {nbytes / 1e6:,.1f} MB in memory, {df.npartitions} partitions")
            t0 = time.perf_counter()
            generation = bootstrap_dask_cluster(client)
            print(f"bootstrap: generation {generation.id}, {generation.nranks} ranks, "
                  f"{time.perf_counter() - t0:.3f} s")
            npartitions = df.npartitions if args.partitions is None else args.partitions
            t0 = time.perf_counter()
            out = shuffle(df, "l_orderkey", npartitions=npartitions, ignore_index=True).persist()
            _progress(out, "shuffle", disable=args.no_progress)
            wait(out)
            seconds = time.perf_counter() - t0
            ok = _verify(df, out)
            print(f"rows      {rows:,}")
            print(f"bytes     {nbytes:,} ({nbytes / 1e6:,.1f} MB)")
            print(f"seconds   {seconds:.2f}")
            print(f"MB/s      {nbytes / 1e6 / seconds:,.1f}")
            print("verified: " + ("OK" if ok else "FAILED"))
            del out
            join_ok = _join(df, root, npartitions, disable=args.no_progress)
            return 0 if ok and join_ok else 1
    finally:
        if tmp is not None:
            tmp.cleanup()


def _parquet_files(root: Any, table: str) -> list[str]:
    folder = os.path.join(root, table)
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".parquet"))


def _join(lineitem: Any, root: Any, npartitions: int, disable: bool) -> bool:
    """TPC-H Q3's join (lineitem ⨝ orders) through mpshuffle, checked against DuckDB."""
    import dask.dataframe as dd
    from distributed import wait

    from mpshuffle import tpch

    orders = dd.from_map(tpch.load_parquet, _parquet_files(root, "orders")).persist()
    wait(orders)
    t0 = time.perf_counter()
    answer = tpch.q_join(lineitem, orders, npartitions=npartitions).persist()
    _progress(answer, "join", disable=disable)
    wait(answer)
    seconds = time.perf_counter() - t0
    got = answer.compute()
    problems = tpch.compare(got, tpch.q_join_duckdb(root))
    print(f"TPC-H Q3 join (lineitem x orders, no customer): {len(got):,} orders, "
          f"revenue {got['revenue'].sum():,.2f}, {seconds:.2f} s")
    print("join checked against DuckDB: " + ("OK" if not problems else "FAILED: " + "; ".join(problems)))
    return not problems


def _progress(collection: Any, label: str, disable: bool) -> None:
    from distributed import as_completed, futures_of
    from tqdm import tqdm

    futures = futures_of(collection)
    with tqdm(total=len(futures), desc=label, unit="partition", disable=disable) as bar:
        for _ in as_completed(futures):
            bar.update(1)


def _verify(inp: Any, out: Any) -> bool:
    """Row count, an order-independent checksum of all rows, and key membership."""
    import pandas as pd

    def checksum(part: pd.DataFrame) -> pd.Series:
        h = pd.util.hash_pandas_object(part.reset_index(drop=True), index=False).to_numpy()
        return pd.Series([len(part), int(h.sum(dtype="uint64"))], index=["rows", "sum"], dtype="uint64")

    def summarize(ddf: Any) -> tuple[int, int]:
        per = ddf.map_partitions(lambda p: checksum(p).to_frame().T, meta={"rows": "uint64", "sum": "uint64"}).compute()
        return int(per["rows"].sum()), int(per["sum"].to_numpy().sum(dtype="uint64"))

    rows_in, sum_in = summarize(inp)
    rows_out, sum_out = summarize(out)
    keys = out.map_partitions(
        lambda p: pd.DataFrame({"k": p["l_orderkey"].drop_duplicates().to_numpy()}), meta={"k": "int64"}
    ).compute()
    distinct = inp["l_orderkey"].map_partitions(
        lambda s: s.drop_duplicates(), meta=inp["l_orderkey"]._meta
    ).compute().nunique()
    keys_ok = len(keys) == int(distinct)
    print(f"verify: rows {rows_out:,}/{rows_in:,}, checksum {'equal' if sum_in == sum_out else 'DIFFERENT'}, "
          f"each of {int(distinct):,} keys in one partition: {'yes' if keys_ok else 'NO'}")
    return rows_in == rows_out and sum_in == sum_out and keys_ok


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
