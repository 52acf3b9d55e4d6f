"""Unit tests of mpshuffle.table: hashing, split / unpack, PackedData, registry."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from mpshuffle.errors import ShuffleError
from mpshuffle.table import (
    ArrowAdapter,
    FrameAdapter,
    PackedData,
    PandasAdapter,
    get_adapter,
    owned_partitions,
    partition_ids,
    partition_owner,
    register_adapter,
)
from mpshuffle.table._columns import read_piece
from mpshuffle.table._reconcile import reconcile
from mpshuffle.table.base import AdapterRegistry
from mpshuffle.table.hashing import NULL_HASH, combine_hashes

# ----------------------------------------------------------------- helpers


def shuffle(
    adapter: FrameAdapter, inputs: Sequence[Any], on: Sequence[Any], npartitions: int, meta: Any
) -> dict[int, Any]:
    """Split every input partition, then unpack each output partition's pieces in input order."""
    splits = [adapter.split(frame, on, npartitions) for frame in inputs]
    for split in splits:
        assert all(p.nrows > 0 for p in split.values()), "only non-empty pieces"
        assert all(0 <= pid < npartitions for pid in split)
    pids = sorted({pid for split in splits for pid in split})
    return {pid: adapter.unpack([s[pid] for s in splits if pid in s], meta) for pid in pids}


def rows(df: pd.DataFrame) -> list[str]:
    """Row multiset of a frame, as sorted reprs (None / NaN / NA / NaT kept distinct)."""
    return sorted(repr(tuple(r)) for r in df.astype(object).itertuples(index=False))


def concat(outputs: dict[int, pd.DataFrame]) -> pd.DataFrame:
    return pd.concat(list(outputs.values()), ignore_index=True)


def assert_same_dtypes(out: pd.DataFrame, meta: pd.DataFrame) -> None:
    assert list(out.columns) == list(meta.columns)
    for name in meta.columns:
        assert out[name].dtype == meta[name].dtype, (name, out[name].dtype, meta[name].dtype)


def key_partitions(outputs: dict[int, pd.DataFrame], key: str) -> dict[str, set[int]]:
    where: dict[str, set[int]] = {}
    for pid, df in outputs.items():
        for value in df[key].astype(object):
            where.setdefault(repr(value if not pd.isna(value) else None), set()).add(pid)
    return where


def rich_frame(offset: int = 0, n: int = 40) -> pd.DataFrame:
    i = np.arange(offset, offset + n)
    return pd.DataFrame(
        {
            "k": i % 7,
            "cat": pd.Categorical(np.where(i % 2 == 0, "even", "odd"), categories=["even", "odd"]),
            "nint": pd.array([None if v % 5 == 0 else int(v) for v in i], dtype="Int64"),
            "tz": pd.date_range("2024-03-30", periods=n, freq="h", tz="Europe/Berlin")[:n],
            "s": pd.Series([None if v % 3 == 0 else f"s{v}" for v in i], dtype="str"),
            "b": i % 2 == 0,
            "f": np.where(i % 4 == 0, np.nan, i / 3),
        }
    )


# ------------------------------------------------------- split / unpack


@pytest.mark.parametrize("npartitions", [1, 3, 8])
def test_pandas_roundtrip_keeps_rows_and_dtypes(npartitions: int) -> None:
    inputs = [rich_frame(0), rich_frame(40, 25), rich_frame(65, 0)]
    meta = inputs[0].iloc[:0]
    outputs = shuffle(PandasAdapter(), inputs, ["k"], npartitions, meta)
    for out in outputs.values():
        assert_same_dtypes(out, meta)
        assert list(out["cat"].cat.categories) == ["even", "odd"]
        assert str(out["tz"].dt.tz) == "Europe/Berlin"
        assert isinstance(out.index, pd.RangeIndex) and out.index.start == 0
    everything = pd.concat(inputs, ignore_index=True)
    assert rows(concat(outputs)) == rows(everything)
    # Missing values kept as such, of the right kind.
    out = concat(outputs)
    assert out["nint"].isna().sum() == everything["nint"].isna().sum()
    assert out["s"].isna().sum() == everything["s"].isna().sum()
    assert out["nint"].dtype == "Int64" and out["nint"].isna().any()
    assert all(len(p) == 1 for p in key_partitions(outputs, "k").values())


def test_rows_within_partition_keep_input_order() -> None:
    # Edge case 12: by input partition, then by position in it.
    inputs = [
        pd.DataFrame({"k": [1, 2, 1, 3, 1, 2], "pos": [0, 1, 2, 3, 4, 5], "part": 0}),
        pd.DataFrame({"k": [2, 1, 1], "pos": [0, 1, 2], "part": 1}),
    ]
    outputs = shuffle(PandasAdapter(), inputs, ["k"], 4, inputs[0].iloc[:0])
    for out in outputs.values():
        expected = pd.concat([f[f["k"].isin(out["k"].unique())] for f in inputs], ignore_index=True)
        pd.testing.assert_frame_equal(out, expected)


def test_category_in_two_partitions_keeps_values() -> None:
    # Edge case 1: each input partition has its own categories.
    inputs = [
        pd.DataFrame({"k": [1, 2], "c": pd.Series(["a", "b"], dtype="category")}),
        pd.DataFrame({"k": [3], "c": pd.Series(["z"], dtype="category")}),
    ]
    meta = inputs[0].iloc[:0]
    out = concat(shuffle(PandasAdapter(), inputs, ["k"], 1, meta))
    assert isinstance(out["c"].dtype, pd.CategoricalDtype)
    assert not out["c"].isna().any()
    assert sorted(out["c"].astype(str)) == ["a", "b", "z"]


def test_category_takes_meta_categories_when_they_cover_the_values() -> None:
    meta_dtype = pd.CategoricalDtype(["a", "b", "c"])
    frame = pd.DataFrame({"k": [1, 2], "c": pd.Series(["b", "a"], dtype="category")})
    meta = pd.DataFrame({"k": pd.Series([], dtype="int64"), "c": pd.Series([], dtype=meta_dtype)})
    out = concat(shuffle(PandasAdapter(), [frame], ["k"], 2, meta))
    assert out["c"].dtype == meta_dtype


def test_nullable_int_keys_with_all_na_partition() -> None:
    # Edge case 2.
    inputs = [
        pd.DataFrame({"k": pd.array([None, None, None], dtype="Int64"), "v": [1, 2, 3]}),
        pd.DataFrame({"k": pd.array([1, None, 2], dtype="Int64"), "v": [4, 5, 6]}),
    ]
    outputs = shuffle(PandasAdapter(), inputs, ["k"], 5, inputs[0].iloc[:0])
    with_na = [pid for pid, out in outputs.items() if out["k"].isna().any()]
    assert len(with_na) == 1
    assert outputs[with_na[0]]["k"].isna().sum() == 4
    assert all(out["k"].dtype == "Int64" for out in outputs.values())
    assert rows(concat(outputs)) == rows(pd.concat(inputs, ignore_index=True))


def test_string_column_all_none_in_one_partition_gets_meta_dtype() -> None:
    # Edge case 3: object None in one input partition, str in the other.
    inputs = [
        pd.DataFrame({"k": [1, 2], "s": pd.Series([None, None], dtype=object)}),
        pd.DataFrame({"k": [1, 2], "s": pd.Series(["x", None], dtype="str")}),
    ]
    meta = inputs[1].iloc[:0]
    outputs = shuffle(PandasAdapter(), inputs, ["k"], 2, meta)
    for out in outputs.values():
        assert out["s"].dtype == meta["s"].dtype
    out = concat(outputs)
    assert out["s"].isna().sum() == 3 and list(out["s"].dropna()) == ["x"]
    # Only the all-None piece: still the meta's dtype.
    only_none = PandasAdapter().split(inputs[0], ["k"], 1)[0]
    assert PandasAdapter().unpack([only_none], meta)["s"].dtype == meta["s"].dtype


def test_object_meta_keeps_none() -> None:
    frame = pd.DataFrame({"k": [1, 2], "s": pd.Series(["x", None], dtype=object)})
    out = PandasAdapter().unpack(
        list(PandasAdapter().split(frame, ["k"], 1).values()), frame.iloc[:0]
    )
    assert out["s"].dtype == object and out["s"].tolist() == ["x", None]


@pytest.mark.parametrize("npartitions", [129, 257, 32769])
def test_many_partitions_lose_no_row(npartitions: int) -> None:
    # Edge case 4.
    frame = pd.DataFrame({"k": np.arange(3000, dtype="int64"), "v": np.arange(3000) * 2})
    ids = partition_ids(frame[["k"]], npartitions)
    assert ids.dtype == np.int64 and ids.min() >= 0 and ids.max() < npartitions
    assert len(np.unique(ids)) > min(npartitions, 3000) // 3  # spreads out
    outputs = shuffle(PandasAdapter(), [frame], ["k"], npartitions, frame.iloc[:0])
    assert sum(len(o) for o in outputs.values()) == 3000
    assert rows(concat(outputs)) == rows(frame)


@pytest.mark.parametrize("npartitions", [300, 70_001])
def test_few_rows_into_many_partitions_give_each_piece_its_rows_in_the_right_block(npartitions: int) -> None:
    # pack works on the partitions that have rows only (an insert costs its rows,
    # not the partition count): every column kind, every piece's rows, the pieces
    # this rank keeps apart from each destination's.
    from decimal import Decimal

    from mpshuffle.memory.pool import HostPool

    n = 200
    rng = np.random.default_rng(7)
    frame = pd.DataFrame({
        "k": rng.integers(0, 2**40, n),
        "x": rng.random(n),
        "flag": rng.random(n) < 0.5,
        "I": pd.array([None if i % 3 == 0 else i for i in range(n)], dtype="Int64"),
        "s": pd.Series([f"w{i}" * (i % 4) for i in range(n)], dtype="str"),
        "o": pd.Series([{"a": i} if i % 2 else [i] for i in range(n)], dtype=object),
        "d": pd.Series([Decimal(i) / 7 for i in range(n)], dtype=object),
    })
    adapter = PandasAdapter()
    ids = adapter.partition_ids(frame, ["k"], npartitions)
    pieces = adapter.split_for(frame, ["k"], npartitions, None, rank=1, nranks=3, pool=HostPool(2**24))
    assert sorted(pieces) == sorted(set(ids.tolist()))
    for pid, piece in pieces.items():
        got = adapter.unpack([piece], frame.iloc[:0])
        assert rows(got) == rows(frame[ids == pid])
    blocks = pieces.table.buffers  # type: ignore[attr-defined]  # PackedPieces
    owner_of_block: dict[int, set[int]] = {}
    for pid, buffer_index in zip(pieces.table.pids, pieces.table.buffer_of, strict=True):  # type: ignore[attr-defined]
        owner_of_block.setdefault(int(buffer_index), set()).add(int(pid) % 3)
    assert all(len(owners) == 1 for owners in owner_of_block.values()), owner_of_block
    assert len(blocks) >= 3
    # Columns with no raw layout (an Arrow list column travels as IPC streams).
    from mpshuffle.table.arrow import ArrowAdapter

    table = pa.table({"k": frame["k"].to_numpy(), "l": pa.array([[i, i + 1] for i in range(n)])})
    arrow = ArrowAdapter()
    arrow_ids = arrow.partition_ids(table, ["k"], npartitions)
    arrow_pieces = arrow.split_for(table, ["k"], npartitions, None, rank=0, nranks=2, pool=HostPool(2**24))
    assert sorted(arrow_pieces) == sorted(set(arrow_ids.tolist()))
    for pid, piece in arrow_pieces.items():
        got = arrow.unpack([piece], table.schema)
        assert got.column("l").to_pylist() == table.filter(pa.array(arrow_ids == pid)).column("l").to_pylist()


def test_unconvertible_object_column_falls_back_to_pickle() -> None:
    # Edge case 5: dicts and lists mixed with numbers; Arrow cannot convert it.
    # Only that column is pickled; the key stays a raw Arrow column.
    inputs = [
        pd.DataFrame({"k": [1, 2, 3], "o": pd.Series([{"a": 1}, 2, [3, 4]], dtype=object)}),
        pd.DataFrame({"k": [1, 4], "o": pd.Series(["text", 5.5], dtype=object)}),
    ]
    adapter = PandasAdapter()
    pieces = adapter.split(inputs[0], ["k"], 3)
    for piece in pieces.values():
        table, pickled, _ = read_piece(piece)
        assert table.column_names == ["k"] and list(pickled) == [1]
    outputs = shuffle(adapter, inputs, ["k"], 3, inputs[0].iloc[:0])
    out = concat(outputs)
    assert sorted(map(repr, out["o"])) == sorted(map(repr, [{"a": 1}, 2, [3, 4], "text", 5.5]))
    assert out["o"].dtype == object
    assert all(len(p) == 1 for p in key_partitions(outputs, "k").values())


@pytest.mark.parametrize("index", [False, True])
def test_sparse_columns_travel_pickled_with_their_dtype(index: bool) -> None:
    # pyarrow refuses Sparse columns with a TypeError; Dask's tasks and P2P
    # shuffles move them, so mpshuffle must too (a breaker found it failing).
    def frame(offset: int, n: int) -> pd.DataFrame:
        i = np.arange(offset, offset + n)
        return pd.DataFrame(
            {
                "k": i % 5,
                "sf": pd.arrays.SparseArray(np.where(i % 3 == 0, i / 2, np.nan)),
                "si": pd.arrays.SparseArray(np.where(i % 4 == 0, i, 0), fill_value=0),
                "v": i.astype("float64"),
            },
            index=pd.Index(i * 10, name="ix"),
        )

    inputs = [frame(0, 30), frame(30, 17)]
    adapter = PandasAdapter(index=index)
    for piece in adapter.split(inputs[0], ["si"], 4).values():
        table, pickled, _ = read_piece(piece)
        assert sorted(pickled) == [1, 2] and "k" in table.column_names
    meta = inputs[0].iloc[:0]
    outputs = shuffle(adapter, inputs, ["si"], 4, meta)
    out = pd.concat(list(outputs.values()), ignore_index=not index)
    assert_same_dtypes(out, meta)
    assert out["si"].dtype == pd.SparseDtype("int64", 0) and out["sf"].dtype == pd.SparseDtype("float64")
    everything = pd.concat(inputs)
    got = out.sort_values("v")
    np.testing.assert_array_equal(got["v"].to_numpy(), everything["v"].to_numpy())
    np.testing.assert_array_equal(got["si"].to_numpy(), everything["si"].to_numpy())
    np.testing.assert_array_equal(got["sf"].to_numpy(), everything["sf"].to_numpy())
    if index:
        assert list(got.index) == list(everything.index) and got.index.name == "ix"
    assert all(len(p) == 1 for p in key_partitions(outputs, "si").values())


def test_an_extension_dtype_that_does_not_hash_is_checked_not_cached() -> None:
    from mpshuffle.table.pandas import _extension_round_trips

    class Unhashable(pd.api.extensions.ExtensionDtype):
        name = "unhashable"
        type = object
        __hash__ = None  # type: ignore[assignment]

    assert _extension_round_trips(Unhashable()) is False  # no TypeError from the cache: pickled
    assert _extension_round_trips(pd.SparseDtype("float64")) is False
    assert _extension_round_trips(pd.Int64Dtype()) is True


def test_meta_column_missing_from_data_is_a_clear_error() -> None:
    # Edge case 6.
    frame = pd.DataFrame({"k": [1, 2], "v": [1.0, 2.0]})
    meta = pd.DataFrame(
        {
            "k": pd.Series([], dtype="int64"),
            "v": pd.Series([], dtype="float64"),
            "ghost": pd.Series([], dtype="float64"),
        }
    )
    pieces = list(PandasAdapter().split(frame, ["k"], 1).values())
    with pytest.raises(ShuffleError, match="ghost"):
        PandasAdapter().unpack(pieces, meta)
    with pytest.raises(ShuffleError, match="'v'"):
        PandasAdapter().unpack(pieces, meta[["k"]])


def test_empty_frames_and_empty_unpack() -> None:
    # Edge case 7.
    frame = rich_frame(0)
    meta = frame.iloc[:0]
    adapter = PandasAdapter()
    assert adapter.split(meta, ["k"], 4) == {}
    empty = adapter.unpack([], meta)
    assert len(empty) == 0
    assert_same_dtypes(empty, meta)
    assert list(empty["cat"].cat.categories) == ["even", "odd"]
    assert_same_dtypes(adapter.empty_like(meta), meta)


def test_float_keys_zeros_and_nans_together() -> None:
    # Edge case 8.
    keys = pd.DataFrame({"f": [0.0, -0.0, np.nan, float("nan"), -np.nan, 1.5, 0.0]})
    ids = partition_ids(keys, 1000)
    assert ids[0] == ids[1] == ids[6]
    assert ids[2] == ids[3] == ids[4]
    f32 = partition_ids(keys.astype("float32"), 1000)
    np.testing.assert_array_equal(ids, f32)
    outputs = shuffle(
        PandasAdapter(), [keys.assign(i=range(7))], ["f"], 1000, keys.assign(i=0).iloc[:0]
    )
    assert sum(out["f"].isna().any() for out in outputs.values()) == 1


def test_null_keys_of_every_type_land_together() -> None:
    frames = [
        pd.DataFrame({"k": pd.array([None], dtype="Int64")}),
        pd.DataFrame({"k": pd.Series([None], dtype="str")}),
        pd.DataFrame({"k": pd.Series([None], dtype=object)}),
        pd.DataFrame({"k": [np.nan]}),
        pd.DataFrame({"k": pd.Series([pd.NaT], dtype="datetime64[ns]")}),
        pd.DataFrame({"k": pd.Series([None], dtype="category")}),
    ]
    ids = {int(partition_ids(f, 1009)[0]) for f in frames}
    ids.add(int(partition_ids(pa.table({"k": pa.array([None], pa.int32())}), 1009)[0]))
    assert ids == {int(NULL_HASH % np.uint64(1009))}


def test_tz_aware_values_and_keys() -> None:
    # Edge case 9: tz kept; keys hash by instant.
    berlin = pd.DataFrame(
        {"t": pd.date_range("2024-10-27", periods=6, freq="30min", tz="Europe/Berlin")}
    )
    utc = berlin.assign(t=berlin["t"].dt.tz_convert("UTC"))
    np.testing.assert_array_equal(partition_ids(berlin, 97), partition_ids(utc, 97))
    ns = berlin.assign(t=berlin["t"].astype("datetime64[ns, Europe/Berlin]"))
    np.testing.assert_array_equal(partition_ids(berlin, 97), partition_ids(ns, 97))
    out = concat(shuffle(PandasAdapter(), [berlin], ["t"], 4, berlin.iloc[:0]))
    assert out["t"].dtype == berlin["t"].dtype
    assert sorted(out["t"]) == sorted(berlin["t"])


def test_integer_column_names_work() -> None:
    # Edge case 10: we chose to support them (names travel in the header).
    frame = pd.DataFrame({0: [1, 2, 3, 1], 1: ["a", "b", "c", "d"], 2: [0.5, 1.5, 2.5, 3.5]})
    outputs = shuffle(PandasAdapter(), [frame, frame], [0], 3, frame.iloc[:0])
    for out in outputs.values():
        assert list(out.columns) == [0, 1, 2]
        assert_same_dtypes(out, frame.iloc[:0])
    assert rows(concat(outputs)) == rows(pd.concat([frame, frame]))


@pytest.mark.parametrize(
    "labels",
    [[0, "0", "v"], [0, pd.Timestamp("2020-01-01"), "v"], [0, None, "v"], [0, ("a", "b"), "v"], [0, 1.5, "v"]],
    ids=["0 beside '0'", "Timestamp", "None (NaN)", "tuple", "float"],
)
def test_column_labels_travel_exactly(labels: list[Any]) -> None:
    # Found by a breaker (session 24): labels whose strings collide or that
    # are not JSON scalars were refused, and a None label (NaN in pandas)
    # failed the extract's column check. Dask's task shuffle moves them all.
    n = 30
    frame = pd.DataFrame(
        {0: np.arange(n) % 7, 1: np.arange(n) * 2.5, 2: [f"s{i}" for i in range(n)]}
    )
    frame.columns = pd.Index(labels, dtype=object)
    outputs = shuffle(PandasAdapter(), [frame.iloc[:12], frame.iloc[12:]], [0], 3, frame.iloc[:0])
    for pid, out in outputs.items():
        pd.testing.assert_index_equal(out.columns, frame.columns)
        expected = frame[partition_ids(frame[[0]], 3) == pid]
        pd.testing.assert_frame_equal(
            out.sort_values("v", ignore_index=True), expected.sort_values("v", ignore_index=True), check_exact=True
        )
    assert sum(len(out) for out in outputs.values()) == n


_OBJECT_VALUES = {
    "str+NaN": ["a", np.nan, "b", None],
    "str+NA+NaT": ["a", pd.NA, "b", pd.NaT],
    "bool+NaN": [True, np.nan, False, None],
    "bytes+NaN": [b"x", np.nan, b"y", None],
    "all NaN": [np.nan, np.nan, np.nan, np.nan],
    "datetime": [datetime.datetime(2020, 1, d) for d in (1, 2, 3, 4)],
    "big ints": [2**64, 1, -(2**70), 3],
    "lone surrogate": ["a\udcff", "b", "c", "d"],
}


# A key of lone surrogates is left out: pandas' hash_array cannot take them (Dask's task shuffle fails alike).
@pytest.mark.parametrize(
    ("case", "where"),
    [(c, w) for c in _OBJECT_VALUES for w in ("column", "key") if (c, w) != ("lone surrogate", "key")],
)
def test_object_values_come_back_as_they_went(case: str, where: str) -> None:
    # Found by a breaker (session 24): missing values other than None among
    # strings, bytes or booleans came back as None; datetime.datetime objects
    # as Timestamps; ints past 64 bits and lone surrogates failed the insert.
    # Dask's task shuffle returns every value as it was. (A kept object index
    # goes through pandas' concat, which infers its dtype, as with tasks.)
    values = _OBJECT_VALUES[case]
    n = 12
    column = pd.Series(values * 3, dtype=object)
    frame = pd.DataFrame({"k": np.arange(n) % 5, "o": column, "v": np.arange(n)})
    on = ["o"] if where == "key" else ["k"]
    adapter = PandasAdapter()
    outputs = shuffle(adapter, [frame.iloc[:5], frame.iloc[5:]], on, 3, frame.iloc[:0])
    for out in outputs.values():
        assert out["o"].dtype == object
    got = pd.concat(list(outputs.values())).sort_values("v")
    want = frame.sort_values("v")
    assert [(type(v), repr(v)) for v in got["o"]] == [(type(v), repr(v)) for v in want["o"]]
    assert got["v"].tolist() == want["v"].tolist()


def test_categorical_column_index_travels() -> None:
    # Found by a breaker (session 24): pyarrow cannot read back a
    # categorical column index from its metadata; such frames go pickled.
    frame = pd.DataFrame({"k": np.arange(10) % 3, "x": np.arange(10.0)})
    frame.columns = pd.CategoricalIndex(["k", "x"])
    outputs = shuffle(PandasAdapter(), [frame.iloc[:4], frame.iloc[4:]], ["k"], 2, frame.iloc[:0])
    got = pd.concat(list(outputs.values())).sort_values("x", ignore_index=True)
    assert list(got.columns) == ["k", "x"]
    assert got["x"].tolist() == frame["x"].tolist() and sorted(got["k"]) == sorted(frame["k"])


def test_repeated_column_labels_are_an_error() -> None:
    frame = pd.DataFrame([[1, 2, 3]], columns=pd.Index(["k", "a", "a"]))
    with pytest.raises(ShuffleError, match="unique.*'a', 'a'"):
        PandasAdapter().split(frame, ["k"], 2)


def test_two_column_key_str_and_int() -> None:
    # Edge case 11.
    rng = np.random.default_rng(0)
    frame = pd.DataFrame(
        {
            "s": pd.Series(rng.choice(["a", "b", "c"], 300), dtype="str"),
            "i": rng.integers(0, 4, 300),
            "v": np.arange(300),
        }
    )
    outputs = shuffle(
        PandasAdapter(), [frame.iloc[:150], frame.iloc[150:]], ["s", "i"], 7, frame.iloc[:0]
    )
    where: dict[tuple[str, int], set[int]] = {}
    for pid, out in outputs.items():
        for pair in zip(out["s"], out["i"], strict=True):
            where.setdefault(pair, set()).add(pid)
    assert len(where) == 12 and all(len(p) == 1 for p in where.values())
    # Column order is part of the hash; both orders still group pairs.
    assert not np.array_equal(
        partition_ids(frame[["s", "i"]], 1 << 30), partition_ids(frame[["i", "s"]], 1 << 30)
    )


def test_keep_index_option() -> None:
    frame = pd.DataFrame({"k": [3, 1, 2]}, index=pd.Index([10, 20, 30], name="idx"))
    adapter = PandasAdapter(index=True)
    out = concat_index(shuffle(adapter, [frame], ["k"], 1, frame.iloc[:0]))
    pd.testing.assert_frame_equal(out, frame)


def concat_index(outputs: dict[int, pd.DataFrame]) -> pd.DataFrame:
    return pd.concat(list(outputs.values()))


def _kept_index_cases() -> dict[str, pd.DataFrame]:
    """Frames whose kept index Arrow's field names or conversion cannot carry (found by breakers)."""
    import decimal

    n = 24
    cols = {"k": np.arange(n) % 5, "v": np.arange(n) * 1.5}
    two = pd.MultiIndex.from_arrays([np.arange(n), np.arange(n) * 2], names=["a", "__index_level_1__"])
    return {
        "int name": pd.DataFrame(cols, index=pd.Index(np.arange(n) * 10, name=5)),
        "tuple name": pd.DataFrame(cols, index=pd.Index(np.arange(n) * 10, name=("a", "b"))),
        "name 0 beside column '0'": pd.DataFrame({"k": cols["k"], "0": cols["v"]}, index=pd.Index(np.arange(n), name=0)),
        "str name of a column": pd.DataFrame(cols, index=pd.Index(np.arange(n), name="v")),
        "name __index_level_0__": pd.DataFrame(cols, index=pd.Index(np.arange(n), name="__index_level_0__")),
        "level named __index_level_1__": pd.DataFrame(cols, index=two),
        "column __index_level_0__, unnamed index": pd.DataFrame(
            {"k": cols["k"], "__index_level_0__": cols["v"]}, index=pd.Index(np.arange(n) * 3)
        ),
        "int-named RangeIndex": pd.DataFrame(cols, index=pd.RangeIndex(n, name=7)),
        "Arrow list index": pd.DataFrame(
            cols, index=pd.Index(pd.array([[i, i] if i % 2 else None for i in range(n)], dtype=pd.ArrowDtype(pa.list_(pa.int64()))), name="ix")
        ),
        "Arrow dictionary index": pd.DataFrame(cols, index=pd.Index(
            pd.array(["a", None, "b"] * (n // 3), dtype=pd.ArrowDtype(pa.dictionary(pa.int32(), pa.string()))), name="ix"
        )),
        "Arrow decimal index": pd.DataFrame(cols, index=pd.Index(
            pd.array([decimal.Decimal(i) / 4 for i in range(n)], dtype=pd.ArrowDtype(pa.decimal128(10, 2))), name="ix"
        )),
        "Arrow string index": pd.DataFrame(
            cols, index=pd.Index(pd.array([f"s{i}" for i in range(n)], dtype=pd.ArrowDtype(pa.string())), name="ix")
        ),
        "interval index": pd.DataFrame(cols, index=pd.IntervalIndex.from_breaks(np.arange(n + 1), name="ix")),
    }


@pytest.mark.parametrize("case", sorted(_kept_index_cases()))
def test_kept_index_keeps_its_names_dtype_and_values(case: str) -> None:
    # Found by breakers: index names that are not strings came back as
    # strings, an index named 0 beside a column "0" lost that column, a level
    # named __index_level_N__ lost its name, Arrow list / dictionary index
    # levels failed the extract and decimal / string ones came back object or
    # pandas' string. Each comes back as sent, as with Dask's task shuffle.
    frame = _kept_index_cases()[case]
    inputs = [frame.iloc[:10], frame.iloc[10:]]
    adapter = PandasAdapter(index=True)
    outputs = shuffle(adapter, inputs, ["k"], 3, frame.iloc[:0])
    for pid, out in outputs.items():
        assert list(out.columns) == list(frame.columns)
        assert list(out.index.names) == list(frame.index.names)
        assert list(out.index.dtypes if out.index.nlevels > 1 else [out.index.dtype]) == list(
            frame.index.dtypes if frame.index.nlevels > 1 else [frame.index.dtype]
        )
        # Each output partition holds exactly the input rows of its keys, index included.
        expected = frame[partition_ids(frame[["k"]], 3) == pid]
        def by_last(f: pd.DataFrame) -> pd.DataFrame:
            return f.iloc[np.argsort(f.iloc[:, -1].to_numpy(), kind="stable")]

        pd.testing.assert_frame_equal(by_last(out), by_last(expected), check_exact=True)
    assert sum(len(out) for out in outputs.values()) == len(frame)


# ---------------------------------------------------- reconcile with meta


def test_lossless_cast_toward_meta() -> None:
    frame = pd.DataFrame({"k": [1, 2], "x": np.array([5, 6], dtype="int64")})
    meta = pd.DataFrame({"k": pd.Series([], dtype="int64"), "x": pd.Series([], dtype="Int64")})
    out = PandasAdapter().unpack(list(PandasAdapter().split(frame, ["k"], 1).values()), meta)
    assert out["x"].dtype == "Int64" and out["x"].tolist() == [5, 6]


@pytest.mark.parametrize(
    ("values", "meta_dtype"),
    [(["a", "b"], "int64"), ([1.5, 2.0], "int64"), ([1, 300], "int8"), (["01", "2"], "int64")],
)
def test_lossy_cast_error_names_column(values: list[Any], meta_dtype: str) -> None:
    frame = pd.DataFrame({"k": [1, 2], "col_x": values})
    meta = pd.DataFrame(
        {"k": pd.Series([], dtype="int64"), "col_x": pd.Series([], dtype=meta_dtype)}
    )
    pieces = list(PandasAdapter().split(frame, ["k"], 1).values())
    with pytest.raises(ShuffleError, match="col_x") as info:
        PandasAdapter().unpack(pieces, meta)
    assert meta_dtype in str(info.value)


def test_incompatible_pieces_error_names_column() -> None:
    a = pd.DataFrame({"k": [1], "x": [1]})
    b = pd.DataFrame({"k": [1], "x": ["text"]})
    pieces = [PandasAdapter().split(f, ["k"], 1)[0] for f in (a, b)]
    with pytest.raises(ShuffleError, match="'x'"):
        PandasAdapter().unpack(pieces, a.iloc[:0])


def test_repeated_column_names_are_named() -> None:
    # Sets of names agree, but a frame with a name twice cannot match the meta by position.
    frame = pd.DataFrame([[1, 2, 0.5]], columns=["a", "a", "b"])
    meta = pd.DataFrame({"a": pd.Series([], dtype="int64"), "b": pd.Series([], dtype="float64")})
    with pytest.raises(ShuffleError, match=r"repeated: \['a'\]"):
        reconcile(frame, meta)
    reordered = reconcile(pd.DataFrame({"b": [0.5], "a": [1]}), meta)
    assert list(reordered.columns) == ["a", "b"] and reordered.dtypes.tolist() == meta.dtypes.tolist()


# ------------------------------------------------------------- hashing


@pytest.mark.parametrize(
    "dtype", ["int8", "int16", "int32", "uint16", "uint32", "Int64", "Int32", "UInt8"]
)
def test_integer_width_does_not_change_ids(dtype: str) -> None:
    values = [0, 1, 2, 7, 100, 127]
    ref = partition_ids(pd.DataFrame({"k": np.array(values, dtype="int64")}), 1 << 20)
    got = partition_ids(pd.DataFrame({"k": pd.Series(values).astype(dtype)}), 1 << 20)
    np.testing.assert_array_equal(ref, got)


def test_pandas_and_pyarrow_give_identical_ids() -> None:
    frame = pd.DataFrame(
        {
            "i": pd.array([1, None, -3, 2**40], dtype="Int64"),
            "f": [0.5, np.nan, -0.0, 1e300],
            "s": pd.Series(["a", None, "ü", ""], dtype="str"),
            "t": pd.to_datetime(["2020-01-01", None, "1970-01-01", "2262-01-01"]).tz_localize(
                "UTC"
            ),
            "b": [True, False, True, False],
        }
    )
    table = pa.table(
        {
            "i": pa.array([1, None, -3, 2**40], pa.int64()),
            "f": pa.array([0.5, None, -0.0, 1e300], pa.float32()).cast(pa.float64()),
            "s": pa.array(["a", None, "ü", ""], pa.string()),
            "t": pa.array(
                [
                    pd.Timestamp("2020-01-01"),
                    None,
                    pd.Timestamp("1970-01-01"),
                    pd.Timestamp("2262-01-01"),
                ],
                pa.timestamp("ms", tz="Asia/Tokyo"),
            ),
            "b": pa.array([True, False, True, False]),
        }
    )
    table = table.set_column(1, "f", pa.array([0.5, None, -0.0, 1e300], pa.float64()))
    for cols in (["i"], ["f"], ["s"], ["t"], ["b"], ["s", "i"], ["t", "f", "b"]):
        np.testing.assert_array_equal(
            partition_ids(frame[cols], 32769),
            partition_ids(table.select(cols), 32769),
            err_msg=str(cols),
        )
        np.testing.assert_array_equal(
            PandasAdapter().partition_ids(frame, cols, 257),
            ArrowAdapter().partition_ids(table, cols, 257),
        )


def test_category_object_and_str_keys_agree() -> None:
    text = ["x", "y", None, "x", "zz"]
    ref = partition_ids(pd.DataFrame({"k": pd.Series(text, dtype="str")}), 1 << 16)
    for series in (
        pd.Series(text, dtype="category"),
        pd.Series(text, dtype=object),
        pd.Series(text, dtype=pd.StringDtype("python")),
    ):
        np.testing.assert_array_equal(ref, partition_ids(pd.DataFrame({"k": series}), 1 << 16))
    dict_table = pa.table({"k": pa.array(text).dictionary_encode()})
    np.testing.assert_array_equal(ref, partition_ids(dict_table, 1 << 16))


def test_known_hash_values() -> None:
    # Pins the hash so that a change in pandas' hashing or here is noticed.
    ids = partition_ids(pd.DataFrame({"i": [1, 2], "s": ["a", "b"]}), 2**31)
    single = partition_ids(pd.DataFrame({"i": [1, 2]}), 2**31)
    assert ids.tolist() == KNOWN_IDS and single.tolist() == KNOWN_SINGLE


KNOWN_IDS = [916707353, 1066310029]
KNOWN_SINGLE = [269157861, 975901834]


def test_ids_are_deterministic_across_processes() -> None:
    code = (
        "import pandas as pd, numpy as np; from mpshuffle.table import partition_ids;"
        "df = pd.DataFrame({'s': ['a', 'bb', None, 'ü'] * 50, 'i': np.arange(200) % 9,"
        " 'f': [0.5, np.nan, -0.0, 3.0] * 50});"
        "print(partition_ids(df, 1000).tolist())"
    )
    outs = [
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            # The parent's environment (however mpshuffle is on the path: an
            # install or PYTHONPATH) with only Python's hash seed changed.
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    ]
    assert outs[0] == outs[1] and len(json.loads(outs[0])) == 200


def test_combine_is_documented_formula() -> None:
    h0 = np.array([1, 2**63], dtype=np.uint64)
    h1 = np.array([5, 7], dtype=np.uint64)
    m = 0x9E3779B97F4A7C15
    expected = [((int(a) * m) % 2**64) ^ int(b) for a, b in zip(h0, h1, strict=True)]
    assert combine_hashes([h0, h1]).tolist() == expected


def test_bad_npartitions() -> None:
    with pytest.raises(ValueError, match="npartitions"):
        partition_ids(pd.DataFrame({"k": [1]}), 0)


def test_partition_owner() -> None:
    assert [partition_owner(p, 3) for p in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    with pytest.raises(ValueError):
        partition_owner(1, 0)


@pytest.mark.parametrize(("nranks", "npartitions"), [(1, 5), (3, 7), (4, 2), (5, 0)])
def test_owned_partitions_inverts_partition_owner(nranks: int, npartitions: int) -> None:
    owned = [list(owned_partitions(r, nranks, npartitions)) for r in range(nranks)]
    assert sorted(p for ps in owned for p in ps) == list(range(npartitions))
    for r, ps in enumerate(owned):
        assert all(partition_owner(p, nranks) == r for p in ps)
    with pytest.raises(ValueError, match="rank must be in"):
        owned_partitions(nranks, nranks, npartitions)


@pytest.mark.parametrize(("nranks", "npartitions"), [(1, 5), (3, 7), (4, 2), (2, 9)])
def test_device_partition_order_groups_rows_by_owner(nranks: int, npartitions: int) -> None:
    from mpshuffle.table.device import partition_order, rank_major_pids

    ids = np.random.default_rng(0).integers(0, npartitions, 500).astype(np.int64)
    order, counts = partition_order(ids, npartitions, nranks)
    owners = [partition_owner(int(p), nranks) for p in ids[order]]
    assert owners == sorted(owners)  # rank-major: every owner's rows together, rank by rank
    pids = rank_major_pids(npartitions, nranks)
    assert ids[order].tolist() == [p for p in pids for _ in range(counts[p])]


# ----------------------------------------------------------- arrow adapter


def test_arrow_roundtrip_with_null_promotion_and_dictionaries() -> None:
    a = pa.table(
        {
            "k": pa.array([1, 2, 3], pa.int32()),
            "s": pa.array([None, None, None], pa.null()),
            "d": pa.array(["x", "y", "x"]).dictionary_encode(),
        }
    )
    b = pa.table(
        {
            "k": pa.array([3, 4], pa.int32()),
            "s": pa.array(["q", None]),
            "d": pa.array(["z", "x"]).dictionary_encode(),
        }
    )
    meta = b.schema
    adapter = ArrowAdapter()
    outputs = shuffle(adapter, [a, b], ["k"], 3, meta)
    for out in outputs.values():
        assert out.schema.equals(meta)
    total = pa.concat_tables(list(outputs.values()))
    assert sorted(total.column("k").to_pylist()) == [1, 2, 3, 3, 4]
    assert sorted(map(str, total.column("s").to_pylist())) == ["None"] * 4 + ["q"]
    assert adapter.unpack([], meta).schema.equals(meta)
    assert adapter.split(meta.empty_table(), ["k"], 3) == {}


def test_arrow_lossy_cast_names_column() -> None:
    t = pa.table({"k": [1], "big": pa.array([2**40], pa.int64())})
    meta = pa.schema([("k", pa.int64()), ("big", pa.int32())])
    with pytest.raises(ShuffleError, match="big"):
        ArrowAdapter().unpack(list(ArrowAdapter().split(t, ["k"], 1).values()), meta)
    with pytest.raises(ShuffleError, match="ghost"):
        ArrowAdapter().unpack(
            list(ArrowAdapter().split(t, ["k"], 1).values()),
            meta.append(pa.field("ghost", pa.int8())),
        )


# ---------------------------------------------------- PackedData, registry


def test_packed_data_frames_roundtrip_zero_copy() -> None:
    frame = rich_frame(0)
    piece = PandasAdapter().split(frame, ["k"], 1)[0]
    assert piece.nbytes == len(piece.metadata) + piece.data.size
    frames = piece.to_frames()
    assert frames[1] is piece.data
    back = PackedData.from_frames([memoryview(bytes(frames[0])), frames[1]])
    assert back.nrows == len(frame) and back.metadata == piece.metadata and back.data is piece.data
    out = PandasAdapter().unpack([back], frame.iloc[:0])
    pd.testing.assert_frame_equal(out, frame)
    raw = PackedData(b"", b"abc", 0)
    assert raw.nbytes == 3 and PackedData.from_frames(raw.to_frames()) == raw
    with pytest.raises(ValueError):
        PackedData.from_frames([b"x"])


def test_get_adapter_and_registry() -> None:
    assert isinstance(get_adapter(pd.DataFrame()), PandasAdapter)
    assert isinstance(get_adapter(pa.table({"a": [1]})), ArrowAdapter)
    assert isinstance(get_adapter(pa.schema([])), ArrowAdapter)
    with pytest.raises(TypeError, match="list"):
        get_adapter([1, 2])

    class Keeping(PandasAdapter):
        name = "pandas-index"

    registry = AdapterRegistry()
    registry.register(Keeping(index=True))
    assert isinstance(registry.lookup(pd.DataFrame()), Keeping)
    with pytest.raises(TypeError):
        register_adapter(object())  # type: ignore[arg-type]


def test_nbytes_and_counts() -> None:
    frame = rich_frame(0)
    adapter = get_adapter(frame)
    assert adapter.nbytes(frame) == frame.memory_usage(deep=True).sum()
    assert adapter.num_rows(frame) == 40 and adapter.column_names(frame) == list(frame.columns)


def test_equal_object_keys_hash_alike_in_every_partition() -> None:
    """True == 1 == 1.0 (pandas groups them): the same id whichever comes first in a partition."""
    parts = [
        pd.DataFrame({"k": pd.Series([True, 1], dtype=object)}),
        pd.DataFrame({"k": pd.Series([1, 1.0], dtype=object)}),
        pd.DataFrame({"k": pd.Series([1.0, "x", None], dtype=object)}),
        pd.DataFrame({"k": pd.Series([np.int64(1), (1, 2)], dtype=object)}),
    ]
    ids = [partition_ids(p, 1000) for p in parts]
    ones = {int(i[0]) for i in ids} | {int(ids[0][1]), int(ids[1][1]), int(ids[3][0])}
    assert len(ones) == 1
    # 2.5 and 0.0 / -0.0 in mixed columns too
    a = partition_ids(pd.DataFrame({"k": pd.Series([2.5, "y", 0.0], dtype=object)}), 1000)
    b = partition_ids(pd.DataFrame({"k": pd.Series([(3,), 2.5, -0.0], dtype=object)}), 1000)
    assert a[0] == b[1] and a[2] == b[2]


def _mixed_input(i: int, n: int, rng: np.random.Generator) -> pd.DataFrame:
    # Odd inputs have nulls in "n" (a validity bitmap), even ones none.
    return pd.DataFrame(
        {
            "k": rng.integers(0, 50, n),
            "b": rng.random(n) < 0.5,
            "s": pd.Series(
                [None if rng.random() < 0.2 else "x" * int(rng.integers(0, 12)) for _ in range(n)],
                dtype="string[pyarrow]",
            ),
            "n": pd.array([None if i % 2 and rng.random() < 0.3 else int(rng.integers(0, 9)) for _ in range(n)],
                          dtype="Int64"),
            "f": rng.random(n),
        },
        index=pd.RangeIndex(100 * i, 100 * i + n),
    )


@pytest.mark.parametrize("index", [False, True])
def test_gather_of_many_inserts_equals_reading_piece_by_piece(index: bool) -> None:
    from mpshuffle.table._columns import gather

    rng = np.random.default_rng(7)
    adapter = PandasAdapter(index=index)
    frames = [_mixed_input(i, int(rng.integers(0, 40)), rng) for i in range(6)]
    npart = 5
    splits = [adapter.split_for(f, ["k"], npart, rank=0, nranks=2) for f in frames]
    # The pieces of one insert share one metadata object; their data holds their layout.
    assert all(len({id(p.metadata) for p in s.values()}) <= 1 for s in splits)
    for pid in range(npart):
        pieces = [s[pid] for s in splits if pid in s]
        assert gather(pieces) is not None  # validity in some pieces only, strings, booleans
        got = adapter.unpack(pieces, frames[0].iloc[:0])
        # Rows in order of input partition, then of position.
        rows = pd.concat([f[_ids(adapter, f, npart) == pid] for f in frames])
        expected = rows if index else rows.reset_index(drop=True)
        pd.testing.assert_frame_equal(got, expected, check_dtype=False)
        assert [str(t) for t in got.dtypes] == [str(t) for t in frames[0].dtypes]


def _ids(adapter: PandasAdapter, frame: pd.DataFrame, npart: int) -> Any:
    return adapter.partition_ids(frame, ["k"], npart)


def _outputs_as_selected(
    adapter: PandasAdapter, frames: list[pd.DataFrame], outputs: dict[int, pd.DataFrame], npart: int, index: bool
) -> list[pd.DataFrame]:
    """Assert every output partition is its rows of the inputs, in input order (index kept or not); return them."""
    for pid, out in outputs.items():
        parts = [f[_ids(adapter, f, npart) == pid] for f in frames]
        expected = pd.concat(parts) if index else pd.concat(parts, ignore_index=True)
        pd.testing.assert_frame_equal(out, expected)
    return list(outputs.values())


def _schema_zoo() -> list[pd.DataFrame]:
    n = 6
    base = {
        "i": np.arange(n), "f": np.linspace(0, 1, n), "b": np.arange(n) % 2 == 0,
        "cat": pd.Categorical(["a", "b", "a", "c", "b", "a"]),
        "ts": pd.date_range("2026-01-01", periods=n, tz="Europe/Berlin"),
        "s": pd.array([f"x{i}" for i in range(n)], dtype="str"),
        "I": pd.array([1, None, 3, 4, None, 6], dtype="Int64"),
    }
    frames = [pd.DataFrame(base), pd.DataFrame(base, index=pd.Index(np.arange(n) * 3, name="ix"))]
    other = pd.DataFrame({**base, "cat": pd.Categorical(["a", "b", "a", "c", "b", "z"], ordered=True)})
    frames.append(other)
    renamed = pd.DataFrame(base)
    renamed.columns = pd.Index(list(renamed.columns), name="cols")
    frames.append(renamed)
    frames.append(pd.DataFrame({0: np.arange(n), 1: np.arange(n) * 0.5}))
    frames.append(pd.DataFrame({"i": np.arange(n)}, index=pd.MultiIndex.from_arrays(
        [np.arange(n), np.arange(n) * 0.5], names=["a", "b"])))
    frames.append(pd.DataFrame({"o": np.array(["a", "b", None, "c", "d", "e"], dtype=object)}))
    frames.append(pd.DataFrame({"o": np.array([1, 2, None, 3, 4, 5], dtype=object)}))  # same dtypes, other type
    return frames


@pytest.mark.parametrize("index", [False, True])
def test_remembered_schema_is_arrows_schema_of_each_frame(index: bool) -> None:
    from mpshuffle.table import pandas as pandas_module

    pandas_module._SCHEMAS.clear()
    for _ in range(2):  # the second pass reads the remembered schemas
        for frame in _schema_zoo():
            got = pandas_module._schema_of(frame, index, tuple(frame.dtypes))
            want = pa.Schema.from_pandas(frame, preserve_index=index)
            assert got.equals(want, check_metadata=True), (frame.dtypes, got, want)
    # Frames that differ only where Arrow infers from values (object columns) are never remembered.
    assert not any(object in key[5] for key in pandas_module._SCHEMAS)
    assert len(pandas_module._SCHEMAS) <= pandas_module._SCHEMAS_MAX


# ------------------------------------------- gathered tables to pandas


def _owned_table(n: int, extra: dict[str, pa.Array] | None = None) -> tuple[pa.Table, dict[str, np.ndarray]]:
    """A table whose numeric buffers are numpy arrays of this test (as a gather's are)."""
    rng = np.random.default_rng(3)
    arrays = {
        "i64": rng.integers(-(2**40), 2**40, n),
        "u8": rng.integers(0, 255, n).astype(np.uint8),
        "f64": rng.random(n),
        "f32": rng.random(n).astype(np.float32),
    }
    columns = {
        name: pa.Array.from_buffers(pa.from_numpy_dtype(a.dtype), n, [None, pa.py_buffer(a)])
        for name, a in arrays.items()
    }
    columns["s"] = pa.array([f"v{i}" for i in range(n)], pa.string())
    columns["b"] = pa.array(np.arange(n) % 3 == 0)
    columns["inull"] = pa.array([None if i % 4 == 0 else i for i in range(n)], pa.int64())
    columns.update(extra or {})
    return pa.table(columns), arrays


def test_owned_numeric_columns_become_writable_views_without_a_copy() -> None:
    from mpshuffle.table.pandas import _owned_to_pandas

    table, arrays = _owned_table(50)
    got = _owned_to_pandas(table)
    assert got is not None
    pd.testing.assert_frame_equal(got, table.to_pandas(use_threads=False))
    for name, a in arrays.items():
        values = got[name].array.to_numpy()
        assert np.shares_memory(values, a), name  # no copy of the gathered bytes
    # Settable in place, as a frame from to_pandas is; the write lands in the buffer it views.
    got.loc[3, "f64"] = -1.0
    got.loc[4, "i64"] = 7
    assert got["f64"].iloc[3] == -1.0 and got["i64"].iloc[4] == 7


@pytest.mark.parametrize("unit", ["s", "ms", "us", "ns"])
def test_owned_timestamp_and_duration_columns_become_writable_views_without_a_copy(unit: str) -> None:
    from mpshuffle.table.pandas import _owned_to_pandas

    n = 40
    stamps = np.arange(n, dtype=np.int64) * 86_400 + 10**6
    spans = np.arange(n, dtype=np.int64) * 7
    nulls = pa.array([None if i % 5 == 0 else i for i in range(n)], pa.timestamp(unit))
    table, _ = _owned_table(n, {
        "t": pa.Array.from_buffers(pa.timestamp(unit), n, [None, pa.py_buffer(stamps)]),
        "d": pa.Array.from_buffers(pa.duration(unit), n, [None, pa.py_buffer(spans)]),
        "tnull": nulls,  # converted (NaT written) as before
    })
    got = _owned_to_pandas(table)
    assert got is not None
    expected = table.to_pandas(use_threads=False)
    pd.testing.assert_frame_equal(got, expected)
    assert got["t"].dtype == np.dtype(f"datetime64[{unit}]") and got["d"].dtype == np.dtype(f"timedelta64[{unit}]")
    assert np.shares_memory(np.asarray(got["t"].array), stamps)
    assert np.shares_memory(np.asarray(got["d"].array), spans)
    assert got["tnull"].isna().sum() == 8
    got.loc[2, "t"] = pd.Timestamp("2001-02-03")
    assert got["t"].iloc[2] == pd.Timestamp("2001-02-03")
    assert got["t"].iloc[3] == expected["t"].iloc[3]


def test_owned_conversion_declines_what_would_come_out_read_only() -> None:
    from mpshuffle.table.pandas import _owned_to_pandas

    n = 8
    zoned = pa.array(np.arange(n).astype("datetime64[ns]")).cast(pa.timestamp("ns", tz="UTC"))
    table, _ = _owned_table(n, {"t": zoned})
    assert _owned_to_pandas(table) is None  # a timestamp with a time zone: converted as before
    days = pa.array(np.arange(n).astype("datetime64[D]"), pa.date32())
    table, _ = _owned_table(n, {"day": days})
    assert _owned_to_pandas(table) is None  # a date column: converted as before
    frozen = pa.Array.from_buffers(pa.float64(), n, [None, pa.py_buffer(bytes(8 * n))])  # immutable
    assert _owned_to_pandas(pa.table({"x": frozen})) is None
    two_chunks = pa.table({"x": pa.chunked_array([np.arange(3.0), np.arange(2.0)])})
    assert _owned_to_pandas(two_chunks) is None


@pytest.mark.parametrize("index", [False, True])
def test_unpacked_gathered_partition_is_writable_and_exact(index: bool) -> None:
    adapter = PandasAdapter(index=index)
    rng = np.random.default_rng(11)
    frames = [
        pd.DataFrame(
            {"k": rng.integers(0, 100, n), "x": rng.random(n), "i32": rng.integers(0, 9, n).astype(np.int32),
             "s": pd.Series([f"s{v}" for v in range(n)], dtype="str")},
            index=pd.RangeIndex(1000 * i, 1000 * i + n),
        )
        for i, n in enumerate([30, 0, 45])
    ]
    meta = frames[0].iloc[:0]
    outputs = shuffle(adapter, frames, ["k"], 4, meta)
    for out in _outputs_as_selected(adapter, frames, outputs, 4, index):
        out.iloc[0, 1] = -5.0  # the float column, set in place
        assert out.iloc[0, 1] == -5.0


def _owned_copy(frame: pd.DataFrame, index: bool) -> tuple[pa.Table, pa.Schema]:
    """``frame`` as a table over fresh mutable buffers (as a gather makes), and the schema object it was made with."""
    source = pa.Table.from_pandas(frame, preserve_index=index)
    arrays = []
    for field, column in zip(source.schema, source.columns, strict=True):
        a = column.combine_chunks()
        if pa.types.is_string(field.type) or pa.types.is_large_string(field.type) or a.null_count:
            arrays.append(a)
            continue
        data = np.frombuffer(a.buffers()[1], np.uint8).copy()
        arrays.append(pa.Array.from_buffers(field.type, len(a), [None, pa.py_buffer(data)], offset=a.offset))
    schema = source.schema
    return pa.Table.from_arrays(arrays, schema=schema), schema


@pytest.mark.parametrize("case", ["plain", "kept-index", "named-float-index", "datetime-index", "times", "int-labels"])
def test_owned_frames_built_directly_equal_to_pandas(case: str) -> None:
    from mpshuffle.table import pandas as mod

    n = 37
    rng = np.random.default_rng(7)
    frames = {
        "plain": (pd.DataFrame({"key": rng.integers(-5, 5, n), "x": rng.random(n)}), False),
        "kept-index": (pd.DataFrame({"key": rng.integers(-5, 5, n), "v": rng.random(n)},
                                    index=rng.integers(0, 1000, n)), True),
        "named-float-index": (pd.DataFrame({"v": rng.random(n).astype(np.float32),
                                            "u": rng.integers(0, 9, n).astype(np.uint16)},
                                           index=pd.Index(rng.random(n), name="w")), True),
        "datetime-index": (pd.DataFrame({"v": np.arange(n, dtype=np.int8)},
                                        index=pd.date_range("2001-01-01", periods=n, freq="h", name="t")), True),
        "times": (pd.DataFrame({"t": pd.date_range("2001-01-01", periods=n, freq="s").as_unit("ms"),
                                "d": pd.to_timedelta(np.arange(n), "s").as_unit("ns")}), False),
        "int-labels": (pd.DataFrame({0: rng.random(n), 1: rng.integers(0, 9, n)}), False),
    }
    frame, index = frames[case]
    table, schema = _owned_copy(frame, index)
    assert mod._frame_plan(schema) is not None  # these tables take the direct path
    got = mod._owned_to_pandas(table, schema)
    assert got is not None
    expected = table.to_pandas(use_threads=False)
    pd.testing.assert_frame_equal(got, expected, check_exact=True, check_column_type=True, check_index_type=True)
    assert type(got.index) is type(expected.index) and got.index.names == expected.index.names
    assert got.columns.dtype == expected.columns.dtype
    # The same frame as the view-replacing conversion gives (no direct path): blocks, writability.
    before = mod._FRAME_PLANS.copy()
    mod._FRAME_PLANS.clear()
    mod._FRAME_PLANS[id(schema)] = (schema, None)
    try:
        viewed = mod._owned_to_pandas(table, schema)
    finally:
        mod._FRAME_PLANS.clear()
        mod._FRAME_PLANS.update(before)
    assert viewed is not None
    pd.testing.assert_frame_equal(got, viewed, check_exact=True, check_column_type=True, check_index_type=True)
    assert got._mgr.nblocks == viewed._mgr.nblocks
    for name in got.columns:
        values = np.asarray(got[name].array)
        assert values.flags.writeable
        assert any(np.shares_memory(values, np.frombuffer(c.chunk(0).buffers()[1], np.uint8))
                   for c in table.columns)  # a view of the table's buffer, no copy
    # Settable in place, as a frame from to_pandas is.
    column = got.columns[0]
    got.loc[got.index[2], column] = got[column].iloc[5]
    assert got[column].iloc[2] == got[column].iloc[5]


def test_owned_frames_not_built_directly_where_to_pandas_differs() -> None:
    from mpshuffle.table import pandas as mod

    n = 9
    cases = [
        (pd.DataFrame({"a": pd.array(np.arange(n), dtype="Int64")}), False),  # an extension dtype in the metadata
        (pd.DataFrame({"v": np.arange(n)}, index=[f"r{i}" for i in range(n)]), True),  # a string index
        (pd.DataFrame({"v": np.arange(4)}, index=pd.MultiIndex.from_arrays([[1, 2, 3, 4], [5, 6, 7, 8]])), True),
        (pd.DataFrame({"s": [f"v{i}" for i in range(n)], "v": np.arange(n)}), False),  # a string column
    ]
    for frame, index in cases:
        table, schema = _owned_copy(frame, index)
        assert mod._frame_plan(schema) is None
        assert mod._direct_frame(table, schema) is None
    # A column with nulls goes through to_pandas too.
    table = pa.table({"x": pa.array([1.0, None, 3.0])})
    assert mod._direct_frame(table, table.schema) is None


@pytest.mark.parametrize("dtype", ["Int64", "string", "boolean"])
def test_a_kept_extension_index_keeps_its_dtype_and_values_across_pieces_of_several_inputs(dtype: str) -> None:
    # Pieces of several input partitions are concatenated before conversion; the
    # index came back as float64 (Int64 with NA: 2**53 + 1 rounded), str or object.
    adapter = PandasAdapter(index=True)
    values = {
        "Int64": [2**53 + 1, None, 3, -4, 5, None, 7, 2**62],
        "string": ["a", None, "c", "d", "é", None, "", "h"],
        "boolean": [True, None, False, True, None, False, True, False],
    }[dtype]
    frame = pd.DataFrame({"key": [0, 1, 2, 3, 0, 1, 2, 3], "v": np.arange(8.0)},
                         index=pd.Index(pd.array(values, dtype=dtype), name="ix"))
    inputs = [frame.iloc[:4], frame.iloc[4:]]
    split = [adapter.split(part, ["key"], 2) for part in inputs]
    meta = frame.iloc[:0]
    for pid in (0, 1):
        got = adapter.unpack([s[pid] for s in split if pid in s], meta)
        expected = pd.concat([part[partition_ids(part[["key"]], 2) == pid] for part in inputs])
        pd.testing.assert_frame_equal(got, expected, check_exact=True, check_index_type=True)
        assert got.index.dtype == frame.index.dtype


def test_an_index_is_rebuilt_from_arrow_only_from_its_own_arrow_type() -> None:
    from mpshuffle.table.pandas import _arrow_type_fits

    # __from_arrow__ of a string dtype turns integers into text; only a column of
    # the meta dtype's own Arrow type is rebuilt that way.
    assert _arrow_type_fits(pa.int64(), pd.Int64Dtype())
    assert _arrow_type_fits(pa.string(), pd.StringDtype()) and _arrow_type_fits(pa.large_string(), pd.StringDtype())
    assert _arrow_type_fits(pa.bool_(), pd.BooleanDtype())
    assert not _arrow_type_fits(pa.int64(), pd.StringDtype())
    assert not _arrow_type_fits(pa.bool_(), pd.ArrowDtype(pa.int64()))
    assert not _arrow_type_fits(pa.int32(), pd.Int64Dtype())


@pytest.mark.parametrize(
    "meta_dtype",
    [np.int64, np.float64, "UInt64", "Int32", "string", pd.ArrowDtype(pa.decimal128(10, 2)), np.int32],
    ids=["int64", "float64", "UInt64", "Int32", "string", "decimal", "int32"],
)
def test_a_kept_index_comes_back_as_sent_whatever_the_meta_says(meta_dtype: Any) -> None:
    # As Dask's task shuffle does. A second round of breaking found an Int64
    # index with NA rounded to float64 under an int64, UInt64 or float64 meta,
    # and values converted toward a meta that was wrong about them.
    adapter = PandasAdapter(index=True)
    index = pd.Index(pd.array([2**60 + 1, None, 3, 2**53 + 1], dtype="Int64"), name="ix")
    frame = pd.DataFrame({"key": [0, 1, 0, 1]}, index=index)
    meta = pd.DataFrame({"key": pd.Series([], dtype=np.int64)}, index=pd.Index(pd.array([], dtype=meta_dtype), name="ix"))
    got = adapter.unpack(list(adapter.split(frame, ["key"], 1).values()), meta)
    assert got.index.dtype == "Int64"
    assert got.index.tolist() == [2**60 + 1, pd.NA, 3, 2**53 + 1]
    # Plain int32 and strings stay as they were sent too, not cast toward the meta.
    for sent in (pd.Index(np.array([7, 9], np.int32), name="ix"), pd.Index(["1", "2"], name="ix")):
        plain = pd.DataFrame({"key": [0, 1]}, index=sent)
        out = adapter.unpack(list(adapter.split(plain, ["key"], 1).values()), meta)
        assert out.index.dtype == sent.dtype and out.index.tolist() == sent.tolist()


def test_unpack_of_gathered_pieces_keeps_the_index_dtypes_and_order() -> None:
    adapter = PandasAdapter(index=True)
    rng = np.random.default_rng(3)
    parts = [
        pd.DataFrame({"key": rng.integers(0, 50, 40), "v": rng.random(40)}, index=np.arange(40) + 100 * k)
        for k in range(6)
    ]
    pieces: dict[int, list[Any]] = {}
    for part in parts:
        for pid, piece in adapter.split(part, ["key"], 7).items():
            pieces.setdefault(pid, []).append(piece)
    meta = parts[0].iloc[:0]
    total = 0
    for pid, got_pieces in pieces.items():
        got = adapter.unpack(got_pieces, meta)
        expected = pd.concat([p[partition_ids(p[["key"]], 7) == pid] for p in parts])
        pd.testing.assert_frame_equal(got, expected, check_exact=True, check_index_type=True)
        total += len(got)
    assert total == 240


def test_reconcile_with_known_dtypes_casts_as_without() -> None:
    frame = pd.DataFrame({"a": np.arange(4, dtype=np.int32), "b": np.arange(4.0)})
    meta = pd.DataFrame({"a": pd.Series([], dtype=np.int64), "b": pd.Series([], dtype=np.float64)})
    got = reconcile(frame, meta, dtypes=[np.dtype(np.int32), np.dtype(np.float64)])
    assert list(got.dtypes) == [np.dtype(np.int64), np.dtype(np.float64)]
    pd.testing.assert_frame_equal(got, reconcile(frame, meta))
    # Columns in another order than the meta's: the given dtypes are not used (they follow the frame's order).
    reordered = frame[["b", "a"]]
    got = reconcile(reordered, meta, dtypes=[np.dtype(np.float64), np.dtype(np.int32)])
    assert list(got.columns) == ["a", "b"] and list(got.dtypes) == [np.dtype(np.int64), np.dtype(np.float64)]
    np.testing.assert_array_equal(got["a"].to_numpy(), np.arange(4))


def test_unpack_casts_the_direct_frame_toward_the_meta() -> None:
    adapter = PandasAdapter()
    rng = np.random.default_rng(5)
    parts = [pd.DataFrame({"key": rng.integers(0, 30, 25).astype(np.int32), "v": rng.random(25)}) for _ in range(4)]
    meta = pd.DataFrame({"key": pd.Series([], dtype=np.int64), "v": pd.Series([], dtype=np.float64)})
    pieces: dict[int, list[Any]] = {}
    for part in parts:
        for pid, piece in adapter.split(part, ["key"], 5).items():
            pieces.setdefault(pid, []).append(piece)
    for pid, got_pieces in pieces.items():
        got = adapter.unpack(got_pieces, meta)
        expected = pd.concat(
            [p[partition_ids(p[["key"]], 5) == pid] for p in parts], ignore_index=True
        ).astype({"key": np.int64})
        pd.testing.assert_frame_equal(got, expected, check_exact=True)


@pytest.mark.parametrize(
    "index",
    [
        pd.Index(np.arange(30, dtype=np.uint8) * 3, name="u8"),
        pd.Index(np.linspace(0, 1, 30), name="f"),
        pd.Index(np.arange(30) % 2 == 0, name="flag", dtype=bool),
        pd.Index([f"r{i}" for i in range(30)], name="s"),
        pd.MultiIndex.from_arrays([np.arange(30, dtype=np.int32), [f"m{i % 4}" for i in range(30)]], names=["a", "b"]),
        # Extension dtypes, with missing values and integers past float64's 2**53.
        pd.Index(pd.array([2**53 + i if i % 5 else None for i in range(30)], dtype="Int64"), name="I64"),
        pd.Index(pd.array([2**53 + i for i in range(30)], dtype="Int64"), name="I64-full"),
        pd.Index(pd.array([i / 4 if i % 3 else None for i in range(30)], dtype="Float64"), name="F64"),
        pd.Index(pd.array([bool(i % 2) if i % 7 else None for i in range(30)], dtype="boolean"), name="b"),
        pd.Index(pd.array([f"s{i}" if i % 4 else None for i in range(30)], dtype="string"), name="ss"),
        pd.Index(pd.array([f"s{i}" for i in range(30)], dtype="string[pyarrow]"), name="sp"),
        pd.Index(pd.array([i if i % 6 else None for i in range(30)], dtype="int32[pyarrow]"), name="ai"),
        pd.Index(pd.date_range("2026-01-01", periods=30, freq="h", tz="Europe/Oslo"), name="t"),
        pd.MultiIndex.from_arrays(
            [pd.array([2**53 + i if i % 5 else None for i in range(30)], dtype="Int64"),
             pd.array([f"m{i % 4}" if i % 3 else None for i in range(30)], dtype="string")], names=["a", "b"]),
    ],
    ids=["uint8", "float64", "bool", "str", "int32-and-str-levels", "Int64-with-NA", "Int64", "Float64", "boolean",
         "string", "string-pyarrow", "arrow-int32", "datetime-tz", "Int64-and-string-levels"],
)
def test_kept_index_levels_of_every_kind_come_back(index: pd.Index) -> None:
    adapter = PandasAdapter(index=True)
    frame = pd.DataFrame({"key": np.arange(30) % 7, "v": np.arange(30.0)}, index=index)
    pieces = adapter.split(frame, ["key"], 4)
    got = pd.concat([adapter.unpack([pieces[pid]], frame.iloc[:0]) for pid in sorted(pieces)])
    ids = partition_ids(frame[["key"]], 4)
    expected = pd.concat([frame[ids == pid] for pid in sorted(pieces)])
    pd.testing.assert_frame_equal(got, expected, check_exact=True, check_index_type=True)


def _arrow_dtype_frame(n: int, seed: int) -> pd.DataFrame:
    # The dtypes dask.dataframe.read_parquet gives a Dask user: decimals, dates
    # and nullable ints as pandas.ArrowDtype; lists and zoned timestamps too.
    import decimal

    rng = np.random.default_rng(seed)
    return pd.DataFrame({
        "k": rng.integers(0, 20, n),
        "d": pd.array([decimal.Decimal(int(v)) / 4 if v % 7 else None for v in rng.integers(0, 10**6, n)],
                      dtype=pd.ArrowDtype(pa.decimal128(15, 2))),
        "d256": pd.array([decimal.Decimal(i) for i in range(n)], dtype=pd.ArrowDtype(pa.decimal256(40, 0))),
        "day": pd.array([datetime.date(2020, 1, 1) + datetime.timedelta(days=i % 400) for i in range(n)],
                        dtype=pd.ArrowDtype(pa.date32())),
        "ni": pd.array([i if i % 3 else None for i in range(n)], dtype="int64[pyarrow]"),
        "lst": pd.array([[i, i] for i in range(n)], dtype=pd.ArrowDtype(pa.list_(pa.int64()))),
        "ts": pd.array(list(range(n)), dtype=pd.ArrowDtype(pa.timestamp("us", tz="Europe/Paris"))),
        "s": pd.array([f"s{i}" for i in range(n)], dtype="str"),
    })


@pytest.mark.parametrize("index", [False, True])
@pytest.mark.parametrize("layout", ["mixed", "arrow-only", "int-labels"])
def test_arrow_dtype_columns_come_back_exact(index: bool, layout: str) -> None:
    # Columns the meta wants as pandas.ArrowDtype come back as that dtype from
    # their own Arrow buffers (decimals were Python objects cast back before).
    frames = [_arrow_dtype_frame(n, seed) for seed, n in enumerate([60, 0, 45])]
    if layout == "arrow-only":
        frames = [f[["d", "day"]].assign(k=pd.array(f["k"], dtype="int64[pyarrow]")) for f in frames]
    if layout == "int-labels":
        frames = [f.rename(columns={"d": 7, "day": 8}) for f in frames]
    if index:
        frames = [f.set_axis(pd.Index(np.arange(len(f)) * 3 + 1000 * i, name="ix")) for i, f in enumerate(frames)]
    adapter = PandasAdapter(index=index)
    meta = frames[0].iloc[:0]
    outputs = shuffle(adapter, frames, ["k"], 5, meta)
    for out in _outputs_as_selected(adapter, frames, outputs, 5, index):
        assert_same_dtypes(out, meta)
        k = list(out.columns).index("k")
        out.iloc[0, k] = -7  # the other columns are a frame as to_pandas gives, set in place
        assert out["k"].iloc[0] == -7


def test_arrow_dtype_columns_need_no_cast(monkeypatch: pytest.MonkeyPatch) -> None:
    # Nothing is converted to Python objects and cast back: reconcile finds
    # every column in the meta's dtype already.
    from mpshuffle.table import _reconcile

    def no_cast(column: pd.Series, dtype: Any) -> pd.Series:
        raise AssertionError(f"column {column.name!r} was cast from {column.dtype} to {dtype}")

    monkeypatch.setattr(_reconcile, "cast_lossless", no_cast)
    frame = _arrow_dtype_frame(80, 3)
    adapter = PandasAdapter()
    outputs = shuffle(adapter, [frame], ["k"], 3, frame.iloc[:0])
    assert sum(len(out) for out in outputs.values()) == 80
