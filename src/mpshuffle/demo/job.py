"""The README's main job, ``mpshuffle demo``.

It generates TPC-H ``lineitem`` and ``orders`` with tpchgen-cli, starts a
LocalCluster sized to the machine, shuffles lineitem on ``l_orderkey`` the
way a Dask user does (``df.shuffle(..., shuffle_method="mpshuffle")``),
verifies the result (row count, a checksum of every row, each key in one
output partition) and prints its throughput, then the same shuffle with
Dask's P2P on the same data and cluster and the ratio (``--no-compare``
skips it), then computes TPC-H Q3's
join (without ``customer``) with mpshuffle and checks it against DuckDB on
the same files. Needs the ``demo`` extra.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

__all__ = ["run"]


def run(args: Any) -> int:
    """Run the demo: generate TPC-H, shuffle lineitem, verify, and check the Q3 join.

    Parameters
    ----------
    args
        The parsed ``mpshuffle demo`` arguments: ``scale_factor``,
        ``workers`` (``None``: one per core, at least 2), ``partitions``
        (``None``: as many as the input), ``data_dir`` (``None``: a
        temporary directory), ``no_progress`` and ``no_compare``.

    Returns
    -------
    int
        0 if the shuffle and the join verified, 1 otherwise.
    """
    import tempfile

    import dask
    import dask.dataframe as dd
    import psutil
    from distributed import Client, LocalCluster, wait

    from mpshuffle.dask import bootstrap_dask_cluster
    from mpshuffle.demo import tpch

    # Before any worker runs: whether this run will compile the kernels.
    compiles = not kernels_cached()
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
        kept = "" if tmp is None else " (temporary: deleted when the demo ends; --data-dir keeps it)"
        print(f"  done in {time.perf_counter() - t0:.1f} s: {root}{kept}")
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
            # The user's one line: Dask's own df.shuffle with the method named.
            seconds, ok = _timed_shuffle(df, npartitions, "mpshuffle", args.no_progress)
            print(f"rows      {rows:,}")
            print(f"bytes     {nbytes:,} ({nbytes / 1e6:,.1f} MB)")
            print(f"seconds   {seconds:.2f}")
            print(f"MB/s      {nbytes / 1e6 / seconds:,.1f}")
            print("verified: " + ("OK" if ok else "FAILED"))
            if not args.no_compare:
                # P2P's scheduler plugin logs each shuffle's start and end as
                # WARNINGs (the LocalCluster's scheduler runs in this process).
                logging.getLogger("distributed.shuffle").setLevel(logging.ERROR)
                p2p, p2p_ok = _timed_shuffle(df, npartitions, "p2p", args.no_progress)
                print(f"Dask P2P  {p2p:.2f} s, {nbytes / 1e6 / p2p:,.1f} MB/s, same data and cluster "
                      f"(verified: {'OK' if p2p_ok else 'FAILED'})")
                print(f"mpshuffle {p2p / seconds:.1f}x as fast as Dask P2P here. MB/s depend on the machine "
                      "and its load; the ratio in one run is what compares with the README's 'Measured'.")
                if compiles:
                    print("This run also compiled mpshuffle's kernels (numba's cache had none: the first run "
                          "after installing): run it again for the steady figure.")
            join_ok = _join(df, root, npartitions, disable=args.no_progress)
            return 0 if ok and join_ok else 1
    finally:
        if tmp is not None:
            tmp.cleanup()


def kernels_cached() -> bool:
    """Whether numba's cache holds mpshuffle's insert kernels already (else the first shuffle compiles them).

    Looks for the kernels' cache index files (``_insert_kernels.*.nbi``)
    where numba keeps them: in ``NUMBA_CACHE_DIR`` alone when it is set,
    else in the ``__pycache__`` beside the module and in numba's per-user
    cache directory (used where the package's directory is not writable).

    Returns
    -------
    bool
        ``True`` if an index file is found in any of those places.
    """
    from pathlib import Path

    import numba

    from mpshuffle.table import _insert_kernels

    source = Path(_insert_kernels.__file__)
    pattern = f"{source.stem}.*.nbi"
    cache_dir = getattr(numba.config, "CACHE_DIR", "")  # NUMBA_CACHE_DIR, or ""
    if cache_dir:  # numba then uses this directory alone
        places = [Path(cache_dir)]
    else:
        places = [source.parent / "__pycache__", Path(os.path.expanduser("~")) / ".cache" / "numba"]
    return any(place.is_dir() and next(place.rglob(pattern), None) is not None for place in places)


def _timed_shuffle(df: Any, npartitions: int, method: str, no_progress: bool) -> tuple[float, bool]:
    """Seconds of ``df.shuffle("l_orderkey", ...)`` with ``shuffle_method=method``, and whether it verified."""
    from distributed import wait

    t0 = time.perf_counter()
    out = df.shuffle("l_orderkey", npartitions=npartitions, ignore_index=True,
                     shuffle_method=method).persist()
    _progress(out, f"shuffle ({method})", disable=no_progress)
    wait(out)
    seconds = time.perf_counter() - t0
    print(f"{method}: ", end="")
    ok = _verify(df, out)
    del out
    return seconds, ok


def _parquet_files(root: Any, table: str) -> list[str]:
    folder = os.path.join(root, table)
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".parquet"))


def _join(lineitem: Any, root: Any, npartitions: int, disable: bool) -> bool:
    """TPC-H Q3's join (lineitem ⨝ orders) through mpshuffle, checked against DuckDB."""
    import dask.dataframe as dd
    from distributed import wait

    from mpshuffle.demo import tpch

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

    from mpshuffle.demo import progress_bar

    futures = futures_of(collection)
    with progress_bar(len(futures), label, "partition", disable) as bar:
        for _ in as_completed(futures):
            bar.update(1)


def _verify(inp: Any, out: Any) -> bool:
    """Row count, an order-independent checksum of all rows, and key membership."""
    import dask
    import pandas as pd

    def checksum(part: pd.DataFrame) -> pd.Series:
        h = pd.util.hash_pandas_object(part.reset_index(drop=True), index=False).to_numpy()
        return pd.Series([len(part), int(h.sum(dtype="uint64"))], index=["rows", "sum"], dtype="uint64")

    def per_partition(ddf: Any) -> Any:
        return ddf.map_partitions(lambda p: checksum(p).to_frame().T, meta={"rows": "uint64", "sum": "uint64"})

    def totals(per: pd.DataFrame) -> tuple[int, int]:
        return int(per["rows"].sum()), int(per["sum"].to_numpy().sum(dtype="uint64"))

    # One compute for the four checks: the input is read once, and the scheduler sees one graph.
    per_in, per_out, keys, distinct_keys = dask.compute(
        per_partition(inp),
        per_partition(out),
        out.map_partitions(
            lambda p: pd.DataFrame({"k": p["l_orderkey"].drop_duplicates().to_numpy()}), meta={"k": "int64"}
        ),
        inp["l_orderkey"].map_partitions(lambda s: s.drop_duplicates(), meta=inp["l_orderkey"]._meta),
    )
    (rows_in, sum_in), (rows_out, sum_out) = totals(per_in), totals(per_out)
    distinct = distinct_keys.nunique()
    keys_ok = len(keys) == int(distinct)
    print(f"verify: rows {rows_out:,}/{rows_in:,}, checksum {'equal' if sum_in == sum_out else 'DIFFERENT'}, "
          f"each of {int(distinct):,} keys in one partition: {'yes' if keys_ok else 'NO'}")
    return rows_in == rows_out and sum_in == sum_out and keys_ok
