"""The TPC-H join (Q3 without customer) through mpshuffle equals DuckDB's answer on the same parquet."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from distributed import Client

from conftest import worker_state
from mpshuffle.demo.tpch import compare, generate, q_join, q_join_duckdb, read_tables


@pytest.fixture(scope="module")
def tpch_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(0.01, tmp_path_factory.mktemp("tpch"), parts=3)


def test_q_join_equals_duckdb(client: Client, tpch_dir: Path) -> None:
    lineitem, orders = read_tables(tpch_dir)
    assert lineitem.npartitions == orders.npartitions == 3
    got = q_join(lineitem, orders, npartitions=4).compute()
    exp = q_join_duckdb(tpch_dir)
    assert len(got) == len(exp) > 100
    got = got.sort_values("l_orderkey").reset_index(drop=True)
    exp = exp.sort_values("l_orderkey").reset_index(drop=True)
    assert got["l_orderkey"].tolist() == exp["l_orderkey"].tolist()
    assert got["o_shippriority"].tolist() == exp["o_shippriority"].tolist()
    assert [pd.Timestamp(d) for d in got["o_orderdate"]] == [
        pd.Timestamp(d) for d in exp["o_orderdate"]
    ]
    np.testing.assert_allclose(got["revenue"].to_numpy(), exp["revenue"].to_numpy(), rtol=1e-12)
    assert compare(got, exp, rtol=1e-12) == []
    assert all(s["shufflers"] == [] for s in client.run(worker_state).values())


def test_compare_names_differences(tpch_dir: Path) -> None:
    exp = q_join_duckdb(tpch_dir)
    assert compare(exp, exp.iloc[::-1]) == []
    worse = exp.copy()
    worse.loc[worse.index[0], "revenue"] += 1.0
    assert compare(worse, exp)[0].startswith("revenue differs")
    assert compare(exp.iloc[1:], exp) == [f"{len(exp) - 1} orders, expected {len(exp)}"]


def test_q_join_on_plain_dtypes_equals_duckdb(client: Client, tpch_dir: Path) -> None:
    """The demo's loader (float64 decimals, datetime64 dates) gives the same answer."""
    import dask.dataframe as dd

    from mpshuffle.demo.tpch import load_parquet

    lineitem = dd.from_map(load_parquet, sorted(str(p) for p in (tpch_dir / "lineitem").glob("*.parquet")))
    orders = dd.from_map(load_parquet, sorted(str(p) for p in (tpch_dir / "orders").glob("*.parquet")))
    got = q_join(lineitem, orders).compute()
    assert compare(got, q_join_duckdb(tpch_dir)) == []
