"""Dask's partition ids computed in mpshuffle's insert equal Dask's own, for every key dtype.

``DaskPartitioning`` stands in for Dask's ``AssignPartitioningIndex`` step
when the ``mpshuffle`` method runs a hash shuffle: the ids it makes the
insert compute must be Dask's ``partitioning_index`` bit for bit, or frames
shuffled by ``tasks`` and by mpshuffle would not be co-partitioned.
"""

from __future__ import annotations

from typing import Any

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from dask.dataframe.dask_expr._shuffle import AssignPartitioningIndex

import mpshuffle.dask  # noqa: F401  (installs the method)
from mpshuffle.dask.partitioning import DaskPartitioning
from mpshuffle.table import PandasAdapter
from mpshuffle.table.hashing import PandasRowHash, pandas_row_ids

N = 400


def _columns() -> dict[str, Any]:
    rng = np.random.default_rng(3)
    floats = rng.standard_normal(N)
    floats[::7] = np.nan
    floats[1::11] = -0.0
    floats[2::13] = 0.0
    floats[3::17] = np.inf
    floats[4::19] = -np.inf
    ints = rng.integers(-(2**62), 2**62, N)
    ints[::5] = 2**53 + 1  # rounds as a float64: Dask hashes the rounded value
    words = np.array([f"w{i % 37}" for i in range(N)], dtype=object)
    with_none = words.copy()
    with_none[::6] = None
    return {
        "int64": ints,
        "int32": rng.integers(-(2**31), 2**31 - 1, N).astype(np.int32),
        "int8": rng.integers(-128, 127, N).astype(np.int8),
        "uint64": rng.integers(0, 2**64 - 1, N, dtype=np.uint64),
        "uint16": rng.integers(0, 2**16 - 1, N).astype(np.uint16),
        "float64": floats,
        "float32": floats.astype(np.float32),
        "float16": floats.astype(np.float16),
        "bool": rng.integers(0, 2, N).astype(bool),
        "Int64": pd.array([None if i % 4 == 0 else int(v) for i, v in enumerate(ints)], dtype="Int64"),
        "Float64": pd.array([None if i % 4 == 0 else v for i, v in enumerate(floats)], dtype="Float64"),
        "boolean": pd.array([None if i % 3 == 0 else bool(i % 2) for i in range(N)], dtype="boolean"),
        "int64[pyarrow]": pd.array([None if i % 4 == 0 else int(v) for i, v in enumerate(ints)],
                                   dtype="int64[pyarrow]"),
        "str": pd.array(with_none, dtype="str"),
        "string[python]": pd.array(with_none, dtype="string[python]"),
        "object": with_none,
        "object mixed": np.array([i if i % 3 else f"x{i}" for i in range(N)], dtype=object),
        "category str": pd.Categorical(with_none),
        "category int": pd.Categorical(rng.integers(0, 9, N)),
        "category float nan": pd.Categorical(np.where(np.arange(N) % 5 == 0, np.nan, np.arange(N) % 7 / 2)),
        "datetime": pd.to_datetime(ints % 10**17, unit="ns"),
        "datetime tz": pd.to_datetime(ints % 10**15, unit="us").tz_localize("Europe/Berlin"),
        "datetime NaT": pd.to_datetime(np.where(np.arange(N) % 3 == 0, -(2**63), ints % 10**17)),
        "timedelta": pd.to_timedelta(ints % 10**12, unit="ns"),
    }


COLUMNS = _columns()


def _dask_ids(frame: pd.DataFrame, keys: list[Any], npartitions: int, index_shuffle: bool = False) -> np.ndarray:
    """Dask's own ids: the ``_partitions`` column its AssignPartitioningIndex step computes."""
    out = AssignPartitioningIndex.operation(
        frame, keys, "_partitions", npartitions, frame.iloc[:0], index_shuffle
    )
    return np.asarray(out["_partitions"], dtype=np.int64)


def _ours(frame: pd.DataFrame, keys: list[Any], npartitions: int, index_shuffle: bool = False,
          meta: pd.DataFrame | None = None) -> np.ndarray:
    rule = DaskPartitioning(keys, npartitions, frame.iloc[:0] if meta is None else meta, index_shuffle)
    result = rule(frame)
    if isinstance(result, PandasRowHash):
        return pandas_row_ids(result, npartitions)
    return np.asarray(result)


@pytest.mark.parametrize("name", sorted(COLUMNS))
def test_one_key_column_every_dtype(name: str) -> None:
    frame = pd.DataFrame({"k": COLUMNS[name], "v": np.arange(N)})
    for npartitions in (1, 7, 300):
        np.testing.assert_array_equal(_ours(frame, ["k"], npartitions), _dask_ids(frame, ["k"], npartitions))


@pytest.mark.parametrize(
    "names",
    [["int64", "float64"], ["str", "int32"], ["bool", "category str", "datetime", "uint64"],
     ["float64", "float64"], ["Int64", "object", "float32", "timedelta", "category int"]],
)
def test_several_key_columns(names: list[str]) -> None:
    frame = pd.DataFrame({f"k{j}": COLUMNS[n] for j, n in enumerate(names)})
    keys = list(frame.columns)
    for npartitions in (5, 60):
        np.testing.assert_array_equal(_ours(frame, keys, npartitions), _dask_ids(frame, keys, npartitions))


def test_numbers_go_through_the_fused_pass_and_others_are_hashed_by_pandas() -> None:
    frame = pd.DataFrame({"a": COLUMNS["int64"], "b": COLUMNS["str"], "c": COLUMNS["Float64"]})
    result = DaskPartitioning(["a", "b", "c"], 9, frame.iloc[:0])(frame)
    assert isinstance(result, PandasRowHash)
    assert result.given == (False, True, False)
    assert result.columns[0] is not None and np.shares_memory(result.columns[0], frame["a"].to_numpy())


@pytest.mark.parametrize("keys", [[], ["_index"]])
def test_shuffle_on_the_index(keys: list[Any]) -> None:
    frame = pd.DataFrame({"v": np.arange(N)}, index=pd.Index(COLUMNS["int32"], name="ix"))
    np.testing.assert_array_equal(
        _ours(frame, keys, 11, index_shuffle=True), _dask_ids(frame, keys, 11, index_shuffle=True)
    )


def test_key_named_like_the_index() -> None:
    frame = pd.DataFrame({"a": COLUMNS["float64"]}, index=pd.Index(COLUMNS["str"], name="ix"))
    np.testing.assert_array_equal(_ours(frame, ["ix", "a"], 13), _dask_ids(frame, ["ix", "a"], 13))


@pytest.mark.parametrize(
    "columns, keys",
    [(["a", "b"], ["b", "a"]), (["a", "b"], ["a", "a"]), ([0, 1], [1]), ([("t", 1), "b"], [("t", 1)]),
     (["a", "ix"], ["ix"])],
    ids=["reordered", "key twice", "int labels", "tuple label", "column named like the index"],
)
def test_key_columns_are_dasks_selection(columns: list[Any], keys: list[Any]) -> None:
    # Plain string keys read the frame's columns directly; any other label goes through Dask's selection.
    frame = pd.DataFrame(
        {c: COLUMNS[n] for c, n in zip(columns, ["int64", "str"], strict=True)},
        index=pd.Index(COLUMNS["float64"], name="ix"),
    )
    for npartitions in (3, 50):
        np.testing.assert_array_equal(_ours(frame, keys, npartitions), _dask_ids(frame, keys, npartitions))


def test_meta_decides_the_cast_as_in_dask() -> None:
    # The meta says object, the partition holds integers: Dask does not cast them.
    frame = pd.DataFrame({"k": COLUMNS["int64"]})
    meta = pd.DataFrame({"k": pd.Series([], dtype=object)})
    expected = np.asarray(
        AssignPartitioningIndex.operation(frame, ["k"], "_partitions", 17, meta, False)["_partitions"]
    )
    np.testing.assert_array_equal(_ours(frame, ["k"], 17, meta=meta), expected)
    # The meta says float64, the partition holds strings of numbers: Dask casts them.
    frame = pd.DataFrame({"k": np.array(["1.5", "2", "-0.0"] * 10, dtype=object)})
    meta = pd.DataFrame({"k": pd.Series([], dtype=np.float64)})
    expected = np.asarray(
        AssignPartitioningIndex.operation(frame, ["k"], "_partitions", 17, meta, False)["_partitions"]
    )
    np.testing.assert_array_equal(_ours(frame, ["k"], 17, meta=meta), expected)


def test_a_frame_that_is_not_pandas_gets_dask_ids_from_dask() -> None:
    frame = pd.DataFrame({"k": COLUMNS["int64"]})
    rule = DaskPartitioning(["k"], 9, frame.iloc[:0])
    np.testing.assert_array_equal(rule.dask_ids(frame), _dask_ids(frame, ["k"], 9))


def test_insert_places_rows_by_dask_ids() -> None:
    frame = pd.DataFrame({"k": COLUMNS["int64"], "s": COLUMNS["str"], "v": np.arange(N)})
    rule = DaskPartitioning(["k", "s"], 6, frame.iloc[:0])
    pieces = PandasAdapter().split(frame, ["k"], 6, rule(frame))
    ids = _dask_ids(frame, ["k", "s"], 6)
    meta = frame.iloc[:0]
    for p in range(6):
        got = PandasAdapter().unpack([pieces[p]], meta) if p in pieces else meta
        np.testing.assert_array_equal(got["v"].to_numpy(), np.flatnonzero(ids == p))


def test_row_count_must_match_the_frame() -> None:
    frame = pd.DataFrame({"k": np.arange(5)})
    with pytest.raises(ValueError, match="3 rows, the frame 5"):
        PandasAdapter().split(frame, ["k"], 2, PandasRowHash((np.arange(3),), (False,)))
    with pytest.raises(ValueError, match="uint64 hashes"):
        PandasRowHash((np.arange(3),), (True,))
    with pytest.raises(ValueError, match="numbers"):
        PandasRowHash((np.array(["a"], dtype=object),), (False,))


def test_tasks_and_mpshuffle_outputs_are_copartitioned() -> None:
    rng = np.random.default_rng(5)
    pdf = pd.DataFrame({"k": rng.integers(0, 10**6, 2000), "f": rng.standard_normal(2000),
                        "s": rng.choice(["a", "b", "c"], 2000), "v": np.arange(2000)})
    df = dd.from_pandas(pdf, npartitions=5)
    with dask.config.set(scheduler="sync"):
        for on in (["k"], ["f", "s"]):
            tasks = df.shuffle(on, npartitions=7, shuffle_method="tasks")
            mps = df.shuffle(on, npartitions=7, shuffle_method="mpshuffle")
            for j in range(7):
                a = set(tasks.partitions[j].compute()["v"])
                b = set(mps.partitions[j].compute()["v"])
                assert a == b, (on, j)


def test_merge_of_tasks_shuffled_and_mpshuffle_shuffled_frames() -> None:
    rng = np.random.default_rng(6)
    left = pd.DataFrame({"k": rng.integers(0, 300, 1500), "a": np.arange(1500)})
    right = pd.DataFrame({"k": np.arange(0, 300, 3), "b": np.arange(100)})
    with dask.config.set(scheduler="sync"):
        lhs = dd.from_pandas(left, npartitions=4).shuffle("k", npartitions=6, shuffle_method="tasks")
        rhs = dd.from_pandas(right, npartitions=3).shuffle("k", npartitions=6, shuffle_method="mpshuffle")
        # Both sides are known to be partitioned on k with 6 partitions: Dask
        # merges them partition by partition, with no further shuffle.
        merged = lhs.merge(rhs, on="k").optimize()
        kinds = [type(e).__name__ for e in merged.expr.walk()]
        assert kinds.count("TaskShuffle") == 1 and kinds.count("MPShuffle") == 1, kinds
        got = merged.compute()
    exp = left.merge(right, on="k")
    pd.testing.assert_frame_equal(
        got.sort_values("a").reset_index(drop=True), exp.sort_values("a").reset_index(drop=True)
    )


def test_plain_keys_are_the_frames_own_columns_and_repeated_labels_go_through_dask() -> None:
    from mpshuffle.dask.partitioning import _key_columns

    frame = pd.DataFrame({"a": np.arange(5), "b": np.arange(5.0)})
    got = _key_columns(frame, ["b", "a"], False)
    assert [s.name for s in got] == ["b", "a"]
    np.testing.assert_array_equal(got[0].to_numpy(), np.arange(5.0))
    assert np.shares_memory(got[1].to_numpy(), frame["a"].to_numpy())  # the column itself, not a copy
    repeated = pd.DataFrame(np.arange(10).reshape(5, 2), columns=["a", "a"])
    got = _key_columns(repeated, ["a"], False)  # Dask's selection: both columns named "a"
    assert len(got) == 2
    np.testing.assert_array_equal(got[1].to_numpy(), np.arange(1, 10, 2))
    np.testing.assert_array_equal(_ours(repeated, ["a"], 7), _dask_ids(repeated, ["a"], 7))
