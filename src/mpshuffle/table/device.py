"""Device-resident tables: columns as CuPy arrays, hashed, split and packed on the device.

:class:`DeviceTable` is a minimal columnar table whose columns are 1-D arrays
of one array module: CuPy for device tables (the point of this module), NumPy
as a host twin that runs the very same code path (used by the tests that run
without a GPU and as the unspilled form of spilled pieces). Fixed-width
dtypes only: ``bool``, signed and unsigned integers, ``float32``/``float64``.

Everything here stays on the device of the input: the hash, the partition
ids, the stable partition order (a radix argsort of narrow ids), the gather
of every column and the packed buffers. The only device-to-host transfer is
the per-partition row counts (``npartitions`` integers), needed to size the
pieces.

The hash is the one of :mod:`mpshuffle.table.hashing`, so a key gets the same
partition id in a device table, a pandas frame and an Arrow table:
integers and ``bool`` are hashed as ``int64``, floats as ``float64`` with
``-0.0`` made ``0.0`` and ``NaN`` hashed as :data:`NULL_HASH`; the 8 bytes go
through the splitmix64 finalizer that :func:`pandas.util.hash_array` applies
to numeric arrays (Steele, Lea, Flood, "Fast splittable pseudorandom number
generators", OOPSLA 2014, with the constants of Stafford's "Mix13"); columns
combine as ``acc = acc * 0x9E3779B97F4A7C15 ^ h``.

This module imports no CuPy at import time;
:func:`mpshuffle.table.gpu.register_device_adapter` registers the adapter
when CuPy imports.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from mpshuffle.errors import ShuffleError
from mpshuffle.memory.packed import PackedData
from mpshuffle.table.base import FrameAdapter, check_ids
from mpshuffle.table.hashing import COMBINE_MULTIPLIER, NULL_HASH, owned_partitions

__all__ = [
    "DeviceAdapter",
    "DeviceTable",
    "array_module",
    "column_blocks",
    "column_offsets",
    "concat_tables",
    "hash_columns",
    "pack_sorted",
    "partition_order",
    "piece_dtypes",
    "piece_metadata",
    "rank_major_pids",
    "unpack_piece",
]

# Byte alignment of every column inside a packed piece: the widest supported
# dtype is 8 bytes; 64 keeps pieces cache-line aligned like the spill format.
_ALIGN = 64
_KINDS = "biuf"
_FORMAT = "mpshuffle-device-2"

_MIX_1 = 0xBF58476D1CE4E5B9
_MIX_2 = 0x94D049BB133111EB


def array_module(array: Any) -> Any:
    """Return the array module (``numpy`` or ``cupy``) of ``array``.

    CuPy is imported only if ``array`` is not a NumPy array.
    """
    if isinstance(array, np.ndarray):
        return np
    import cupy

    return cupy.get_array_module(array)


class DeviceTable:
    """Columns of equal length, each a 1-D CuPy (or NumPy) array of a fixed-width dtype.

    Parameters
    ----------
    columns
        ``{name: array}``; names are strings; arrays 1-D, all of one array
        module and of one length, dtypes ``bool``, ``int8..int64``,
        ``uint8..uint64``, ``float32`` or ``float64``. Not copied.

    Raises
    ------
    TypeError
        For a non-string name, a non-array, a mix of array modules or an
        unsupported dtype (the message names the column).
    ValueError
        For a column that is not 1-D or of another length than the first.
    """

    columns: dict[str, Any]
    xp: Any

    def __init__(self, columns: Mapping[str, Any]) -> None:
        self.columns = dict(columns)
        self.xp = np
        nrows: int | None = None
        modules = set()
        for name, col in self.columns.items():
            if not isinstance(name, str):
                raise TypeError(f"DeviceTable column names must be str, got {name!r}")
            if not hasattr(col, "dtype") or not hasattr(col, "shape"):
                raise TypeError(f"DeviceTable column {name!r} is a {type(col).__name__}, not an array")
            if col.dtype.kind not in _KINDS:
                raise TypeError(
                    f"DeviceTable column {name!r} has dtype {col.dtype}; only bool, integer and "
                    "float dtypes are supported"
                )
            if col.ndim != 1:
                raise ValueError(f"DeviceTable column {name!r} must be 1-D, got shape {col.shape}")
            if nrows is None:
                nrows = int(col.shape[0])
            elif col.shape[0] != nrows:
                raise ValueError(
                    f"DeviceTable column {name!r} has {col.shape[0]} rows, the first column {nrows}"
                )
            modules.add(array_module(col))
        if len(modules) > 1:
            raise TypeError("DeviceTable columns mix NumPy and CuPy arrays")
        if modules:
            self.xp = modules.pop()
        self._nrows = nrows or 0

    @property
    def nrows(self) -> int:
        """Number of rows."""
        return self._nrows

    @property
    def nbytes(self) -> int:
        """Bytes held by the columns."""
        return sum(int(c.nbytes) for c in self.columns.values())

    @property
    def names(self) -> list[str]:
        """Column names, in order."""
        return list(self.columns)

    @property
    def dtypes(self) -> dict[str, np.dtype[Any]]:
        """``{name: numpy.dtype}``."""
        return {k: np.dtype(v.dtype) for k, v in self.columns.items()}

    def empty_like(self) -> DeviceTable:
        """A 0-row table with the same columns, dtypes and array module."""
        return DeviceTable({k: self.xp.empty(0, dtype=v.dtype) for k, v in self.columns.items()})

    def to_host(self) -> DeviceTable:
        """A NumPy copy of the table (a device-to-host copy of every column)."""
        if self.xp is np:
            return self
        return DeviceTable({k: v.get() for k, v in self.columns.items()})

    def to_pandas(self) -> Any:
        """A ``pandas.DataFrame`` copy on the host (for checks and small data)."""
        import pandas as pd

        return pd.DataFrame(self.to_host().columns)

    @classmethod
    def from_pandas(cls, df: Any, *, device: bool = True) -> DeviceTable:
        """Copy a pandas frame's columns to the device (or keep NumPy copies).

        Parameters
        ----------
        df
            A ``pandas.DataFrame`` of supported dtypes with string column names.
        device
            ``True``: CuPy arrays on the current device; ``False``: NumPy arrays.
        """
        cols = {k: np.ascontiguousarray(df[k].to_numpy()) for k in df.columns}
        if device:
            import cupy

            cols = {k: cupy.asarray(v) for k, v in cols.items()}
        return cls(cols)

    def __repr__(self) -> str:
        where = "device" if self.xp is not np else "host"
        return f"DeviceTable({self.nrows} rows, {self.dtypes}, on {where})"


# -- hashing ---------------------------------------------------------------


_mix_kernel_cache: list[Any] = []


def _mix64(xp: Any, u: Any) -> Any:
    """The splitmix64 finalizer of every ``uint64`` of ``u``, as a new array.

    NumPy's ``u`` is overwritten (the caller passes a copy); CuPy's is not.
    """
    if xp is np:
        u ^= u >> np.uint64(30)
        u *= np.uint64(_MIX_1)
        u ^= u >> np.uint64(27)
        u *= np.uint64(_MIX_2)
        u ^= u >> np.uint64(31)
        return u
    if not _mix_kernel_cache:
        # One fused pass instead of five full-array kernels.
        _mix_kernel_cache.append(
            xp.ElementwiseKernel(
                "uint64 x",
                "uint64 y",
                f"""
                unsigned long long v = x;
                v ^= v >> 30; v *= {_MIX_1}ULL;
                v ^= v >> 27; v *= {_MIX_2}ULL;
                v ^= v >> 31; y = v;
                """,
                "mpshuffle_mix64",
            )
        )
    return _mix_kernel_cache[0](u)


def _hash_column(xp: Any, col: Any) -> Any:
    kind = col.dtype.kind
    if kind == "f":
        f = col.astype(np.float64)
        # -0.0 == 0.0, so this maps -0.0 to +0.0 and leaves NaN as NaN.
        f = xp.where(f == 0, 0.0, f)
        nan = xp.isnan(f)
        h = _mix64(xp, f.view(np.uint64))  # f is a fresh array
        return xp.where(nan, np.uint64(NULL_HASH), h)
    u = col.astype(np.int64, copy=False).view(np.uint64)
    return _mix64(xp, u.copy() if xp is np else u)


def hash_columns(columns: Sequence[Any]) -> Any:
    """Hash key columns row-wise on their device, as :mod:`mpshuffle.table.hashing` does.

    Parameters
    ----------
    columns
        Key columns in key order, each 1-D of length ``n``, of one array module.

    Returns
    -------
    array
        ``uint64``, shape ``(n,)``, on the columns' device.

    Raises
    ------
    ValueError
        If ``columns`` is empty.
    """
    if not columns:
        raise ValueError("at least one key column is needed to hash-partition")
    xp = array_module(columns[0])
    acc = _hash_column(xp, columns[0])
    for col in columns[1:]:
        acc *= np.uint64(COMBINE_MULTIPLIER)
        acc ^= _hash_column(xp, col)
    return acc


def _narrow_dtype(nvalues: int) -> Any:
    # Radix sorts do one pass per key byte: the narrowest type is the fastest.
    for dt in (np.uint8, np.uint16, np.uint32):
        if nvalues <= np.iinfo(dt).max + 1:
            return dt
    return np.uint64


_key_kernel_cache: list[Any] = []


def _rank_major_key(xp: Any) -> Any:
    """CuPy kernel ``(ids, nranks, per_rank, out) -> out``: ``(id % nranks) * per_rank + id // nranks``."""
    if not _key_kernel_cache:
        _key_kernel_cache.append(
            xp.ElementwiseKernel(
                "int64 p, int64 nr, int64 pr", "T k", "k = (T)((p % nr) * pr + p / nr)",
                "mpshuffle_rank_major_key",
            )
        )
    return _key_kernel_cache[0]


def partition_order(ids: Any, npartitions: int, nranks: int = 1) -> tuple[Any, Any]:
    """Stable order of rows grouped by owner rank, then partition id; and the counts.

    Parameters
    ----------
    ids
        ``int64`` partition ids, shape ``(n,)``, values in ``[0, npartitions)``.
    npartitions
        Number of output partitions.
    nranks
        Number of ranks; partition ``p`` is owned by rank ``p % nranks``
        (:func:`mpshuffle.table.partition_owner`). With ``1`` rows are simply
        grouped by partition id.

    Returns
    -------
    order
        ``int64`` row indices, shape ``(n,)``, on the device of ``ids``:
        rows of rank 0's partitions first (partition ``0``, then ``nranks``,
        ...), then rank 1's, ...; rows keep their relative order within a
        partition (a stable sort).
    counts
        ``numpy.int64`` row count of every partition id, shape
        ``(npartitions,)``, on the host.
    """
    xp = array_module(ids)
    per_rank = math.ceil(npartitions / nranks)
    dt = _narrow_dtype(per_rank * nranks)
    if nranks == 1:
        key = ids.astype(dt)
    elif xp is np:
        key = ((ids % nranks) * per_rank + ids // nranks).astype(dt)
    else:  # the same in one kernel instead of five
        key = _rank_major_key(xp)(ids, nranks, per_rank, xp.empty(ids.shape, dtype=dt))
    order = xp.argsort(key, kind="stable")
    # Counts from the sorted keys (a gather of narrow keys and one binary
    # search per key value), not a histogram: on a GPU, bincount's atomic
    # increments on a few counters serialize (0.6 ms for 10 M rows on an H200).
    nkeys = per_rank * nranks
    starts = xp.searchsorted(key[order], xp.arange(nkeys, dtype=dt))  # every value fits dt
    if xp is not np:
        starts = starts.get()
    per_key = np.diff(np.append(np.asarray(starts, dtype=np.int64), ids.shape[0]))
    # Key value r * per_rank + j holds partition j * nranks + r (r: its owner rank).
    r, j = np.divmod(np.arange(nkeys, dtype=np.int64), per_rank)
    pid = j * nranks + r
    valid = pid < npartitions
    counts = np.zeros(npartitions, dtype=np.int64)
    counts[pid[valid]] = per_key[valid]
    return order, counts


def rank_major_pids(npartitions: int, nranks: int) -> list[int]:
    """Partition ids in the order of :func:`partition_order` (rank-major)."""
    return [p for r in range(nranks) for p in owned_partitions(r, nranks, npartitions)]


# -- the adapter -------------------------------------------------------------


class DeviceAdapter(FrameAdapter):
    """Frame adapter for :class:`DeviceTable`: split and pack on the table's device.

    A packed piece is one contiguous ``uint8`` array on the device holding the
    piece's columns one after the other, each starting at a multiple of 64
    bytes; the metadata (JSON) names the columns and dtypes, from which
    :func:`column_offsets` gives the blocks' byte offsets.
    All pieces of one :meth:`split` are views into one allocation.
    """

    name = "device"

    def matches(self, obj: object) -> bool:
        return isinstance(obj, DeviceTable)

    def device_table(self, frame: DeviceTable) -> DeviceTable:
        """``frame`` itself: the form the device run path takes (see the cudf adapter)."""
        return frame

    def as_ids(self, frame: DeviceTable, ids: Any) -> Any:
        """A partitioner's ids as ``int64`` on the table's device (CuPy or NumPy, as its columns)."""
        return frame.xp.asarray(ids).astype(np.int64)

    def column_names(self, frame: DeviceTable) -> list[Any]:
        return frame.names

    def num_rows(self, frame: DeviceTable) -> int:
        return frame.nrows

    def nbytes(self, frame: DeviceTable) -> int:
        return frame.nbytes

    def partition_ids(self, frame: DeviceTable, on: Sequence[Any], npartitions: int) -> Any:
        """Partition id of every row, on the table's device (``int64``, shape ``(n,)``).

        Unlike the host adapters' this returns a device array for a device table.
        """
        if int(npartitions) != npartitions or not 1 <= npartitions < 2**63:
            raise ValueError(f"npartitions must be an integer in [1, 2**63), got {npartitions!r}")
        missing = [k for k in on if k not in frame.columns]
        if missing:
            raise KeyError(f"key column(s) {missing} not in DeviceTable columns {frame.names}")
        h = hash_columns([frame.columns[k] for k in on])
        return (h % np.uint64(npartitions)).astype(np.int64)

    def split(
        self,
        frame: DeviceTable,
        on: Sequence[Any],
        npartitions: int,
        ids: Any = None,
    ) -> dict[int, PackedData]:
        if ids is None:
            ids = self.partition_ids(frame, on, npartitions)
        else:
            ids = frame.xp.asarray(ids)
            check_ids(ids, frame.nrows, npartitions)
        order, counts = partition_order(ids, npartitions)
        return pack_sorted(frame, order, counts, list(range(npartitions)))

    def unpack(self, pieces: Sequence[PackedData], meta: DeviceTable) -> DeviceTable:
        if not pieces:
            return self.empty_like(meta)
        tables = [unpack_piece(p) for p in pieces]
        for t in tables:
            if t.names != meta.names:
                raise ShuffleError(
                    f"device piece has columns {t.names}, the meta has {meta.names}"
                )
        return concat_tables(tables, meta)

    def empty_like(self, meta: DeviceTable) -> DeviceTable:
        return meta.empty_like()


def column_offsets(nrows: int, dtypes: Sequence[Any]) -> tuple[list[int], int]:
    """Byte offset of every column block of a packed piece of ``nrows`` rows, and its size.

    Columns follow one another, each in a block of :func:`column_blocks`
    bytes. The offsets are not stored in a piece's metadata; they follow
    from ``nrows`` and the dtypes.

    Parameters
    ----------
    nrows
        Rows of the piece.
    dtypes
        Column dtypes, in column order.

    Returns
    -------
    offsets
        Byte offset of each column's block within the piece.
    size
        Bytes of the whole piece.
    """
    blocks = column_blocks([nrows], [np.dtype(d).itemsize for d in dtypes])[0]
    return (np.cumsum(blocks) - blocks).tolist(), int(blocks.sum())


def column_blocks(nrows: Any, itemsizes: Any) -> Any:
    """Bytes of every column block of packed pieces: ``align64(nrows * itemsize)``.

    Parameters
    ----------
    nrows
        ``int64`` rows of each piece, shape ``(k,)``.
    itemsizes
        ``int64`` item size of each column, shape ``(c,)``.

    Returns
    -------
    numpy.ndarray
        ``int64``, shape ``(k, c)``; a piece's column ``j`` starts at the
        sum of its blocks before ``j`` (:func:`column_offsets` for one piece).
    """
    n = np.asarray(nrows, dtype=np.int64)
    items = np.asarray(itemsizes, dtype=np.int64)
    return (n[:, None] * items[None, :] + _ALIGN - 1) // _ALIGN * _ALIGN


def piece_metadata(names: Sequence[str], dtypes: Sequence[Any]) -> bytes:
    """The metadata of a packed device piece: the format, column names and dtypes (JSON).

    One metadata serves every piece of these columns, whatever its row count
    (see :func:`column_offsets`).

    Parameters
    ----------
    names
        Column names, in column order.
    dtypes
        Column dtypes, in column order.

    Returns
    -------
    bytes
        UTF-8 JSON ``{"format": "mpshuffle-device-2", "names": [...], "dtypes": [...]}``.
    """
    return json.dumps(
        {"format": _FORMAT, "names": list(names), "dtypes": [np.dtype(d).str for d in dtypes]}
    ).encode()


def piece_dtypes(metadata: bytes) -> list[np.dtype[Any]]:
    """The column dtypes named by a packed device piece's metadata (:func:`piece_metadata`).

    Raises
    ------
    ShuffleError
        If the metadata is not of this adapter's format.
    """
    return [np.dtype(d) for d in _parse_metadata(metadata)["dtypes"]]


def _parse_metadata(metadata: bytes) -> dict[str, Any]:
    try:
        meta = json.loads(bytes(metadata))
    except ValueError:
        meta = None
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        raise ShuffleError(f"packed piece is not in the device table format ({_FORMAT})")
    return meta


def pack_sorted(
    frame: DeviceTable, order: Any, counts: Any, pid_order: Iterable[int]
) -> dict[int, PackedData]:
    """Gather ``frame``'s rows by ``order`` straight into packed pieces (one pass).

    Parameters
    ----------
    frame
        The table.
    order
        Row order grouping rows by partition in the order ``pid_order``.
    counts
        Host row count per partition id.
    pid_order
        Partition ids in the order their rows appear in ``order``.

    Returns
    -------
    dict
        ``{pid: PackedData}`` of the non-empty pieces, in ``pid_order``;
        ``data`` are views into one ``uint8`` array on the table's device and
        all pieces share one metadata (:func:`piece_metadata`).
    """
    xp = frame.xp
    pids = np.fromiter(pid_order, dtype=np.int64)
    n = np.asarray(counts, dtype=np.int64)[pids] if len(pids) else np.zeros(0, dtype=np.int64)
    keep = n > 0
    pids, n = pids[keep], n[keep]
    items = np.array([c.dtype.itemsize for c in frame.columns.values()], dtype=np.int64)
    blocks = column_blocks(n, items)  # pieces x columns
    sizes = blocks.sum(axis=1)
    starts = np.zeros(len(pids) + 1, dtype=np.int64)
    np.cumsum(sizes, out=starts[1:])
    col_offs = np.cumsum(blocks, axis=1) - blocks  # offset of each block within its piece
    r0 = np.zeros(len(pids), dtype=np.int64)
    np.cumsum(n[:-1], out=r0[1:])
    buf = xp.empty(int(starts[-1]), dtype=np.uint8)
    if len(pids):
        block_start = starts[:-1, None] + col_offs
        cols = list(frame.columns.values())
        if xp is not np and all(c.flags.c_contiguous for c in cols) and order.flags.c_contiguous:
            _pack_rows(xp, cols, order, r0, block_start, buf)
        else:
            _scatter_columns(frame, order, r0, block_start, buf)
    meta = piece_metadata(frame.names, [c.dtype for c in frame.columns.values()])
    return {
        int(pid): PackedData(metadata=meta, data=buf[int(a) : int(b)], nrows=int(k))
        for pid, a, b, k in zip(pids, starts[:-1], starts[1:], n, strict=True)
    }


def _scatter_columns(frame: DeviceTable, order: Any, r0: Any, block_start: Any, buf: Any) -> None:
    """Fill every piece's column blocks with a few array operations per column.

    Sorted row ``i`` lies in piece ``k`` (rows ``r0[k] .. r0[k + 1]``); its
    value of column ``c`` goes to element ``block_start[k, c] / itemsize_c +
    (i - r0[k])`` of the buffer viewed as ``c``'s dtype (blocks are aligned to
    ``_ALIGN`` = 64 bytes, a multiple of the itemsize of every dtype kind a
    device table holds). One gather and one scatter per column, instead of
    one copy per piece and column: the number of kernel launches does not
    grow with the number of output partitions.
    """
    xp = frame.xp
    nrows_sorted = int(order.shape[0])
    row = xp.arange(nrows_sorted, dtype=np.int64)
    # Piece of each sorted row: pieces hold consecutive row ranges starting at r0.
    piece_of_row = xp.searchsorted(xp.asarray(r0[1:]), row, side="right")
    for c, col in enumerate(frame.columns.values()):
        first = block_start[:, c] // col.dtype.itemsize
        dest = xp.asarray(first - r0)[piece_of_row]
        dest += row
        buf.view(col.dtype)[dest] = xp.take(col, order)


_PACK_SOURCE = r"""
extern "C" __global__ void mpshuffle_pack_rows(
    const long long* order, long long n, const long long* r0, int npieces,
    const unsigned long long* cols, const int* items, int ncols,
    const long long* base, unsigned char* buf)
{
    // Sorted row i: its piece k (the last with r0[k] <= i), then every column.
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    int lo = 0, hi = npieces - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (r0[mid] <= i) lo = mid; else hi = mid - 1;
    }
    const long long src = order[i];
    for (int c = 0; c < ncols; ++c) {
        const long long dst = base[(long long)lo * ncols + c] + i;  // in items of column c
        const int it = items[c];
        const unsigned char* col = (const unsigned char*)cols[c];
        if (it == 8) ((unsigned long long*)buf)[dst] = ((const unsigned long long*)col)[src];
        else if (it == 4) ((unsigned int*)buf)[dst] = ((const unsigned int*)col)[src];
        else if (it == 2) ((unsigned short*)buf)[dst] = ((const unsigned short*)col)[src];
        else buf[dst] = col[src];
    }
}
"""
_pack_kernel_cache: list[Any] = []


def _pack_rows(xp: Any, cols: list[Any], order: Any, r0: Any, block_start: Any, buf: Any) -> None:
    """:func:`_scatter_columns` for contiguous CuPy columns, in one kernel.

    One thread per sorted row finds its piece by binary search over ``r0``
    and copies the row's value of every column to its block: the gathers
    and scatters of all columns in one launch, with no per-row index arrays.
    """
    if not _pack_kernel_cache:
        _pack_kernel_cache.append(xp.RawKernel(_PACK_SOURCE, "mpshuffle_pack_rows"))
    items = np.array([c.dtype.itemsize for c in cols], dtype=np.int64)
    base = block_start // items[None, :] - r0[:, None]  # element index of sorted row 0's slot
    n = int(order.shape[0])
    ptrs = np.array([c.data.ptr for c in cols], dtype=np.uint64)
    _pack_kernel_cache[0](
        ((n + 255) // 256,), (256,),
        (order.astype(np.int64, copy=False), np.int64(n), xp.asarray(r0), np.int32(len(r0)),
         xp.asarray(ptrs), xp.asarray(items.astype(np.int32)), np.int32(len(cols)),
         xp.asarray(np.ascontiguousarray(base)), buf),
    )


def unpack_piece(piece: PackedData) -> DeviceTable:
    """Column views of one packed device piece (zero copy).

    ``piece.data`` may be a CuPy or a NumPy ``uint8`` array (a spilled piece),
    or a ``memoryview`` (a piece of a host run, which NumPy tables take).

    Raises
    ------
    ShuffleError
        If the metadata is not of this adapter's format.
    """
    meta = _parse_metadata(piece.metadata)
    data = piece.data
    if isinstance(data, memoryview):  # a host run's piece (NumPy tables take the host path)
        data = np.frombuffer(data, dtype=np.uint8)
    dtypes = [np.dtype(d) for d in meta["dtypes"]]
    offs, _ = column_offsets(piece.nrows, dtypes)
    cols = {}
    for name, dtype, off in zip(meta["names"], dtypes, offs, strict=True):
        cols[name] = data[off : off + piece.nrows * dtype.itemsize].view(dtype)
    return DeviceTable(cols)


def concat_tables(tables: Sequence[DeviceTable], meta: DeviceTable) -> DeviceTable:
    """Concatenate tables of ``meta``'s columns onto ``meta``'s array module.

    One table on the right module is returned as is (no copy). Columns are
    cast to ``meta``'s dtypes only where the cast is lossless.

    Raises
    ------
    ShuffleError
        If a column cannot be cast losslessly to ``meta``'s dtype.
    """
    xp = meta.xp
    if len(tables) == 1 and tables[0].xp is xp and tables[0].dtypes == meta.dtypes:
        return tables[0]
    cols = {}
    for name, dtype in meta.dtypes.items():
        parts = []
        for t in tables:
            src = t.columns[name]
            if type(src) is xp.ndarray and src.dtype == dtype:  # the common case, cheaply
                parts.append(src)
                continue
            if not np.can_cast(src.dtype, dtype, casting="safe"):
                raise ShuffleError(
                    f"column {name!r}: cannot cast {src.dtype} to {dtype} losslessly"
                )
            src = xp.asarray(src)  # a spilled (host) piece goes back to the device
            parts.append(src if src.dtype == dtype else src.astype(dtype))
        # One concatenation per column (CuPy copies many pieces in one kernel).
        cols[name] = xp.concatenate(parts) if parts else xp.empty(0, dtype=dtype)
    return DeviceTable(cols)
