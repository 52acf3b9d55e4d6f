"""The TPC-H join (Q3 without customer) through mpshuffle equals DuckDB's answer on the same parquet."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from distributed import Client

from conftest import worker_state
from mpshuffle.tpch import CUTOFF, generate, q_join, read_tables

duckdb = pytest.importorskip("duckdb")  # a test dependency (extra "test"); the oracle only


@pytest.fixture(scope="module")
def tpch_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(0.01, tmp_path_factory.mktemp("tpch"), parts=3)


def _duckdb_answer(directory: Path) -> pd.DataFrame:
    sql = f"""
        SELECT l_orderkey, o_orderdate, o_shippriority,
               CAST(SUM(l_extendedprice * (1 - l_discount)) AS DOUBLE) AS revenue
        FROM read_parquet('{directory}/lineitem/*.parquet') AS l
        JOIN read_parquet('{directory}/orders/*.parquet') AS o ON l.l_orderkey = o.o_orderkey
        WHERE o_orderdate < DATE '{CUTOFF}' AND l_shipdate > DATE '{CUTOFF}'
        GROUP BY l_orderkey, o_orderdate, o_shippriority
    """
    return duckdb.sql(sql).df()


def test_q_join_equals_duckdb(client: Client, tpch_dir: Path) -> None:
    lineitem, orders = read_tables(tpch_dir)
    assert lineitem.npartitions == orders.npartitions == 3
    got = q_join(lineitem, orders, npartitions=4).compute()
    exp = _duckdb_answer(tpch_dir)
    assert len(got) == len(exp) > 100
    got = got.sort_values("l_orderkey").reset_index(drop=True)
    exp = exp.sort_values("l_orderkey").reset_index(drop=True)
    assert got["l_orderkey"].tolist() == exp["l_orderkey"].tolist()
    assert got["o_shippriority"].tolist() == exp["o_shippriority"].tolist()
    assert [pd.Timestamp(d) for d in got["o_orderdate"]] == [
        pd.Timestamp(d) for d in exp["o_orderdate"]
    ]
    np.testing.assert_allclose(got["revenue"].to_numpy(), exp["revenue"].to_numpy(), rtol=1e-12)
    assert all(s["shufflers"] == [] for s in client.run(worker_state).values())
