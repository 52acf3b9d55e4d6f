"""The fused hash and the counting-sort scatter against the reference (numpy/pandas) path.

``mpshuffle.table._columns`` hashes key columns in compiled passes and
scatters every column once into per-partition pieces; these tests compare
its ids with the documented per-column hash combined by ``combine_hashes``
and ``ids_from_hashes``, and its pieces with plain row selection, dtype by
dtype.
"""

from __future__ import annotations

import decimal
import itertools
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from mpshuffle.table import ArrowAdapter, PandasAdapter, partition_ids
from mpshuffle.table._canonical import hash_arrow_column, hash_pandas_column
from mpshuffle.table._columns import read_piece
from mpshuffle.table.hashing import combine_hashes, ids_from_hashes

N = 3000
RNG = np.random.default_rng(11)


def _reference_ids(keys: Any, npartitions: int) -> np.ndarray:
    if isinstance(keys, pd.DataFrame):
        hashes = [hash_pandas_column(keys.iloc[:, i]) for i in range(keys.shape[1])]
    else:
        hashes = [hash_arrow_column(c) for c in keys.columns]
    return ids_from_hashes(combine_hashes(hashes), npartitions)


def _with_nulls(values: list[Any]) -> list[Any]:
    return [None if i % 5 == 0 else v for i, v in enumerate(values)]


KEY_COLUMNS = {
    "int8": pd.Series(RNG.integers(-128, 127, N), dtype="int8"),
    "int64": pd.Series(RNG.integers(-(2**62), 2**62, N)),
    "uint64": pd.Series(RNG.integers(0, 2**64 - 1, N, dtype=np.uint64)),
    "uint16": pd.Series(RNG.integers(0, 2**16, N), dtype="uint16"),
    "float64": pd.Series(np.where(RNG.random(N) < 0.1, np.nan, RNG.standard_normal(N))),
    "float64-zeros": pd.Series(RNG.choice([0.0, -0.0, np.nan, 1.5], N)),
    "float32": pd.Series(RNG.standard_normal(N), dtype="float32"),
    "bool": pd.Series(RNG.random(N) < 0.5),
    "Int64": pd.Series(_with_nulls(RNG.integers(0, 50, N).tolist()), dtype="Int64"),
    "Float64": pd.Series(_with_nulls(RNG.random(N).tolist()), dtype="Float64"),
    "boolean": pd.Series(_with_nulls((RNG.random(N) < 0.5).tolist()), dtype="boolean"),
    "datetime": pd.Series(pd.to_datetime(RNG.integers(0, 2**40, N), unit="s").astype("datetime64[us]")),
    "datetime-tz-nat": pd.Series(
        pd.to_datetime(_with_nulls(RNG.integers(0, 2**30, N).tolist()), unit="s", utc=True)
    ),
    "timedelta": pd.Series(pd.to_timedelta(RNG.integers(0, 2**30, N), unit="ms")),
    "str": pd.Series(_with_nulls([f"s{i}" for i in RNG.integers(0, 100, N)]), dtype="str"),
    "category": pd.Series([f"c{i}" for i in RNG.integers(0, 7, N)], dtype="category"),
    "arrow-int32": pd.Series(_with_nulls(RNG.integers(0, 9, N).tolist()), dtype="int32[pyarrow]"),
    "arrow-date": pd.Series(
        pa.array(_with_nulls(RNG.integers(0, 20000, N).tolist()), pa.int32()).cast(pa.date32()),
        dtype=pd.ArrowDtype(pa.date32()),
    ),
}


@pytest.mark.parametrize("name", sorted(KEY_COLUMNS))
@pytest.mark.parametrize("npartitions", [1, 7, 300, 70000])
def test_fused_ids_equal_reference_ids(name: str, npartitions: int) -> None:
    frame = pd.DataFrame({"k": KEY_COLUMNS[name]})
    expected = _reference_ids(frame, npartitions)
    np.testing.assert_array_equal(partition_ids(frame, npartitions), expected)
    # The adapter's split hashes from the columns' buffers: same ids.
    pieces = PandasAdapter().split(frame, ["k"], npartitions)
    assert {p: piece.nrows for p, piece in pieces.items()} == {
        int(p): int(c) for p, c in zip(*np.unique(expected, return_counts=True), strict=True)
    }
    table = pa.Table.from_pandas(frame, preserve_index=False)
    np.testing.assert_array_equal(partition_ids(table, npartitions), expected)


def test_fused_ids_of_several_keys_equal_reference() -> None:
    names = ["int64", "str", "float64-zeros", "Int64", "datetime-tz-nat"]
    frame = pd.DataFrame({n: KEY_COLUMNS[n] for n in names})
    for npartitions in (3, 1000):
        expected = _reference_ids(frame, npartitions)
        np.testing.assert_array_equal(partition_ids(frame, npartitions), expected)
        pieces = PandasAdapter().split(frame, names, npartitions)
        for pid, piece in pieces.items():
            assert piece.nrows == int((expected == pid).sum())


def _frame() -> pd.DataFrame:
    n = 5000
    return pd.DataFrame(
        {
            "key": RNG.integers(0, 1000, n),
            "x": np.where(RNG.random(n) < 0.1, np.nan, RNG.random(n)),
            "s": pd.array([f"v{i}" if i % 7 else None for i in range(n)], dtype="str"),
            "o": pd.Series([f"o{i}" if i % 3 else None for i in range(n)], dtype=object),
            "b": RNG.random(n) < 0.3,
            "nb": pd.array([None if i % 4 == 0 else i % 3 == 0 for i in range(n)], dtype="boolean"),
            "ni": pd.array([None if i % 6 == 0 else i for i in range(n)], dtype="Int32"),
            "c": pd.Categorical([f"c{i % 5}" for i in range(n)]),
            "t": pd.date_range("2020-01-01", periods=n, freq="h", tz="Europe/Paris"),
            "u8": RNG.integers(0, 255, n).astype("uint8"),
            "f32": RNG.random(n).astype("float32"),
            "lst": pd.Series([[i, i + 1] for i in range(n)], dtype=pd.ArrowDtype(pa.list_(pa.int64()))),
        }
    )


@pytest.mark.parametrize("npartitions", [1, 13, 256])
def test_pieces_equal_row_selection(npartitions: int) -> None:
    frame = _frame()
    adapter = PandasAdapter()
    ids = adapter.partition_ids(frame, ["key"], npartitions)
    pieces = adapter.split(frame, ["key"], npartitions)
    assert sorted(pieces) == sorted(set(ids.tolist()))
    meta = frame.iloc[:0]
    for pid, piece in pieces.items():
        expected = frame[ids == pid].reset_index(drop=True)
        assert piece.nrows == len(expected)
        pd.testing.assert_frame_equal(adapter.unpack([piece], meta), expected)
    out = adapter.unpack([pieces[p] for p in sorted(pieces)], meta)
    order = np.argsort(ids, kind="stable")
    pd.testing.assert_frame_equal(out, frame.take(order).reset_index(drop=True))


def test_sliced_arrow_input_and_given_ids() -> None:
    # Arrow arrays with a non-zero offset (a slice) and nulls; ids from the caller.
    table = pa.Table.from_pandas(_frame().drop(columns=["lst"]), preserve_index=False).slice(17, 3000)
    ids = RNG.integers(0, 9, table.num_rows)
    pieces = ArrowAdapter().split(table, ["key"], 9, ids=ids)
    for pid, piece in pieces.items():
        expected = table.filter(pa.array(ids == pid))
        got, _, _ = read_piece(piece)
        assert got.equals(expected.combine_chunks())


def test_pieces_are_slices_of_one_buffer() -> None:
    # One scatter, no serialization copy: every piece is a view of one buffer.
    pieces = PandasAdapter().split(_frame(), ["key"], 8)
    addresses = sorted((p.data.address, p.data.size) for p in pieces.values())
    for (a, size), (b, _) in itertools.pairwise(addresses):
        assert a + size <= b and b - (a + size) < 64


def test_pieces_carry_no_layout_of_their_own() -> None:
    # A one-row piece of two 8-byte columns is their 16 bytes: where each
    # buffer lies follows from the row count and the insert's metadata.
    frame = pd.DataFrame({"key": np.arange(64, dtype=np.int64), "v": np.linspace(0, 1, 64)})
    pieces = PandasAdapter().split(frame, ["key"], 64)
    one_row = [p for p in pieces.values() if p.nrows == 1]
    assert one_row and all(p.data.size == 16 for p in one_row)
    out = PandasAdapter().unpack(list(pieces.values()), frame.iloc[:0])
    assert sorted(out["key"]) == list(range(64))


def _truncated(piece: Any, size: int) -> Any:
    from mpshuffle.memory.packed import PackedData

    # A copy of the first bytes alone, so nothing past them is mapped on purpose.
    return PackedData(piece.metadata, pa.py_buffer(bytes(piece.data)[:size]), piece.nrows)


@pytest.mark.parametrize("cut", ["offsets", "strings", "empty"])
def test_truncated_piece_is_refused_before_reading_past_it(cut: str) -> None:
    from mpshuffle.errors import ShuffleError
    from mpshuffle.table._columns import gather

    frame = pd.DataFrame({
        "key": np.arange(40, dtype=np.int64), "s": pd.array([f"value-{i}" * 3 for i in range(40)], dtype="str"),
    })
    pieces = PandasAdapter().split(frame, ["key"], 2)
    piece = next(iter(pieces.values()))
    full = piece.data.size
    # key data (8 n bytes), then the string offsets, then the strings.
    size = {"offsets": 8 * piece.nrows + 4, "strings": full - 16, "empty": 0}[cut]
    short = _truncated(piece, size)
    with pytest.raises(ShuffleError, match="truncated or corrupt"):
        read_piece(short)
    with pytest.raises(ShuffleError, match="truncated or corrupt"):
        gather([piece, short])


def test_corrupt_last_offset_is_refused() -> None:
    from mpshuffle.errors import ShuffleError
    from mpshuffle.memory.packed import PackedData

    frame = pd.DataFrame({"key": np.arange(8, dtype=np.int64), "s": pd.array(["ab"] * 8, dtype="str")})
    piece = next(iter(PandasAdapter().split(frame, ["key"], 1).values()))
    data = bytearray(bytes(piece.data))
    # The last string offset (after the key's 8 n bytes; int32 or int64 as
    # the column's type) says 2**30 bytes follow.
    width = (len(data) - 8 * piece.nrows - 16 - 8) // (piece.nrows + 1)
    assert width in (4, 8)
    at = 8 * piece.nrows + width * piece.nrows
    data[at : at + width] = (2**30).to_bytes(width, "little")
    with pytest.raises(ShuffleError, match="truncated or corrupt"):
        read_piece(PackedData(piece.metadata, pa.py_buffer(bytes(data)), piece.nrows))


def _chunked(values: list[Any], t: pa.DataType, cuts: list[int]) -> pa.ChunkedArray:
    # Chunks cut at ``cuts``, every other one a slice of a longer array (a non-zero offset).
    bounds = [0, *cuts, len(values)]
    chunks = []
    for i, (a, b) in enumerate(itertools.pairwise(bounds)):
        if i % 2:
            chunks.append(pa.array(["pad", *values[a:b]] if pa.types.is_string(t) or pa.types.is_large_string(t)
                                   else [values[a], *values[a:b]] if b > a else [], type=t).slice(1 if b > a else 0))
        else:
            chunks.append(pa.array(values[a:b], type=t))
    return pa.chunked_array(chunks, type=t)


def _chunked_table(n: int) -> pa.Table:
    # Columns in chunks as a parquet reader gives them, an empty chunk among them, nulls in some.
    cuts = [0, n // 5, n // 5, n // 2, n - 3]
    strings = [f"s{i}" * (i % 4) if i % 9 else None for i in range(n)]
    return pa.table({
        "key": _chunked(list(RNG.integers(-50, 50, n)), pa.int64(), cuts),
        "s": _chunked(strings, pa.string(), cuts),
        "ls": _chunked(strings, pa.large_string(), cuts),
        "bin": _chunked([s.encode() if s is not None else None for s in strings], pa.binary(), cuts),
        "i32": _chunked([i if i % 5 else None for i in range(n)], pa.int32(), cuts),
        "d": _chunked([i % 400 for i in range(n)], pa.date32(), cuts),
        "f": _chunked(list(RNG.random(n)), pa.float64(), cuts),
        "dec": _chunked([decimal.Decimal(int(v)) / 100 if v % 11 else None for v in RNG.integers(-10**9, 10**9, n)],
                        pa.decimal128(18, 2), cuts),
        "dec256": _chunked([decimal.Decimal(int(v)) for v in RNG.integers(-10**9, 10**9, n)], pa.decimal256(50, 0),
                           cuts),
        "flag": _chunked([i % 3 == 0 for i in range(n)], pa.bool_(), cuts),
    })


@pytest.mark.parametrize("npartitions", [1, 7, 300])
def test_chunked_arrow_columns_scatter_as_combined(npartitions: int) -> None:
    # Columns in several chunks are scattered chunk by chunk (no combine_chunks
    # first): the pieces hold exactly the rows of the combined columns.
    table = _chunked_table(2000)
    assert all(table.column(name).num_chunks == 6 for name in table.column_names)
    combined = table.combine_chunks()
    adapter = ArrowAdapter()
    ids = adapter.partition_ids(table, ["key"], npartitions)
    np.testing.assert_array_equal(ids, adapter.partition_ids(combined, ["key"], npartitions))
    pieces = adapter.split(table, ["key"], npartitions)
    assert sorted(pieces) == sorted(set(ids.tolist()))
    for pid, piece in pieces.items():
        got, _, _ = read_piece(piece)
        assert got.equals(combined.filter(pa.array(ids == pid)))


def test_chunked_pandas_string_columns_scatter_as_combined() -> None:
    # pandas frames from parquet hold their str columns as Arrow arrays in chunks.
    table = _chunked_table(1500).drop_columns(["bin", "flag", "ls"])
    frame = table.to_pandas()
    assert frame["s"].array._pa_array.num_chunks > 1
    flat = table.combine_chunks().to_pandas()
    adapter = PandasAdapter()
    ids = adapter.partition_ids(frame, ["key"], 11)
    np.testing.assert_array_equal(ids, adapter.partition_ids(flat, ["key"], 11))
    pieces = adapter.split(frame, ["key", "s"], 11)
    keys = adapter.partition_ids(frame, ["key", "s"], 11)
    for pid, piece in pieces.items():
        pd.testing.assert_frame_equal(adapter.unpack([piece], frame.iloc[:0]),
                                      flat[keys == pid].reset_index(drop=True))


def test_chunked_strings_past_32_bit_offsets_are_refused_by_name() -> None:
    # Two chunks of 1.1 GiB of binary values each: every chunk fits its own
    # 32-bit offsets, one piece of both would not. The insert says so (it
    # wrapped the offsets silently before the check). The values are
    # untouched zero pages, so the test costs little memory.
    rows, size = 1100, 2**20
    data = pa.py_buffer(np.zeros(rows * size, np.uint8))
    offsets = pa.py_buffer((np.arange(rows + 1, dtype=np.int64) * size).astype(np.int32))
    chunk = pa.Array.from_buffers(pa.binary(), rows, [None, offsets, data])
    table = pa.table({"k": np.zeros(2 * rows, np.int64), "blob": pa.chunked_array([chunk, chunk])})
    with pytest.raises(ValueError, match="column 'blob'.*32-bit offsets"):
        ArrowAdapter().split(table, ["k"], 1)
    # Rows of both chunks whose pieces fit still split.
    ids = np.arange(2 * rows) % 4
    pieces = ArrowAdapter().split(table.slice(rows - 40, 80), ["k"], 4, ids=ids[:80])
    assert sum(p.nrows for p in pieces.values()) == 80


def test_chunked_number_keys_hash_as_combined() -> None:
    # Key columns of numbers, dates and times in chunks are joined for the
    # fused hash (only keys pay that copy): the same ids as combined.
    table = _chunked_table(3000)
    for keys in (["key"], ["d"], ["f"], ["i32", "d"], ["s", "key"]):
        np.testing.assert_array_equal(
            ArrowAdapter().partition_ids(table, keys, 13), ArrowAdapter().partition_ids(table.combine_chunks(), keys, 13)
        )


def test_many_small_chunks_are_combined_first() -> None:
    from mpshuffle.table._columns import CHUNK_MIN_ROWS, CHUNKS_ALWAYS, _arrow_column

    small = pa.chunked_array([pa.array([f"v{i}"]) for i in range(CHUNKS_ALWAYS + 1)])
    assert _arrow_column(small, 0).chunks is None
    big = pa.chunked_array([pa.array(["v"] * CHUNK_MIN_ROWS)] * (CHUNKS_ALWAYS + 1))
    assert _arrow_column(big, 0).chunks is not None
    table = pa.table({"k": np.arange(CHUNKS_ALWAYS + 1), "s": small})
    pieces = ArrowAdapter().split(table, ["k"], 3)
    got = pa.concat_tables([read_piece(pieces[p])[0] for p in sorted(pieces)])
    assert sorted(got.column("s").to_pylist()) == sorted(small.to_pylist())
