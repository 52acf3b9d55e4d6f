"""Columns as raw buffers: hash them, scatter them into pieces, read pieces back.

The insert of a frame with ``n`` rows into ``P`` partitions is:

1. **to buffers** (:func:`pandas_columns`, :func:`arrow_columns`): each column
   becomes a :class:`Column` that points at the frame's own memory — numpy
   values of numeric columns as they are (no NaN scan), the Arrow buffers of
   Arrow-backed ones (``str``, nullable, tz-aware, ...). A column whose type
   has no raw layout here (dictionary, nested, ...) stays an Arrow
   array and travels as an Arrow IPC stream; an ``object`` column Arrow
   cannot hold losslessly travels pickled. Each column falls back alone.
2. **hash** (:func:`hash_ids`): one pass per key column computes the
   documented hash (:mod:`mpshuffle.table.hashing`), and the last one also
   gives every row its partition, its rank within the partition and the
   partition's row count (a stable counting sort).
3. **scatter** (:func:`pack`): every column is written once, straight into
   one buffer in which each partition's piece is one contiguous byte range,
   laid out as Arrow buffers (validity bitmap, offsets, data). The pieces are
   zero-copy slices of that buffer: there is no serialization copy.

A piece's metadata is the schema, the column layout and the alignment,
one ``bytes`` object shared by all pieces of one insert (sent once per
chunk). A piece's data is its buffers alone (led only by the sizes of
IPC or pickled columns, when it has some): where each buffer lies follows
from the piece's row count, the metadata and, for string data, the
piece's own last offset (:func:`_layouts`), so a piece of one row costs
its bytes, not a word pair per buffer. :func:`read_piece` rebuilds a zero-copy
``pyarrow.Table`` from a piece (and unpickles pickled columns);
:func:`gather` concatenates many pieces column by column in one compiled
pass per buffer, without a table per piece.
"""

from __future__ import annotations

import ctypes
import json
import pickle
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import pyarrow as pa

from mpshuffle.errors import ShuffleError
from mpshuffle.memory._pages import aligned_empty, output_empty
from mpshuffle.memory.packed import PackedData, PackedPieces, PieceTable
from mpshuffle.table._canonical import hash_arrow_column, hash_pandas_column
from mpshuffle.table._kernels import COMBINE, COMBINE_FINAL, FIRST, FIRST_FINAL, kernels
from mpshuffle.table.hashing import PandasRowHash, owned_partitions, partition_owners

if TYPE_CHECKING:
    import numpy.typing as npt

    from mpshuffle.memory.pool import HostPool

__all__ = [
    "COLS",
    "Column",
    "Split",
    "arrow_columns",
    "gather",
    "hash_ids",
    "is_cols",
    "key_columns",
    "owner_groups",
    "pack",
    "pandas_columns",
    "pandas_row_split",
    "rank_ids",
    "read_piece",
]

#: First bytes of the metadata of a piece in this format.
COLS = b"MPSC\x02"
_U32 = struct.Struct("<I")
_ALIGN = 64
_WORD = 8
#: Average bytes per piece below which buffers inside pieces are 8-byte, not 64-byte, aligned.
_SMALL_PIECE = 4096
_NS_PER_UNIT = {"s": 1_000_000_000, "ms": 1_000_000, "us": 1_000, "ns": 1}
_NS_PER_DAY = 86_400 * 1_000_000_000
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_COMPILE_LOCK = threading.Lock()
#: Set on the thread of :func:`mpshuffle.table.warm.warm_up` while it runs.
WARMING = threading.local()
#: Set once an insert other than the warm-up's asked for the kernels in this process.
INSERTING = threading.Event()


def _kernels() -> Any:
    if not getattr(WARMING, "on", False):
        INSERTING.set()
    # Two task threads may ask first at once; compile (or load) once.
    with _COMPILE_LOCK:
        return kernels()


@dataclass
class Column:
    """One column of a frame, as buffers.

    Attributes
    ----------
    kind
        ``"fixed"`` (``values``: one element of ``width`` bytes per row;
        for 16- and 32-byte decimals ``width / 8`` ``uint64`` words per row),
        ``"bits"`` (booleans: ``values`` one byte per row when
        ``from_bytes``, else an Arrow bitmap starting at bit ``offset``),
        ``"var"`` (strings/binary: ``offsets`` of shape ``(n + 1,)`` into the
        bytes ``values``), ``"arrow"`` (no raw layout: ``array`` travels as
        IPC) or ``"pickle"`` (``series`` travels pickled).
    validity
        Arrow validity bitmap (uint8) when the column has nulls, else ``None``;
        bit ``offset`` is row 0.
    hashable
        How the fused hash reads the column: ``"int"`` (``values`` integers,
        times ``factor`` ns per unit), ``"float"`` (``values`` float64),
        or ``""`` (hashed by the documented slower path from ``source``).
    chunks, chunk_starts
        For an Arrow column in several chunks (``"fixed"`` or ``"var"``):
        one :class:`Column` per chunk, each over that chunk's own buffers,
        and the row at which each chunk starts, shape ``(len(chunks) + 1,)``
        (the last entry is the row count); ``values`` and ``offsets`` are
        then ``None``, and ``validity`` covers all rows from bit 0. ``None``
        for a column in one buffer.
    """

    kind: str
    field: int = -1
    values: Any = None
    offsets: Any = None
    validity: Any = None
    offset: int = 0
    width: int = 0
    from_bytes: bool = False
    array: Any = None
    series: Any = None
    hashable: str = ""
    factor: int = 1
    source: Any = None
    typed: Any = None
    chunks: list[Column] | None = None
    chunk_starts: Any = None


def _arrow_column(array: pa.Array | pa.ChunkedArray, field: int) -> Column:
    """Point a :class:`Column` at an Arrow array's buffers (zero copy), chunk by chunk where it has several."""
    if isinstance(array, pa.ChunkedArray):
        if array.num_chunks > 1:
            chunked = _chunked_column(array, field)
            if chunked is not None:
                return chunked
        array = array.chunk(0) if array.num_chunks == 1 else array.combine_chunks()
    t = array.type
    n, off = len(array), array.offset
    bufs = array.buffers()
    validity = None
    if array.null_count and bufs[0] is not None:
        validity = np.frombuffer(bufs[0], dtype=np.uint8)
    col = Column("arrow", field, array=array, validity=validity, offset=off, source=array)
    if pa.types.is_boolean(t):
        col.kind, col.values = "bits", np.frombuffer(bufs[1], dtype=np.uint8)
        return col
    fixed = (
        pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_temporal(t)
    ) and not pa.types.is_float16(t)
    if fixed and t.bit_width // 8 in _UINT:
        width = t.bit_width // 8
        col.kind, col.width = "fixed", width
        col.values = np.frombuffer(bufs[1], dtype=_UINT[width])[off : off + n] if n else np.empty(0, _UINT[width])
        if pa.types.is_integer(t):
            col.hashable = "int"
            col.typed = col.values.view(t.to_pandas_dtype())
        elif pa.types.is_floating(t):
            col.hashable = "float"
        elif pa.types.is_temporal(t):
            factor = _temporal_factor(t)
            if factor is not None:
                col.hashable, col.factor = "int", factor
                col.typed = col.values.view({4: np.int32, 8: np.int64}[width])
        return col
    if pa.types.is_decimal128(t) or pa.types.is_decimal256(t):
        # Words of 8 bytes per value (scatter_words); hashed from ``source``.
        width = t.bit_width // 8
        words = width // 8
        col.kind, col.width = "fixed", width
        col.values = np.frombuffer(bufs[1], dtype=np.uint64)[off * words : (off + n) * words] if n else np.empty(
            0, np.uint64)
        return col
    if pa.types.is_string(t) or pa.types.is_binary(t) or pa.types.is_large_string(t) or pa.types.is_large_binary(t):
        large = pa.types.is_large_string(t) or pa.types.is_large_binary(t)
        odt = np.int64 if large else np.int32
        col.kind, col.width = "var", 8 if large else 4
        col.offsets = np.frombuffer(bufs[1], dtype=odt)[off : off + n + 1] if bufs[1] is not None else np.zeros(n + 1, odt)
        col.values = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
        return col
    return col


#: An Arrow column in at most this many chunks is read chunk by chunk whatever their size (:func:`_chunked_column`).
CHUNKS_ALWAYS = 16
#: Beyond :data:`CHUNKS_ALWAYS` chunks, they are read one by one only where they average this many rows.
CHUNK_MIN_ROWS = 8192


def _joined(col: Column) -> Column:
    """A column in chunks of numbers, dates or times as one buffer (for :func:`hash_ids`'s fused passes)."""
    assert col.chunks is not None
    first = col.chunks[0]
    values = np.concatenate([c.values for c in col.chunks])
    joined = Column(col.kind, col.field, values=values, validity=col.validity, width=col.width,
                    hashable=first.hashable, factor=first.factor, source=col.source)
    if first.typed is not None:
        joined.typed = values.view(first.typed.dtype)
    return joined


def _chunked_column(array: pa.ChunkedArray, field: int) -> Column | None:
    """A :class:`Column` over the chunks of a fixed-width or string/binary ``array`` in place; ``None`` for other types.

    Such a column's chunks are scattered one after the other (:func:`pack`),
    so no copy of the whole column is made first. Parquet readers give every
    column in chunks (one per row group): ``combine_chunks`` copied each string
    column of TPC-H lineitem, 10-15 % of a 2-worker shuffle's time on the
    2-core development machine (``benchmarks/results/README.md``, session 27).
    Booleans and other types are combined (bitmaps are small; the others
    travel as Arrow IPC), and so is a column of many small chunks (more than
    :data:`CHUNKS_ALWAYS` of under :data:`CHUNK_MIN_ROWS` rows on average,
    e.g. from record batches of a stream): each chunk costs a few calls per
    column, and 100,000 chunks of one row took 6.6 s to insert against
    0.65 s combined. Only the validity bitmap is built anew, ``n / 8``
    bytes, from bit 0. Such a column is hashed by :func:`hash_ids` from its
    chunks' values joined (numbers, dates and times: only key columns pay
    that copy) or from ``source`` (strings, the documented slower path).
    """
    if array.num_chunks > CHUNKS_ALWAYS and len(array) < array.num_chunks * CHUNK_MIN_ROWS:
        return None
    chunks = [_arrow_column(chunk, field) for chunk in array.chunks]
    kind = chunks[0].kind
    if kind not in ("fixed", "var"):
        return None
    starts = np.zeros(len(chunks) + 1, np.int64)
    np.cumsum([len(chunk) for chunk in array.chunks], out=starts[1:])
    validity = None
    if array.null_count:
        valid = [
            np.ones(len(chunk), np.uint8) if col.validity is None
            else np.unpackbits(col.validity, bitorder="little", count=col.offset + len(chunk))[col.offset :]
            for col, chunk in zip(chunks, array.chunks, strict=True)
        ]
        validity = np.packbits(np.concatenate(valid), bitorder="little")
    return Column(kind, field, validity=validity, width=chunks[0].width, array=array, source=array,
                  chunks=chunks, chunk_starts=starts)


def _temporal_factor(t: pa.DataType) -> int | None:
    if pa.types.is_date32(t):
        return _NS_PER_DAY
    if pa.types.is_date64(t):
        return _NS_PER_UNIT["ms"]
    unit = getattr(t, "unit", None)
    return _NS_PER_UNIT.get(unit) if unit is not None else None


def pandas_columns(
    frame: pd.DataFrame, index: bool, schema: pa.Schema, items: Sequence[tuple[Any, pd.Series]] | None = None
) -> list[Column]:
    """Buffers of a frame's columns (and index levels when ``index``), in ``schema`` order.

    ``schema`` is ``pyarrow.Schema.from_pandas`` of the frame without its
    pickled columns; those come last, as ``"pickle"`` columns naming their
    position in the frame in ``field``. ``items``: ``list(frame.items())``
    where the caller has it already.
    """
    # ``items`` once: ``iloc[:, j]`` per column costs ~60 us on a fresh frame.
    by_name = {str(name): series for name, series in (frame.items() if items is None else items)}
    index_fields = _index_fields(schema) if index else []
    out = []
    for k, field in enumerate(schema):
        if field.name in by_name and field.name not in index_fields:
            series = by_name[field.name]
        else:
            level = index_fields.index(field.name)
            values = frame.index.get_level_values(level)
            dtype = values.dtype
            # A numeric level is read as its numpy values (dtype, to_numpy), as
            # from a Series of it; building that Series cost ~30 us an insert.
            numeric = isinstance(dtype, np.dtype) and dtype.kind in "iufb"
            series = values if numeric else pd.Series(values)
        col = _pandas_column(series, field.type, k)
        out.append(col)
    return out


def per_schema(cache: dict[int, tuple[pa.Schema, Any]], schema: pa.Schema, make: Callable[[pa.Schema], Any]) -> Any:
    """``make(schema)``, remembered in ``cache`` by the schema object.

    Keyed by ``id(schema)``, the object kept beside its value so that the id
    is not reused while the entry lives; at 256 entries the cache starts
    over. For what every insert or extract would otherwise derive again from
    one schema object (``Schema.pandas_metadata`` parses its JSON at every
    access).
    """
    hit = cache.get(id(schema))
    if hit is not None and hit[0] is schema:
        return hit[1]
    value = make(schema)
    if len(cache) >= 256:
        cache.clear()
    cache[id(schema)] = (schema, value)
    return value


_INDEX_FIELDS: dict[int, tuple[pa.Schema, list[str]]] = {}


def _index_fields(schema: pa.Schema) -> list[str]:
    return per_schema(_INDEX_FIELDS, schema, _read_index_fields)  # type: ignore[no-any-return]


def _read_index_fields(schema: pa.Schema) -> list[str]:
    meta = schema.pandas_metadata or {}
    return [c for c in meta.get("index_columns", []) if isinstance(c, str)]


def _pandas_column(series: pd.Series, t: pa.DataType, field: int) -> Column:
    dtype = series.dtype
    if isinstance(dtype, np.dtype) and dtype.kind in "iuf" and dtype.itemsize in _UINT:
        values = np.ascontiguousarray(series.to_numpy(copy=False))
        if pa.from_numpy_dtype(dtype) == t:
            col = Column("fixed", field, values=values.view(_UINT[dtype.itemsize]), width=dtype.itemsize,
                         source=series)
            col.hashable = "int" if dtype.kind in "iu" else ("float" if dtype.itemsize == 8 else "")
            col.typed = values
            return col
    if isinstance(dtype, np.dtype) and dtype.kind == "b" and pa.types.is_boolean(t):
        values = np.ascontiguousarray(series.to_numpy(copy=False))
        col = Column("bits", field, values=values.view(np.uint8), from_bytes=True, source=series,
                     hashable="int")
        col.typed = values
        return col
    array = getattr(series.array, "_pa_array", None)
    if array is None or array.type != t:
        array = pa.array(series, type=t, from_pandas=True)
    col = _arrow_column(array, field)
    col.source = series
    return col


def key_columns(keys: pd.DataFrame) -> list[Column]:
    """Key columns of a pandas frame for :func:`hash_ids`, without converting any.

    numpy integer, float64 and boolean columns are read in place; every other
    column is hashed by :func:`~mpshuffle.table._canonical.hash_pandas_column`.
    """
    out = []
    for i in range(keys.shape[1]):
        series = keys.iloc[:, i]
        dtype = series.dtype
        col = Column("arrow", i, source=series)
        if isinstance(dtype, np.dtype) and (
            dtype.kind in "iub" or (dtype.kind == "f" and dtype.itemsize == 8)
        ):
            values = np.ascontiguousarray(series.to_numpy(copy=False))
            col.hashable = "float" if dtype.kind == "f" else "int"
            col.values = values.view(np.uint64) if dtype.kind == "f" else values
            col.typed = values
        out.append(col)
    return out


def arrow_columns(table: pa.Table) -> list[Column]:
    """Buffers of a table's columns, in order."""
    return [_arrow_column(table.column(k), k) for k in range(table.num_columns)]


def _null_bytes(col: Column, n: int) -> npt.NDArray[np.uint8]:
    if col.validity is None:
        return np.empty(0, np.uint8)
    valid = np.unpackbits(col.validity, bitorder="little", count=col.offset + n)[col.offset :]
    return (1 - valid).astype(np.uint8)


def _pick_dtype(npartitions: int, nrows: int) -> tuple[Any, Any]:
    pid = np.uint8 if npartitions <= 2**8 else np.uint16 if npartitions <= 2**16 else np.int64
    rank = np.uint32 if nrows < 2**32 else np.int64
    return pid, rank


@dataclass
class Split:
    """Rows grouped by partition: ``pid[i]``, ``rank[i]`` (within its partition), ``counts[p]``."""

    pid: Any
    rank: Any
    counts: Any


#: Per-row scratch arrays below this many bytes come from NumPy, larger ones from the pool (:func:`scratch_empty`).
SCRATCH_POOL_MIN = 64 * 1024


def scratch_empty(pool: HostPool | None) -> Callable[[int, Any], npt.NDArray[Any]]:
    """``empty(n, dtype)`` for an insert's per-row arrays (partition ids, ranks, hashes): from ``pool`` where given.

    These arrays live only while the insert runs (an insert of 800,000 rows
    makes ~4 MB of them), so from a pool they are the same few blocks insert
    after insert instead of fresh pages each time (on the 2-core development
    machine 59,000 page faults per shuffle of 2 GB, ``benchmarks/results/README.md``,
    session 18). Without a pool, or below :data:`SCRATCH_POOL_MIN` bytes, NumPy's.
    """
    if pool is None:
        return np.empty

    def empty(n: int, dtype: Any) -> npt.NDArray[Any]:
        dt = np.dtype(dtype)
        if n * dt.itemsize < SCRATCH_POOL_MIN:
            return np.empty(n, dt)
        return pool.array(n * dt.itemsize).view(dt)

    return empty


def hash_ids(
    keys: Sequence[Column], npartitions: int, nrows: int, names: Sequence[Any] | None = None,
    *, empty: Callable[[int, Any], npt.NDArray[Any]] = np.empty,
) -> Split:
    """Hash the key columns into partition ids, ranks and counts (see the module docstring).

    Columns that the kernels read directly (integers, floats, dates and
    times, numpy booleans) are hashed in the fused pass; any other key column
    is hashed by :func:`~mpshuffle.table._canonical.hash_pandas_column` /
    ``hash_arrow_column`` and combined in the same passes, so the ids are
    exactly those of :func:`mpshuffle.table.hashing.partition_ids`.

    ``empty(n, dtype)`` makes the per-row arrays (:func:`scratch_empty`).

    Raises
    ------
    TypeError
        If a key column holds values that cannot be hashed; names the column
        (from ``names``, the key names in order).
    """
    k = _kernels()
    pdt, rdt = _pick_dtype(npartitions, nrows)
    pid = empty(nrows, pdt)
    rank = empty(nrows, rdt)
    counts = np.zeros(npartitions, np.int64)
    acc = empty(nrows if len(keys) > 1 else 0, np.uint64)
    npart = np.uint64(npartitions)
    last = len(keys) - 1
    for j, col in enumerate(keys):
        if col.chunks is not None and col.chunks[0].hashable:
            col = _joined(col)
        mode = (FIRST_FINAL if j == 0 else COMBINE_FINAL) if j == last else (FIRST if j == 0 else COMBINE)
        null = _null_bytes(col, nrows)
        typed = col.typed
        if col.hashable == "int" and typed is not None:
            k.hash_ints(typed, null, np.int64(col.factor), mode, acc, npart, pid, rank, counts)
        elif col.hashable == "float" and col.values.dtype == np.uint64:
            k.hash_float_bits(col.values, null, mode, acc, npart, pid, rank, counts)
        else:
            src = col.source
            try:
                hashes = hash_pandas_column(src) if isinstance(src, pd.Series) else hash_arrow_column(src)
            except (TypeError, pa.ArrowNotImplementedError) as e:
                name = names[j] if names is not None else j
                raise TypeError(
                    f"key column {name!r} of dtype {getattr(src, 'dtype', None) or src.type} cannot "
                    f"be hashed ({e}); shuffle on columns of scalar values (numbers, strings, "
                    "dates, booleans, categoricals)"
                ) from e
            k.hash_given(np.ascontiguousarray(hashes, dtype=np.uint64), mode, acc, npart, pid, rank, counts)
    return Split(pid, rank, counts)


# pandas.core.util.hashing.combine_hash_arrays' multiplier: its start and step.
_PD_MULT = 1000003
_PD_MULT_STEP = 82520


def pandas_row_split(
    keys: PandasRowHash, npartitions: int, *, empty: Callable[[int, Any], npt.NDArray[Any]] = np.empty
) -> Split:
    """Partition ids, ranks and counts by pandas' row hash (:class:`~mpshuffle.table.hashing.PandasRowHash`).

    One pass per key column, the last one also ranking and counting, as
    :func:`hash_ids` does for mpshuffle's own hash; ``empty`` as there.
    """
    k = _kernels()
    nrows = keys.nrows
    pdt, rdt = _pick_dtype(npartitions, nrows)
    pid = empty(nrows, pdt)
    rank = empty(nrows, rdt)
    counts = np.zeros(npartitions, np.int64)
    ncols = len(keys.columns)
    acc = empty(nrows if ncols > 1 else 0, np.uint64)
    npart = np.uint64(npartitions)
    mult = _PD_MULT
    for j, (values, given) in enumerate(zip(keys.columns, keys.given, strict=True)):
        values = np.ascontiguousarray(values)
        args = (np.uint64(mult), j == 0, j == ncols - 1, acc, npart, pid, rank, counts)
        if given:
            k.pandas_given(values, *args)
        else:
            k.pandas_values(values, *args)
        mult = (mult + _PD_MULT_STEP + 2 * (ncols - j)) % 2**64
    return Split(pid, rank, counts)


def rank_ids(
    ids: npt.NDArray[Any], npartitions: int, *, empty: Callable[[int, Any], npt.NDArray[Any]] = np.empty
) -> Split:
    """Rank and count caller-given partition ids (already checked to be in range); ``empty`` as in :func:`hash_ids`."""
    pdt, rdt = _pick_dtype(npartitions, len(ids))
    pid = empty(len(ids), pdt)
    rank = empty(len(ids), rdt)
    counts = np.zeros(npartitions, np.int64)
    _kernels().rank_ids(np.ascontiguousarray(ids), pid, rank, counts)
    return Split(pid, rank, counts)


def _aligned(sizes: npt.NDArray[np.int64], align: int = _ALIGN) -> npt.NDArray[np.int64]:
    return (sizes + (align - 1)) & ~(align - 1)


def pack(
    columns: Sequence[Column],
    split: Split,
    schema: pa.Schema | None,
    names: Sequence[Any] | None = None,
    *,
    pool: HostPool | None = None,
    groups: npt.NDArray[Any] | None = None,
    owner: tuple[int, int] | None = None,
) -> PackedPieces:
    """Scatter every column once; return one zero-copy piece per non-empty partition.

    Parameters
    ----------
    columns
        From :func:`pandas_columns` or :func:`arrow_columns`.
    split
        From :func:`hash_ids` or :func:`rank_ids`.
    schema
        Arrow schema of the non-pickled columns (with pandas' metadata for a
        pandas frame); travels in every piece's metadata.
    names
        Original column names when some are not strings (see
        :class:`~mpshuffle.table._ipc.Header`), else ``None``.
    pool
        Where the pieces' memory comes from; fresh memory without one.
    groups
        Group of each partition (small integers, shape ``(npartitions,)``):
        the pieces of each group share one range of memory, freed when the
        last of them is gone (e.g. pieces kept on this rank apart from pieces
        sent away). One group without it or ``owner``.
    owner
        ``(rank, nranks)``: group the pieces by :func:`owner_groups` (the
        pieces this rank keeps apart from those sent, each destination's
        contiguous); replaces ``groups``.

    Returns
    -------
    PackedPieces
        ``{partition_id: PackedData}`` as arrays (no object per piece until
        one is looked up): every piece's data is a byte range of its group's
        buffer, and every piece has the same metadata (the schema and column
        layout, see the module docstring).
    """
    k = _kernels()
    present = np.flatnonzero(split.counts)
    npart = len(split.counts)
    # From here on only the partitions with rows count (``present``): every
    # per-partition array has one entry per piece, and the kernels take each
    # row's place among them (``pid``, same dtype as the split's ids). An
    # insert into many more partitions than it has rows then costs its rows,
    # not the partition count (at 50,000 partitions of 500-row inputs the
    # per-partition arrays made an insert cost 4.7 ms against 0.5 ms at 500).
    counts = split.counts[present]
    if len(present) < npart:
        slot = np.zeros(npart, split.pid.dtype)
        slot[present] = np.arange(len(present), dtype=split.pid.dtype)
        pid = slot[split.pid]
    else:
        pid = split.pid
    ncompact = len(present)
    # Every buffer of every piece: (column, role) and its size per partition.
    plan: list[tuple[int, str, npt.NDArray[np.int64]]] = []
    slack: dict[int, int] = {}  # bytes a buffer needs past its data (scatter_var's word copies)
    var_sizes: dict[int, npt.NDArray[np.int64]] = {}
    arrow_cols = [c for c in columns if c.kind == "arrow"]
    pickled = [c for c in columns if c.kind == "pickle"]
    order = None
    if arrow_cols or pickled:
        order = np.argsort(pid, kind="stable")
        starts = np.concatenate(([0], np.cumsum(counts)))
    for j, col in enumerate(columns):
        if col.kind in ("arrow", "pickle"):
            continue
        if col.validity is not None:
            plan.append((j, "validity", (counts + 7) >> 3))
        if col.kind == "fixed":
            plan.append((j, "data", counts * col.width))
        elif col.kind == "bits":
            plan.append((j, "data", (counts + 7) >> 3))
        else:
            plan.append((j, "offsets", (counts + 1) * col.width))
            var_sizes[j] = sum(
                (k.var_sizes(part.offsets, pid[a:b], ncompact) for part, a, b in _chunks_of(col, len(pid))),
                np.zeros(ncompact, np.int64),
            )
            if col.width == 4 and col.chunks is not None and ncompact and int(var_sizes[j].max()) >= 2**31:
                # One chunk's pieces fit its own 32-bit offsets; several chunks' need not.
                name = schema.field(col.field).name if schema is not None else col.field
                raise ValueError(
                    f"column {name!r}: {int(var_sizes[j].max())} bytes of its values would go into one partition's "
                    "piece of this input partition, more than 32-bit offsets reach (2**31 - 1); cast the column to "
                    "large_string / large_binary, or shuffle into more output partitions"
                )
            plan.append((j, "data", var_sizes[j]))
            slack[len(plan) - 1] = _WORD
    blobs: dict[str, list[Any]] = {}
    if arrow_cols:
        sub = pa.Table.from_arrays([c.array for c in arrow_cols], names=[str(c.field) for c in arrow_cols])
        sub = sub.take(order)
        streams = [sub.slice(int(starts[p]), int(counts[p])) for p in range(ncompact)]
        plan.append((-1, "ipc", np.array([_ipc_size(s) for s in streams], np.int64)))
        blobs["ipc"] = streams
    for col in pickled:
        values = col.series.take(order).reset_index(drop=True)
        dumps = [
            pickle.dumps(values.iloc[int(starts[p]) : int(starts[p] + counts[p])], protocol=5)
            for p in range(ncompact)
        ]
        blobs[f"pickle{col.field}"] = dumps
        plan.append((col.field, "pickle", np.array([len(d) for d in dumps], np.int64)))
    sizes_all = np.stack([s.astype(np.int64) for _, _, s in plan]) if plan else np.zeros((0, ncompact), np.int64)
    # Buffers start 64-byte aligned in pieces of a few KiB or more; small
    # pieces (many partitions, few rows each) keep 8 (what Arrow and NumPy
    # need), so padding does not outweigh their data.
    align = _ALIGN if ncompact and int(sizes_all.sum()) >= _SMALL_PIECE * ncompact else _WORD
    aligned = _aligned(sizes_all + np.array([slack.get(b, 0) for b in range(len(plan))], np.int64)[:, None], align)
    # A piece's layout is not stored in it: its row count and the plan give
    # every buffer's size (string data: its own last offset), and
    # :func:`_layouts` derives where each lies by the same rule. Only what no
    # row count gives, the size of an IPC stream or a pickle, leads the piece
    # (one ``<i8`` word each).
    opaque = [b for b, (_, role, _) in enumerate(plan) if role in ("ipc", "pickle")]
    prefix = -(-8 * len(opaque) // align) * align
    within = prefix + np.cumsum(aligned, axis=0) - aligned  # offset of each buffer inside its piece
    piece_size = prefix + aligned.sum(axis=0)
    if owner is not None:
        group = owner_groups(piece_size, *owner, partition_ids=present)
    elif groups is not None:
        group = np.asarray(groups, np.int64)[present]
    else:
        group = np.zeros(ncompact, np.int64)
    ngroups = int(group.max()) + 1 if ncompact else 1
    group_size = np.bincount(group, weights=piece_size, minlength=ngroups).astype(np.int64)
    buf, group_offsets, group_buffers = _allocate(group_size.tolist(), pool)
    # Pieces of a group follow each other, by partition id, from the group's offset.
    by_group = np.argsort(group, kind="stable")
    ends = np.cumsum(piece_size[by_group])
    starts_in_group = ends - piece_size[by_group] - np.concatenate(
        ([0], np.cumsum(group_size)))[group[by_group]]
    piece_base = np.empty(ncompact, np.int64)
    piece_base[by_group] = np.asarray(group_offsets, np.int64)[group[by_group]] + starts_in_group
    at = piece_base[None, :] + within  # absolute byte offset of each buffer
    for b, (j, role, _) in enumerate(plan):
        if j < 0 or role == "pickle":
            continue
        col = columns[j]
        if role == "validity":
            k.scatter_bits(col.validity, col.offset, False, pid, split.rank, at[b], counts, buf)
        elif role == "data" and col.kind == "fixed" and col.width > 8:
            out = buf.view(np.uint64)
            for part, lo, hi in _chunks_of(col, len(pid)):
                k.scatter_words(part.values, col.width // 8, pid[lo:hi], split.rank[lo:hi], at[b] // 8, out)
        elif role == "data" and col.kind == "fixed":
            out = buf.view(_UINT[col.width])
            for part, lo, hi in _chunks_of(col, len(pid)):
                k.scatter(part.values, pid[lo:hi], split.rank[lo:hi], at[b] // col.width, out)
        elif role == "data" and col.kind == "bits":
            k.scatter_bits(col.values, col.offset, col.from_bytes, pid, split.rank, at[b], counts, buf)
        elif role == "offsets":
            out_off = buf.view(np.int64 if col.width == 8 else np.int32)
            cursor = np.zeros(ncompact, np.uint64)  # carried from chunk to chunk
            for part, lo, hi in _chunks_of(col, len(pid)):
                k.scatter_var(part.offsets, part.values, pid[lo:hi], split.rank[lo:hi], counts,
                              at[b] // col.width, at[b + 1], out_off, buf, cursor)
    for b, (j, role, sizes) in enumerate(plan):
        if role == "ipc":
            for p in range(ncompact):
                _write_ipc_into(blobs["ipc"][p], buf[at[b][p] : at[b][p] + sizes[p]])
        elif role == "pickle":
            for p in range(ncompact):
                buf[at[b][p] : at[b][p] + sizes[p]] = np.frombuffer(blobs[f"pickle{j}"][p], np.uint8)
    # One metadata object for every piece of the insert (the schema, the
    # buffers of the columns and their alignment).
    common = _common_header(columns, plan, schema, names, align)
    if opaque and ncompact:
        words = buf[: buf.shape[0] // _WORD * _WORD].view(np.int64)
        at_words = (piece_base // _WORD)[:, None] + np.arange(len(opaque))[None, :]
        words[at_words] = sizes_all[opaque].T
    bases = piece_base - np.asarray(group_offsets, np.int64)[group]
    return PackedPieces(PieceTable._unchecked(
        present.astype(np.int64), counts.astype(np.int64), np.zeros(ncompact, np.int32), [common],
        group.astype(np.int32), bases.astype(np.int64), piece_size.astype(np.int64),
        list(group_buffers),
    ))


def _chunks_of(col: Column, nrows: int) -> list[tuple[Column, int, int]]:
    """``(column, first row, end row)`` of each buffer of ``col``: its chunks, or itself over all ``nrows``."""
    if col.chunks is None:
        return [(col, 0, nrows)]
    starts = col.chunk_starts
    return [(part, int(starts[i]), int(starts[i + 1])) for i, part in enumerate(col.chunks)]


#: At most this many groups hold the pieces a rank keeps (see :func:`owner_groups`).
KEPT_GROUPS = 256
#: Bytes a group of kept pieces reaches before the next kept piece starts another.
KEPT_GROUP_BYTES = 2**20


def owner_groups(
    piece_size: npt.NDArray[np.int64], rank: int, nranks: int, *, partition_ids: npt.NDArray[Any] | None = None
) -> npt.NDArray[np.int64]:
    """Group of each partition for :func:`pack`: where its piece's memory is freed with others'.

    Parameters
    ----------
    piece_size
        Bytes of each partition's piece (0: no piece), shape ``(npartitions,)``,
        or of each partition of ``partition_ids``.
    rank, nranks
        This rank and the number of ranks (partition ``j`` is kept when
        ``j % nranks == rank``, :func:`owned_partitions`).
    partition_ids
        The partitions ``piece_size`` lists, increasing (``None``: all,
        ``0 .. npartitions - 1``).

    Returns
    -------
    numpy.ndarray
        ``int64`` group of each partition, shape of ``piece_size``. The
        pieces this rank keeps wait in the postbox until their partition is
        extracted, one partition after another: neighbouring kept pieces
        share a group until it holds :data:`KEPT_GROUP_BYTES` (at most
        :data:`KEPT_GROUPS` groups), so memory goes back soon after its
        partitions are extracted while an insert into thousands of small
        partitions still takes a few blocks, not one per partition. The
        pieces for each other rank share one group of their own (one
        contiguous range per destination, sent as one frame), freed once sent.
    """
    sizes = np.asarray(piece_size, np.int64)
    npartitions = sizes.shape[0]
    if partition_ids is None:
        owned = owned_partitions(rank, nranks, npartitions)
        kept = np.zeros(npartitions, dtype=bool)
        kept[owned.start : owned.stop : owned.step] = True  # a range as a slice: no list of ids
        ids = None
    else:
        ids = np.asarray(partition_ids, np.int64)
        kept = partition_owners(ids, nranks) == rank
    kept_sizes = sizes[kept]
    target = max(KEPT_GROUP_BYTES, -(-int(kept_sizes.sum()) // KEPT_GROUPS))
    # A kept piece starts a new group when the bytes before it cross a multiple of the target.
    before = np.cumsum(kept_sizes) - kept_sizes
    kept_group = before // target
    nkept_groups = int(kept_group[-1]) + 1 if kept_group.size else 0
    groups = np.empty(npartitions, np.int64)
    groups[kept] = kept_group
    # Ranks other than this one, numbered after the kept groups.
    sent = ~kept
    dest = partition_owners(np.flatnonzero(sent) if ids is None else ids[sent], nranks)
    groups[sent] = nkept_groups + dest - (dest > rank)
    return groups


def _allocate(
    sizes: list[int], pool: HostPool | None
) -> tuple[npt.NDArray[np.uint8], list[int], list[pa.Buffer]]:
    """One buffer per group, and one array the kernels write all of them through.

    Returns ``(array, offsets, buffers)``: group ``g`` is
    ``array[offsets[g] : offsets[g] + sizes[g]]``, owned by ``buffers[g]``.
    With a pool each group is a block of its own (so the pieces sent away
    free theirs while the kept ones stay, and each kept partition frees its
    own at extract); the array then spans from the lowest block to the end of
    the highest, and only the groups' ranges in it are ever written.
    """
    if pool is None:
        offsets = (np.cumsum(sizes) - np.asarray(sizes, np.int64)).tolist()
        buf = aligned_empty(max(sum(sizes), 1))
        return buf, offsets, [pa.py_buffer(buf[o : o + s]) for o, s in zip(offsets, sizes, strict=True)]
    # A group without pieces gets no memory (nothing is written to it).
    buffers = [pool.allocate(s) if s else pa.py_buffer(b"") for s in sizes]
    used = [b for b, s in zip(buffers, sizes, strict=True) if s]
    if not used:
        return aligned_empty(1), [0] * len(sizes), buffers
    lo = min(b.address for b in used)
    hi = max(b.address + b.size for b in used)
    span = np.ctypeslib.as_array((ctypes.c_uint8 * (hi - lo)).from_address(lo))
    return span, [b.address - lo if s else 0 for b, s in zip(buffers, sizes, strict=True)], buffers


def _ipc_size(table: pa.Table) -> int:
    mock = pa.MockOutputStream()
    with pa.ipc.new_stream(mock, table.schema) as writer:
        writer.write_table(table)
    return int(mock.size())


def _write_ipc_into(table: pa.Table, target: npt.NDArray[np.uint8]) -> None:
    with pa.ipc.new_stream(pa.FixedSizeBufferWriter(pa.py_buffer(target)), table.schema) as writer:
        writer.write_table(table)


def _common_header(
    columns: Sequence[Column], plan: list[tuple[int, str, Any]], schema: pa.Schema | None,
    names: Sequence[Any] | None, align: int,
) -> bytes:
    desc = {
        "names": list(names) if names is not None else None,
        "cols": [[c.kind, c.field, c.width, c.validity is not None] for c in columns],
        "plan": [[j, role] for j, role, _ in plan],
        "align": align,
    }
    body = json.dumps(desc, separators=(",", ":")).encode()
    schema_bytes = schema.serialize().to_pybytes() if schema is not None else b""
    return COLS + _U32.pack(len(body)) + body + _U32.pack(len(schema_bytes)) + schema_bytes


def is_cols(metadata: Any) -> bool:
    """Whether a piece's metadata is of this format."""
    return bytes(metadata[: len(COLS)]) == COLS


@lru_cache(maxsize=64)
def _parse_common(common: bytes) -> tuple[dict[str, Any], pa.Schema | None, int]:
    n = len(COLS)
    (blen,) = _U32.unpack_from(common, n)
    desc = json.loads(common[n + 4 : n + 4 + blen])
    (slen,) = _U32.unpack_from(common, n + 4 + blen)
    start = n + 8 + blen
    schema = pa.ipc.read_schema(pa.py_buffer(common[start : start + slen])) if slen else None
    return desc, schema, start + slen


def _split_metadata(metadata: bytes) -> tuple[dict[str, Any], pa.Schema | None]:
    desc, schema, _ = _parse_common(bytes(metadata))
    return desc, schema


# Buffer kinds of the layouts kernel (mpshuffle.table._gather's BITS, FIXED,
# OFFSETS, VAR_DATA, OPAQUE; not imported from there, which would load numba).
_BITS, _FIXED, _OFFSETS, _VAR_DATA, _OPAQUE = 0, 1, 2, 3, 4


@lru_cache(maxsize=64)
def _layout_rule(common: bytes) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64], int]:
    """What the layouts kernel needs of a metadata: each buffer's kind, width and slack, and the alignment."""
    desc, _ = _split_metadata(common)
    cols = desc["cols"]
    kind, width, slack = [], [], []
    for j, role in desc["plan"]:
        col_kind, col_width = (cols[j][0], cols[j][2]) if j >= 0 else ("", 0)
        if role in ("ipc", "pickle"):
            k, w = _OPAQUE, 0
        elif role == "validity" or col_kind == "bits":
            k, w = _BITS, 0
        elif role == "offsets":
            k, w = _OFFSETS, col_width
        elif col_kind == "var":
            k, w = _VAR_DATA, col_width
        else:
            k, w = _FIXED, col_width
        kind.append(k)
        width.append(w)
        slack.append(_WORD if k == _VAR_DATA else 0)
    return (np.array(kind, np.int64), np.array(width, np.int64), np.array(slack, np.int64),
            int(desc.get("align", _WORD)))


def _layouts(
    metadata: bytes, address: npt.NDArray[np.uint64], size: npt.NDArray[np.int64], nrows: npt.NDArray[np.int64],
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Start and bytes of every buffer (``metadata``'s plan order) of pieces of one metadata, shape ``(n, nbuf)``.

    Derived from each piece's rows and, for strings, its last offset, by the
    rule :func:`pack` writes by (:func:`mpshuffle.table._gather.layouts`);
    nothing of a piece is read before its bounds are checked.

    Raises
    ------
    ShuffleError
        If a piece's bytes cannot hold its layout (truncated or corrupt).
    """
    kind, width, slack, align = _layout_rule(bytes(metadata))
    n = len(address)
    start = np.full((n, len(kind)), -1, np.int64)
    nbytes = np.zeros((n, len(kind)), np.int64)
    bad = int(_kernels().layouts(
        np.ascontiguousarray(address, np.uint64), np.ascontiguousarray(size, np.int64),
        np.ascontiguousarray(nrows, np.int64), kind, width, slack, np.int64(align), start, nbytes,
    ))
    if bad >= 0:
        raise ShuffleError(
            f"a received piece of {int(nrows[bad])} rows has {int(size[bad])} bytes, fewer than its columns "
            "need: it is truncated or corrupt"
        )
    return start, nbytes


def read_piece(piece: PackedData) -> tuple[pa.Table, dict[int, pd.Series], list[Any] | None]:
    """Rebuild a piece written by :func:`pack`, zero copy from its buffer.

    Returns
    -------
    table
        The non-pickled columns with the schema they were packed with.
    pickled
        Column position in the frame -> its values (a ``pandas.Series``).
    names
        The original column names when some were not strings, else ``None``.
    """
    desc, schema = _split_metadata(piece.metadata)
    n = piece.nrows
    data = piece.data if isinstance(piece.data, pa.Buffer) else pa.py_buffer(piece.data)
    start, nbytes = _layouts(
        piece.metadata, np.array([data.address], np.uint64), np.array([data.size], np.int64),
        np.array([n], np.int64),
    )
    bufs: dict[tuple[int, str], pa.Buffer] = {}
    pickled: dict[int, pd.Series] = {}
    ipc = None
    for (j, role), off, size in zip(desc["plan"], start[0].tolist(), nbytes[0].tolist(), strict=True):
        region = data.slice(off, size)
        if role == "ipc":
            with pa.ipc.open_stream(region) as reader:
                ipc = reader.read_all()
        elif role == "pickle":
            pickled[j] = pickle.loads(region)
        else:
            bufs[(j, role)] = region
    arrays = []
    assert schema is not None
    ipc_k = 0
    for j, (kind, field, _width, has_validity) in enumerate(desc["cols"]):
        if kind == "pickle":
            continue
        t = schema.field(field).type
        if kind == "arrow":
            assert ipc is not None
            arrays.append(ipc.column(ipc_k))
            ipc_k += 1
            continue
        validity = bufs.get((j, "validity")) if has_validity else None
        if kind == "var":
            arr = pa.Array.from_buffers(t, n, [validity, bufs[(j, "offsets")], bufs[(j, "data")]])
        else:
            arr = pa.Array.from_buffers(t, n, [validity, bufs[(j, "data")]])
        arrays.append(arr)
    table = pa.Table.from_arrays(arrays, schema=schema)
    return table, pickled, desc["names"]


def gather(pieces: Sequence[PackedData]) -> tuple[pa.Table, list[Any] | None, list[pa.Schema]] | None:
    """Concatenate pieces written by :func:`pack` into one table, one compiled pass per buffer.

    The pieces may come from different inserts (their metadata differ, e.g.
    one has a validity bitmap where another has none) as long as their
    schemas have the same field types; every column must have a raw layout
    (no ``"arrow"`` or ``"pickle"`` column). Nothing is built per piece (a
    :class:`~mpshuffle.memory.packed.PieceTable` gives its arrays as they are): the
    kernels read each piece's buffers where they lie, by address, into one
    new buffer per column buffer, so the cost is the bytes plus a few
    operations per piece.

    Parameters
    ----------
    pieces
        Pieces whose metadata :func:`is_cols`, in output order.

    Returns
    -------
    (table, names, schemas) or None
        The table (the first piece's schema, metadata included), the
        original column names as :func:`read_piece` gives them and the
        distinct schemas of the pieces (to check against a meta; the first
        is the schema object the table was made with); ``None``
        when the pieces do not qualify (the caller reads them one by one).
    """
    if not pieces:
        return None
    n = len(pieces)
    if isinstance(pieces, PieceTable):
        # The arrays are there: nothing per piece.
        metas = dict.fromkeys(pieces.metas)
        number = {m: k for k, m in enumerate(metas)}
        which = np.array([number[m] for m in pieces.metas], np.int64)[pieces.meta_of]
        address = pieces.address
        nrows = pieces.nrows
        size = pieces.size
    else:
        metadata = [p.metadata for p in pieces]
        metas = dict.fromkeys(metadata)  # distinct, in order (bytes hash once)
        if len(metas) == 1:
            which = np.zeros(n, np.int64)
        else:
            number = {m: k for k, m in enumerate(metas)}
            which = np.fromiter((number[m] for m in metadata), np.int64, n)
        datas = [p.data if type(p.data) is pa.Buffer else pa.py_buffer(p.data) for p in pieces]
        address = np.fromiter((d.address for d in datas), np.uint64, n)
        size = np.fromiter((d.size for d in datas), np.int64, n)
        nrows = np.fromiter((p.nrows for p in pieces), np.int64, n)
    parsed = [_split_metadata(m) for m in metas]
    desc0, schema0 = parsed[0]
    if schema0 is None:
        return None
    kinds = [(c[0], c[1], c[2]) for c in desc0["cols"]]
    if any(kind not in ("fixed", "bits", "var") for kind, _, _ in kinds):
        return None
    for m, (desc, schema) in enumerate(parsed):
        if schema is None or desc["names"] != desc0["names"]:
            return None
        if [(c[0], c[1], c[2]) for c in desc["cols"]] != kinds:
            return None
        if m and (schema.types != schema0.types or schema.names != schema0.names):
            return None
    # Where each (column, role) buffer lies in each piece (start -1: absent),
    # derived per distinct metadata for its pieces.
    roles = ("validity", "data", "offsets")
    start = np.full((len(kinds), len(roles), n), -1, np.int64)
    nbytes_of = np.zeros((len(kinds), len(roles), n), np.int64)
    for m, (meta, (desc, _)) in enumerate(zip(metas, parsed, strict=True)):
        sel = np.flatnonzero(which == m) if len(parsed) > 1 else slice(None)
        starts_m, nbytes_m = _layouts(meta, address[sel], size[sel], nrows[sel])
        for b, (j, role) in enumerate(desc["plan"]):
            start[j, roles.index(role), sel] = starts_m[:, b]
            nbytes_of[j, roles.index(role), sel] = nbytes_m[:, b]
    k = _kernels()
    total = int(nrows.sum())
    bitmap = (total + 7) >> 3
    # Every output buffer's size first, so that all of them share one block
    # of the kind of page that is cheaper here (see output_empty): validity, then data
    # (fixed, bits) or offsets and bytes (var; 32-bit offsets are gathered
    # as 64-bit and narrowed, so they get memory of their own).
    sizes: list[tuple[int, int, int]] = []
    for j, (kind, _, width) in enumerate(kinds):
        validity_bytes = bitmap if (start[j, 0] >= 0).any() else 0
        if kind == "fixed":
            sizes.append((validity_bytes, total * width, 0))
        elif kind == "bits":
            sizes.append((validity_bytes, bitmap, 0))
        else:
            data_bytes = int(np.where(start[j, 1] >= 0, nbytes_of[j, 1], 0).sum())
            sizes.append((validity_bytes, (total + 1) * 8 if width == 8 else 0, data_bytes))
    flat = np.array(sizes, np.int64).reshape(-1)
    padded = _aligned(flat)
    starts = (np.cumsum(padded) - padded).tolist()
    block = output_empty(max(int(padded.sum()), 1))
    views = [block[at : at + n] for at, n in zip(starts, flat.tolist(), strict=True)]
    arrays = []
    for j, (kind, field, width) in enumerate(kinds):
        bits_out, first, second = views[3 * j : 3 * j + 3]
        validity_at = start[j, 0]
        validity = None
        if sizes[j][0]:
            bits_out[:] = 0
            k.gather_bits(address, validity_at, nrows, bits_out)
            validity = pa.py_buffer(bits_out)
        data_at = start[j, 1]
        if kind == "fixed":
            k.gather_bytes(address, data_at, nbytes_of[j, 1], first)
            buffers = [validity, pa.py_buffer(first)]
        elif kind == "bits":
            first[:] = 0
            k.gather_bits(address, data_at, nrows, first)
            buffers = [validity, pa.py_buffer(first)]
        else:
            offsets = first.view(np.int64) if width == 8 else np.empty(total + 1, np.int64)
            nbytes = int(k.gather_offsets(address, start[j, 2], nrows, width, offsets))
            if width == 4 and nbytes >= 2**31:
                return None  # more than 32-bit offsets reach: read piece by piece
            if nbytes != sizes[j][2]:
                raise ShuffleError(
                    f"column {field!r}: the pieces' offsets give {nbytes} bytes of data, their layouts "
                    f"{sizes[j][2]}; a piece is corrupt"
                )
            k.gather_bytes(address, data_at, nbytes_of[j, 1], second)
            if width == 4:
                offsets = offsets.astype(np.int32)
            buffers = [validity, pa.py_buffer(offsets), pa.py_buffer(second)]
        arrays.append(pa.Array.from_buffers(schema0.field(field).type, total, buffers))
    distinct = list({id(schema): schema for _, schema in parsed if schema is not None}.values())
    if isinstance(pieces, PieceTable):
        pieces.copied = True  # the table's buffers are all in the new block
    return pa.Table.from_arrays(arrays, schema=schema0), desc0["names"], distinct
