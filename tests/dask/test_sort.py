"""mpshuffle.dask.sort_values / set_index: global order, divisions, ties, skew."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from distributed import Client

from conftest import worker_state
from mpshuffle.dask import set_index, sort_values
from mpshuffle.dask.sort import RangePartitioner


def _parts(client: Client, df: dd.DataFrame) -> list[pd.DataFrame]:
    return list(client.compute(df.to_delayed(), sync=True))


def _input(n: int = 3000, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    x = rng.integers(-500, 500, n).astype("float64")
    x[rng.random(n) < 0.02] = np.nan
    pdf = pd.DataFrame(
        {"x": x, "y": rng.integers(0, 6, n), "s": rng.choice([f"s{i:02d}" for i in range(30)], n)},
        index=pd.Index(rng.permutation(n), name="i"),
    )
    return dd.from_pandas(pdf, npartitions=1).compute()


def _no_overlap(parts: list[pd.DataFrame], col: str, ascending: bool = True) -> None:
    """Consecutive non-empty partitions do not overlap: ties are in one partition."""
    ranges = [(p[col].min(), p[col].max()) for p in parts if p[col].notna().any()]
    for (lo1, hi1), (lo2, hi2) in itertools.pairwise(ranges):
        assert (hi1 < lo2) if ascending else (lo1 > hi2)


@pytest.mark.parametrize("ascending", [True, False])
@pytest.mark.parametrize("na_position", ["last", "first"])
def test_sort_values_single_column(client: Client, ascending: bool, na_position: str) -> None:
    pdf = _input()
    df = dd.from_pandas(pdf, npartitions=5)
    out = sort_values(df, "x", ascending=ascending, na_position=na_position)
    parts = _parts(client, out)
    assert 3 <= len(parts) <= 7
    assert max(len(p) for p in parts) < len(pdf) / 2
    got = pd.concat(parts)
    exp = pdf.sort_values("x", ascending=ascending, na_position=na_position, kind="stable")
    # Same rows, same order of keys (index included: rows with equal x keep input order).
    pd.testing.assert_frame_equal(got, exp)
    _no_overlap(parts, "x", ascending)
    assert not out.known_divisions
    assert all(s["shufflers"] == [] for s in client.run(worker_state).values())


def test_sort_values_several_columns(client: Client) -> None:
    pdf = _input(seed=1)
    df = dd.from_pandas(pdf, npartitions=4)
    out = sort_values(df, ["y", "s", "x"], ascending=[False, True, True])
    parts = _parts(client, out)
    got = pd.concat(parts)
    exp = pdf.sort_values(["y", "s", "x"], ascending=[False, True, True], kind="stable")
    pd.testing.assert_frame_equal(got, exp)
    _no_overlap(parts, "y", ascending=False)
    assert len(parts) == 4  # six distinct values of y spread over the requested four


def test_set_index_divisions(client: Client) -> None:
    pdf = _input(seed=2)
    df = dd.from_pandas(pdf, npartitions=4)
    out = set_index(df, "s")
    assert out.known_divisions
    divisions = out.divisions
    assert list(divisions) == sorted(divisions)
    assert divisions[0] == pdf["s"].min() and divisions[-1] == pdf["s"].max()
    # One plain Python type throughout (Dask's own set_index can mix int and
    # np.int64: its min and max stay NumPy scalars).
    assert {type(d) for d in divisions} == {str}, divisions
    ints = dd.from_pandas(pd.DataFrame({"k": np.arange(1000) % 97, "v": np.arange(1000)}), npartitions=4)
    int_divisions = set_index(ints, "k").divisions
    assert {type(d) for d in int_divisions} == {int}, int_divisions
    parts = _parts(client, out)
    assert len(parts) == out.npartitions == len(divisions) - 1
    for j, p in enumerate(parts):
        assert p.index.is_monotonic_increasing
        assert len(p)
        assert p.index.min() >= divisions[j]
        if j + 1 < len(parts):
            assert p.index.max() < divisions[j + 1]
        else:
            assert p.index.max() <= divisions[j + 1]
    got = pd.concat(parts)
    exp = pdf.reset_index(drop=True).set_index("s").sort_index(kind="stable")
    pd.testing.assert_frame_equal(
        got.reset_index().sort_values(list(got.reset_index().columns)).reset_index(drop=True),
        exp.reset_index().sort_values(list(exp.reset_index().columns)).reset_index(drop=True),
    )
    assert list(got.index) == list(exp.index)
    # Known divisions make a selection read only the partitions that can hold it.
    sel = out.loc["s10":"s12"]
    assert sel.npartitions < out.npartitions or out.npartitions == 1
    pd.testing.assert_frame_equal(
        sel.compute().sort_values(["x", "y"]), exp.loc["s10":"s12"].sort_values(["x", "y"])
    )


def test_set_index_nulls_go_last_and_drop_false(client: Client) -> None:
    pdf = _input(seed=3)
    df = dd.from_pandas(pdf, npartitions=3)
    out = set_index(df, "x", drop=False)
    parts = _parts(client, out)
    assert parts[-1].index.isna().sum() == pdf["x"].isna().sum()
    assert all(p.index.notna().all() for p in parts[:-1])
    assert out.divisions[-1] == pdf["x"].max()
    got = pd.concat(parts)
    assert got["x"].equals(pd.Series(got.index, index=got.index, name="x"))


def test_skewed_key_is_split_where_it_can_be(client: Client) -> None:
    rng = np.random.default_rng(4)
    n = 4000
    x = np.where(rng.random(n) < 0.8, 7, rng.integers(0, 10_000, n))
    pdf = pd.DataFrame({"x": x, "v": np.arange(n)})
    df = dd.from_pandas(pdf, npartitions=6)
    out = set_index(df, "x", npartitions=6)
    parts = _parts(client, out)
    heavy = [j for j, p in enumerate(parts) if (p.index == 7).any()]
    assert len(heavy) == 1  # one key never splits
    assert set(parts[heavy[0]].index) == {7}  # ... and gets a partition of its own
    others = [len(p) for j, p in enumerate(parts) if j != heavy[0]]
    assert len(others) >= 4 and max(others) < 0.5 * (n - (x == 7).sum())
    assert sum(len(p) for p in parts) == n


def test_all_equal_keys_and_empty_frame(client: Client) -> None:
    pdf = pd.DataFrame({"x": [5] * 100, "v": range(100)})
    parts = _parts(client, set_index(dd.from_pandas(pdf, npartitions=3), "x"))
    assert sum(len(p) for p in parts) == 100 and sum(1 for p in parts if len(p)) == 1
    empty = set_index(dd.from_pandas(pdf.iloc[:0], npartitions=1), "x")
    assert empty.npartitions == 1 and not empty.known_divisions
    assert len(empty.compute()) == 0


def test_sorted_collection_computed_twice(client: Client) -> None:
    pdf = _input(seed=5)
    out = sort_values(dd.from_pandas(pdf, npartitions=3), "s")
    a, b = out.compute(), out.compute()
    pd.testing.assert_frame_equal(a, b)


def test_range_partitioner_ids() -> None:
    part = RangePartitioner("x", pd.Index([10, 20]))
    frame = pd.DataFrame({"x": [9, 10, 19, 20, 25, None]})
    assert part(frame).tolist() == [0, 1, 1, 2, 2, 2]
    desc = RangePartitioner("x", pd.Index([10, 20]), ascending=False, na_first=True)
    assert desc(frame).tolist() == [2, 1, 1, 0, 0, 0]


def test_sync_scheduler_and_bad_input() -> None:
    pdf = _input(n=500, seed=6)
    df = dd.from_pandas(pdf, npartitions=2)
    with dask.config.set(scheduler="sync"):
        got = sort_values(df, "s").compute()
    pd.testing.assert_frame_equal(got, pdf.sort_values("s", kind="stable"))
    with pytest.raises(KeyError, match="nope"):
        sort_values(df, "nope")
    with pytest.raises(ValueError, match="ascending has 1 values for 2"):
        sort_values(df, ["x", "y"], ascending=[True])
    with pytest.raises(ValueError, match="na_position"):
        sort_values(df, "x", na_position="middle")
    with pytest.raises(TypeError, match="dask DataFrame"):
        set_index(pdf, "x")  # type: ignore[arg-type]


def test_sorts_on_an_async_client(cluster: Any) -> None:
    # On an asynchronous client's loop the sample cannot be computed while the
    # graph is built; it is computed with the result, and gives the rows and
    # partitions the eager sample gives (plus empty partitions at the end).
    pdf = _input(seed=3)
    df = dd.from_pandas(pdf, npartitions=5)
    builds = {
        "ascending": lambda: sort_values(df, "x"),
        "descending, nulls first": lambda: sort_values(df, "x", ascending=False, na_position="first"),
        "several columns": lambda: sort_values(df, ["y", "s", "x"], ascending=[False, True, True]),
        "fewer keys than partitions": lambda: sort_values(df, "y", npartitions=9),
        "index": lambda: set_index(df, "s", npartitions=4),
        "only nulls": lambda: sort_values(df.assign(x=np.nan), "x"),
    }

    async def main() -> tuple[dict[str, Any], list[pd.DataFrame], list[dict[str, Any]]]:
        async with Client(cluster.scheduler_address, asynchronous=True) as c:
            got = {}
            for what, build in builds.items():
                out = build()
                got[what] = (out.npartitions, out.known_divisions, await c.gather(c.compute(out.to_delayed())))
            persisted = c.persist(set_index(df, "x"))
            persisted_parts = await c.gather(c.compute(persisted.to_delayed()))
            return got, persisted_parts, list((await c.run(worker_state)).values())

    got, persisted_parts, states = asyncio.run(main())
    with dask.config.set(scheduler="sync"):  # the eager sample, in this process
        want = {what: dask.compute(*build().to_delayed()) for what, build in builds.items()}
        want_persisted = dask.compute(*set_index(df, "x").to_delayed())
    for what, (npartitions, known_divisions, parts) in got.items():
        assert not known_divisions, what
        expected = want[what]
        n = len(expected)
        assert len(parts) == npartitions >= n, what
        for p, e in zip(parts[:n], expected, strict=True):
            pd.testing.assert_frame_equal(p, e)
        for p in parts[n:]:
            assert len(p) == 0, what
            pd.testing.assert_series_equal(p.dtypes, expected[0].dtypes)
    assert len(got["fewer keys than partitions"][2]) == 9  # 6 distinct values: 3 empty at the end
    for p, e in zip(persisted_parts, want_persisted, strict=False):
        pd.testing.assert_frame_equal(p, e)
    assert sum(map(len, persisted_parts)) == len(pdf)
    assert all(s["shufflers"] == [] for s in states)
