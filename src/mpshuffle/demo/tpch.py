"""A TPC-H join for the demo and benchmarks: ``lineitem ⨝ orders`` on the order key.

:func:`q_join` is TPC-H Q3 without the ``customer`` table (TPC-H
specification 2.18, query 3): orders placed before 1995-03-15 joined to their
line items shipped after that day, revenue ``extendedprice * (1 - discount)``
summed per order. Unlike Q3 it returns every order's revenue, not the top 10,
so a check against another engine compares every group.

:func:`generate` writes the tables with ``tpchgen-cli`` (from the ``demo`` extra).
"""

from __future__ import annotations

import datetime
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dask.dataframe as dd
import numpy as np
import pandas as pd

from mpshuffle.demo import EXTRA, tpchgen_path

__all__ = ["CUTOFF", "TABLES", "compare", "generate", "load_parquet", "q_join", "q_join_duckdb", "read_tables"]

#: The date that splits orders from shipments (Q3's substitution parameter default).
CUTOFF = datetime.date(1995, 3, 15)

_GROUP = ["l_orderkey", "o_orderdate", "o_shippriority"]


#: The tables that ``tpchgen-cli`` writes (TPC-H specification 1.4).
TABLES = ("region", "nation", "supplier", "customer", "part", "partsupp", "orders", "lineitem")


def generate(
    scale_factor: float,
    out_dir: str | os.PathLike[str],
    parts: int = 1,
    tables: tuple[str, ...] = ("lineitem", "orders"),
) -> Path:
    """Write TPC-H tables (by default ``lineitem`` and ``orders``) as parquet with ``tpchgen-cli``.

    Whatever an earlier call left in ``out_dir`` for the same tables
    (``out_dir/<table>/`` and ``out_dir/<table>.parquet``) is deleted first,
    so afterwards ``out_dir`` holds exactly this call's files of those tables:
    ``tpchgen-cli`` skips files that exist, and a reused directory would
    otherwise mix scale factors or part counts without any error. Other files
    and other tables in ``out_dir`` are left alone.

    Parameters
    ----------
    scale_factor
        TPC-H scale factor (1 is about 6 million line items, 1.5 million orders);
        ``tpchgen-cli`` refuses negative values.
    out_dir
        Directory to write into (created if needed).
    parts
        Files per table, >= 1; ``> 1`` writes ``out_dir/<table>/<table>.<i>.parquet``
        (``i`` from 1), ``1`` writes ``out_dir/<table>.parquet``.
    tables
        Names of the tables to write, from :data:`TABLES`.

    Returns
    -------
    pathlib.Path
        ``out_dir``.

    Raises
    ------
    ValueError
        If ``parts`` < 1 or a table is not a TPC-H table.
    FileNotFoundError
        If ``tpchgen-cli`` is neither next to the Python executable nor on ``PATH``.
    RuntimeError
        If ``tpchgen-cli`` fails (for example for a negative ``scale_factor``);
        the message holds its exit status, command line and standard error.
    """
    if isinstance(parts, bool) or not isinstance(parts, int | np.integer) or parts < 1:
        raise ValueError(f"parts must be an integer >= 1, got {parts!r}")
    unknown = [t for t in tables if t not in TABLES]
    if unknown or not tables:
        raise ValueError(f"tables must be TPC-H tables out of {TABLES}, got {tuple(tables)!r}")
    cli = tpchgen_path()
    if cli is None:
        raise FileNotFoundError(
            f"tpchgen-cli not found; it comes with the {EXTRA!r} extra (pip install -e \".[{EXTRA}]\")"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for table in tables:
        _remove(out / table)
        _remove(out / f"{table}.parquet")
    cmd = [
        cli,
        "parquet",
        # '=' keeps a negative value from reading as an option, so that
        # tpchgen-cli's error names the scale factor.
        f"--scale-factor={scale_factor}",
        f"--tables={','.join(tables)}",
        f"--output-dir={out}",
    ]
    if parts > 1:
        cmd.append(f"--parts={int(parts)}")
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        stderr = proc.stderr.strip() or "(nothing on stderr)"
        raise RuntimeError(f"tpchgen-cli failed with exit status {proc.returncode}: {' '.join(cmd)}\n{stderr}")
    return out


def _remove(path: Path) -> None:
    # A link is removed, not followed: only what generate() wrote is deleted.
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def load_parquet(path: str | os.PathLike[str]) -> pd.DataFrame:
    """Read one parquet file written by tpchgen-cli into pandas with plain dtypes.

    Decimals become ``float64``, dates ``datetime64[ms]`` and strings pandas'
    ``str`` (tpchgen-cli writes Arrow ``string_view``, which pandas cannot hold
    in an ``ArrowDtype``), so that frames are cheap to hold and shuffle.

    Parameters
    ----------
    path
        A parquet file.

    Returns
    -------
    pandas.DataFrame
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    fields = []
    for field in table.schema:
        t = field.type
        if pa.types.is_decimal(t):
            t = pa.float64()
        elif pa.types.is_date(t):
            t = pa.timestamp("ms")
        elif pa.types.is_string_view(t) or pa.types.is_large_string(t):
            t = pa.string()
        fields.append(pa.field(field.name, t))
    return table.cast(pa.schema(fields)).to_pandas()


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
    items = items[items["l_shipdate"] > _cutoff_for(items["l_shipdate"])]
    items = items.assign(
        revenue=items["l_extendedprice"].astype("float64")
        * (1.0 - items["l_discount"].astype("float64"))
    )[["l_orderkey", "revenue"]]
    heads = orders[["o_orderkey", "o_orderdate", "o_shippriority"]]
    heads = heads[heads["o_orderdate"] < _cutoff_for(heads["o_orderdate"])]
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


def _cutoff_for(dates: Any) -> Any:
    # dask.read_parquet gives Arrow date32 (compared with a date); load_parquet
    # gives numpy datetime64 (compared with a Timestamp).
    if isinstance(dates.dtype, np.dtype) and dates.dtype.kind == "M":
        return pd.Timestamp(CUTOFF)
    return CUTOFF


def _revenue_per_order(part: pd.DataFrame) -> pd.DataFrame:
    # One order's rows are in one partition (hash join on the order key), so
    # a per-partition group-by is the whole aggregate.
    out: Any = part.groupby(_GROUP, sort=False, observed=True)["revenue"].sum().reset_index()
    return out


def q_join_duckdb(directory: str | os.PathLike[str]) -> pd.DataFrame:
    """The answer of :func:`q_join` computed by DuckDB on the same parquet files.

    DuckDB is the oracle that checks mpshuffle's answer (it is not used to
    compute anything else).

    Parameters
    ----------
    directory
        Where :func:`generate` wrote ``lineitem`` and ``orders``.

    Returns
    -------
    pandas.DataFrame
        Columns ``l_orderkey``, ``o_orderdate``, ``o_shippriority``,
        ``revenue`` (float64), one row per order, in no particular order.
    """
    import duckdb

    root = Path(directory)

    def source(name: str) -> str:
        return str(root / name / "*.parquet") if (root / name).is_dir() else str(root / f"{name}.parquet")

    sql = f"""
        SELECT l_orderkey, o_orderdate, o_shippriority,
               CAST(SUM(l_extendedprice * (1 - l_discount)) AS DOUBLE) AS revenue
        FROM read_parquet('{source("lineitem")}') AS l
        JOIN read_parquet('{source("orders")}') AS o ON l.l_orderkey = o.o_orderkey
        WHERE o_orderdate < DATE '{CUTOFF}' AND l_shipdate > DATE '{CUTOFF}'
        GROUP BY l_orderkey, o_orderdate, o_shippriority
    """
    with duckdb.connect() as con:
        return con.sql(sql).df()


def compare(got: pd.DataFrame, expected: pd.DataFrame, rtol: float = 1e-9) -> list[str]:
    """Differences between two answers of :func:`q_join` (empty if they agree).

    Rows are matched by order key; dates are compared as timestamps (engines
    return ``date`` objects or ``datetime64``), revenue to relative
    tolerance ``rtol`` (float64 sums in different orders).

    Parameters
    ----------
    got, expected
        Frames with columns ``l_orderkey``, ``o_orderdate``, ``o_shippriority``,
        ``revenue``.

    Returns
    -------
    list of str
        One line per kind of difference found.
    """
    problems = []
    if len(got) != len(expected):
        problems.append(f"{len(got)} orders, expected {len(expected)}")
        return problems
    a = got.sort_values("l_orderkey").reset_index(drop=True)
    b = expected.sort_values("l_orderkey").reset_index(drop=True)
    if not np.array_equal(a["l_orderkey"].to_numpy(), b["l_orderkey"].to_numpy()):
        problems.append("order keys differ")
        return problems
    if not np.array_equal(a["o_shippriority"].to_numpy(), b["o_shippriority"].to_numpy()):
        problems.append("o_shippriority differs")
    if not (pd.to_datetime(a["o_orderdate"]).to_numpy() == pd.to_datetime(b["o_orderdate"]).to_numpy()).all():
        problems.append("o_orderdate differs")
    if not np.allclose(a["revenue"].to_numpy(), b["revenue"].to_numpy(), rtol=rtol, atol=0):
        worst = float(np.max(np.abs(a["revenue"].to_numpy() - b["revenue"].to_numpy())))
        problems.append(f"revenue differs (largest difference {worst:g})")
    return problems
