"""A TPC-H join for the demo and benchmarks: ``lineitem ⨝ orders`` on the order key.

:func:`q_join` is TPC-H Q3 without the ``customer`` table (TPC-H
specification 2.18, query 3): orders placed before 1995-03-15 joined to their
line items shipped after that day, revenue ``extendedprice * (1 - discount)``
summed per order. Unlike Q3 it returns every order's revenue, not the top 10,
so a check against another engine compares every group.

:func:`generate` writes the tables with ``tpchgen-cli`` (a dependency).
"""

from __future__ import annotations

import datetime
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dask.dataframe as dd
import pandas as pd

__all__ = ["CUTOFF", "generate", "q_join", "read_tables"]

#: The date that splits orders from shipments (Q3's substitution parameter default).
CUTOFF = datetime.date(1995, 3, 15)

_GROUP = ["l_orderkey", "o_orderdate", "o_shippriority"]


def generate(scale_factor: float, out_dir: str | os.PathLike[str], parts: int = 1) -> Path:
    """Write ``lineitem`` and ``orders`` as parquet with ``tpchgen-cli``.

    Parameters
    ----------
    scale_factor
        TPC-H scale factor (1 is about 6 million line items, 1.5 million orders).
    out_dir
        Directory to write into (created if needed).
    parts
        Files per table; ``> 1`` writes ``out_dir/<table>/<table>.<i>.parquet``.

    Returns
    -------
    pathlib.Path
        ``out_dir``.

    Raises
    ------
    FileNotFoundError
        If ``tpchgen-cli`` is neither next to the Python executable nor on ``PATH``.
    subprocess.CalledProcessError
        If the generator fails.
    """
    exe = Path(sys.executable).with_name("tpchgen-cli")
    cli = str(exe) if exe.exists() else shutil.which("tpchgen-cli")
    if cli is None:
        raise FileNotFoundError("tpchgen-cli not found (pip install tpchgen-cli)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        cli,
        "parquet",
        "-s",
        str(scale_factor),
        "--tables=lineitem,orders",
        f"--output-dir={out}",
    ]
    if parts > 1:
        cmd.append(f"--parts={int(parts)}")
    subprocess.run(cmd, check=True, capture_output=True)
    return out


def read_tables(directory: str | os.PathLike[str]) -> tuple[dd.DataFrame, dd.DataFrame]:
    """Read ``lineitem`` and ``orders`` written by :func:`generate` (one or many parts).

    Returns
    -------
    (lineitem, orders)
        Dask DataFrames, one partition per file.
    """
    root = Path(directory)
    tables = []
    for name in ("lineitem", "orders"):
        path = root / name if (root / name).is_dir() else root / f"{name}.parquet"
        tables.append(dd.read_parquet(str(path)))
    return tables[0], tables[1]


def q_join(
    lineitem: dd.DataFrame,
    orders: dd.DataFrame,
    *,
    merge: Callable[..., dd.DataFrame] | None = None,
    npartitions: int | None = None,
) -> dd.DataFrame:
    """Revenue per order of TPC-H Q3's join (without ``customer``), through a hash join.

    Parameters
    ----------
    lineitem, orders
        The TPC-H tables (columns as ``tpchgen-cli`` writes them).
    merge
        ``merge(left, right, how=, left_on=, right_on=, npartitions=)`` used for
        the join; :func:`mpshuffle.dask.merge` by default. It must return a
        frame hash partitioned on the key (so that one order's rows share a
        partition): with Dask's own merge pass ``broadcast=False``.
    npartitions
        Output partitions of the join; by default the larger input's count.

    Returns
    -------
    dask.dataframe.DataFrame
        Columns ``l_orderkey`` (int64), ``o_orderdate`` (date), ``o_shippriority``
        (int32), ``revenue`` (float64, currency units): one row per order
        placed before :data:`CUTOFF` with a line item shipped after it.

    Notes
    -----
    Revenue is summed in float64 (the parquet columns are ``decimal(15, 2)``),
    so it agrees with an exact decimal sum to about 1e-12 relative.
    """
    if merge is None:
        from mpshuffle.dask.join import merge as mpshuffle_merge

        merge = mpshuffle_merge
    items = lineitem[["l_orderkey", "l_extendedprice", "l_discount", "l_shipdate"]]
    items = items[items["l_shipdate"] > CUTOFF]
    items = items.assign(
        revenue=items["l_extendedprice"].astype("float64")
        * (1.0 - items["l_discount"].astype("float64"))
    )[["l_orderkey", "revenue"]]
    heads = orders[["o_orderkey", "o_orderdate", "o_shippriority"]]
    heads = heads[heads["o_orderdate"] < CUTOFF]
    joined = merge(
        items,
        heads,
        how="inner",
        left_on="l_orderkey",
        right_on="o_orderkey",
        npartitions=npartitions,
    )
    meta = _revenue_per_order(joined._meta)
    return joined.map_partitions(_revenue_per_order, meta=meta)


def _revenue_per_order(part: pd.DataFrame) -> pd.DataFrame:
    # One order's rows are in one partition (hash join on the order key), so
    # a per-partition group-by is the whole aggregate.
    out: Any = part.groupby(_GROUP, sort=False, observed=True)["revenue"].sum().reset_index()
    return out
