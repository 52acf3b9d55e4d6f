"""mpshuffle.dask.merge against pandas.merge on the same data, on a 2-worker LocalCluster."""

from __future__ import annotations

import ast

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from distributed import Client, get_task_stream, wait

from conftest import worker_state
from mpshuffle.dask import merge

HOWS = ["inner", "left", "right", "outer", "leftsemi"]


def _sorted(df: pd.DataFrame) -> pd.DataFrame:
    return df.sort_values(list(df.columns), na_position="last").reset_index(drop=True)


def _expected(left: pd.DataFrame, right: pd.DataFrame, how: str, **kw: object) -> pd.DataFrame:
    if how != "leftsemi":
        return left.merge(right, how=how, **kw)  # type: ignore[arg-type]
    lk = kw.get("left_on", kw.get("on"))
    rk = kw.get("right_on", kw.get("on"))
    lk = [lk] if isinstance(lk, str) else list(lk)  # type: ignore[arg-type]
    rk = [rk] if isinstance(rk, str) else list(rk)  # type: ignore[arg-type]
    keys = right[rk].drop_duplicates().rename(columns=dict(zip(rk, lk)))
    return left.merge(keys, how="inner", on=lk)


def _frames(
    n_left: int = 300, n_right: int = 200, seed: int = 0
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Two frames with the dtypes Dask gives them (it turns ``str`` into ``string[pyarrow]``)."""
    left, right = _raw_frames(n_left, n_right, seed)
    return dd.from_pandas(left, npartitions=1).compute(), dd.from_pandas(
        right, npartitions=1
    ).compute()


def _raw_frames(n_left: int, n_right: int, seed: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    rng = np.random.default_rng(seed)
    left = pd.DataFrame(
        {
            "k": rng.integers(0, 40, n_left),
            "k2": rng.choice(["a", "b", "c"], n_left),
            "v": rng.integers(0, 1000, n_left),
            "w": rng.random(n_left),
        }
    )
    right = pd.DataFrame(
        {
            "key": rng.integers(20, 60, n_right).astype("int32"),  # narrower dtype than left's
            "key2": rng.choice(["b", "c", "d"], n_right),
            "v": rng.integers(0, 1000, n_right),
            "b": rng.random(n_right) > 0.5,
        }
    )
    return left, right


def _clean(client: Client) -> None:
    assert all(s["shufflers"] == [] for s in client.run(worker_state).values())
    assert (
        client.run_on_scheduler(
            lambda dask_scheduler: len(dask_scheduler.plugins["mpshuffle"].runs)
        )
        == 0
    )


@pytest.mark.parametrize("how", HOWS)
def test_every_how_single_key_different_names(client: Client, how: str) -> None:
    left, right = _frames()
    out = merge(
        dd.from_pandas(left, npartitions=3),
        dd.from_pandas(right, npartitions=2),
        how=how,
        left_on="k",
        right_on="key",
        npartitions=4,
    )
    assert out.npartitions == 4
    got = out.compute()
    exp = _expected(left, right, how, left_on="k", right_on="key")
    assert list(got.columns) == list(exp.columns) == list(out._meta.columns)
    pd.testing.assert_frame_equal(_sorted(got), _sorted(exp))
    _clean(client)


@pytest.mark.parametrize("how", HOWS)
def test_every_how_two_keys_and_suffixes(client: Client, how: str) -> None:
    left, right = _frames(seed=1)
    right = right.rename(columns={"key": "k", "key2": "k2"})
    out = merge(
        dd.from_pandas(left, npartitions=4),
        dd.from_pandas(right, npartitions=3),
        how=how,
        on=["k", "k2"],
        suffixes=("_l", "_r"),
    )
    got = out.compute()
    exp = _expected(left, right, how, on=["k", "k2"], suffixes=("_l", "_r"))
    if how != "leftsemi":
        assert {"v_l", "v_r"} <= set(got.columns)
    pd.testing.assert_frame_equal(_sorted(got), _sorted(exp))


@pytest.mark.parametrize("how", HOWS)
def test_null_keys_match_like_pandas(client: Client, how: str) -> None:
    left = pd.DataFrame({"k": [1.0, np.nan, 2.0, np.nan, 3.0], "a": range(5)})
    right = pd.DataFrame({"k": [np.nan, 2.0, 4.0, np.nan], "b": range(4)})
    got = merge(
        dd.from_pandas(left, npartitions=2), dd.from_pandas(right, npartitions=2), how=how, on="k"
    ).compute()
    exp = _expected(left, right, how, on="k")
    # pandas pairs each of the two left NaN keys with each of the two right ones.
    assert exp["k"].isna().sum() == (2 if how == "leftsemi" else 4)
    pd.testing.assert_frame_equal(_sorted(got), _sorted(exp))


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("empty", ["left", "right", "both"])
def test_empty_sides(client: Client, how: str, empty: str) -> None:
    left, right = _frames(n_left=50, n_right=40)
    if empty in ("left", "both"):
        left = left.iloc[:0]
    if empty in ("right", "both"):
        right = right.iloc[:0]
    out = merge(
        dd.from_pandas(left, npartitions=2),
        dd.from_pandas(right, npartitions=1),
        how=how,
        left_on="k",
        right_on="key",
    )
    got = out.compute()
    exp = _expected(left, right, how, left_on="k", right_on="key")
    assert len(got) == len(exp)
    assert list(got.columns) == list(exp.columns)
    pd.testing.assert_frame_equal(_sorted(got), _sorted(exp), check_dtype=len(exp) > 0)


def test_both_sides_of_a_partition_are_extracted_on_one_worker(client: Client) -> None:
    left, right = _frames(n_left=400, n_right=300)
    out = merge(
        dd.from_pandas(left, npartitions=3),
        dd.from_pandas(right, npartitions=3),
        left_on="k",
        right_on="key",
        npartitions=6,
    )
    with get_task_stream(client) as ts:
        res = out.compute()
    assert len(res) == len(_expected(left, right, "inner", left_on="k", right_on="key"))
    where: dict[tuple[str, int], str] = {}
    for rec in ts.data:
        key = rec["key"]
        if isinstance(key, str) and key.startswith("("):
            key = ast.literal_eval(key)  # the stream may stringify tuple keys
        if isinstance(key, tuple) and "-extract-" in key[0]:
            where[(key[0], key[1])] = rec["worker"]
    names = sorted({k[0] for k in where})
    assert len(names) == 2, names  # one shuffle per side
    assert len(where) == 12
    for j in range(6):
        assert where[(names[0], j)] == where[(names[1], j)], j
    _clean(client)


def test_recomputing_a_join_gives_the_same_result(client: Client) -> None:
    left, right = _frames(seed=3)
    out = merge(
        dd.from_pandas(left, npartitions=3),
        dd.from_pandas(right, npartitions=2),
        "outer",
        left_on="k",
        right_on="key",
    )
    total = out["v_x"].sum() + out["v_y"].sum()
    a, b = out.compute(), out.compute()
    pd.testing.assert_frame_equal(_sorted(a), _sorted(b))
    assert total.compute() == total.compute() == a["v_x"].sum() + a["v_y"].sum()
    persisted = out.persist()
    wait(persisted)
    pd.testing.assert_frame_equal(_sorted(persisted.compute()), _sorted(a))
    del persisted
    _clean(client)


def test_self_join(client: Client) -> None:
    left, _ = _frames(n_left=100)
    df = dd.from_pandas(left, npartitions=3)
    got = merge(df, df, on=["k", "k2"]).compute()
    pd.testing.assert_frame_equal(_sorted(got), _sorted(left.merge(left, on=["k", "k2"])))


def test_local_scheduler_without_client() -> None:
    left, right = _frames(n_left=80, n_right=60)
    with dask.config.set(scheduler="sync"):
        got = merge(
            dd.from_pandas(left, npartitions=2), right, how="left", left_on="k", right_on="key"
        ).compute()
    pd.testing.assert_frame_equal(
        _sorted(got), _sorted(left.merge(right, how="left", left_on="k", right_on="key"))
    )


def test_bad_input_is_rejected() -> None:
    left, right = _frames(n_left=10, n_right=10)
    L, R = dd.from_pandas(left, npartitions=1), dd.from_pandas(right, npartitions=1)
    with pytest.raises(TypeError, match="do not hash alike"):
        merge(L, R.assign(key=R["key"].astype("float64")), left_on="k", right_on="key")
    with pytest.raises(ValueError, match="not supported"):
        merge(L, R, how="cross", left_on="k", right_on="key")
    with pytest.raises(KeyError, match=r"\['nope'\].*right"):
        merge(L, R, left_on="k", right_on="nope")
    with pytest.raises(ValueError, match="differ in length"):
        merge(L, R, left_on=["k", "k2"], right_on="key")
    with pytest.raises(ValueError, match="not both"):
        merge(L, R, on="v", left_on="k", right_on="key")
    with pytest.raises(TypeError, match="dask or pandas DataFrame"):
        merge(L, [1, 2], on="v")  # type: ignore[arg-type]
