"""The serialized form of one piece of a frame: :class:`PackedData`, and many pieces as arrays.

The frame adapters of :mod:`mpshuffle.table` write and read it; the memory
layer holds, counts and spills it without knowing any frame type.

With thousands of output partitions a piece is often a few rows, and an
object per piece (a :class:`PackedData`, a buffer slice, a tuple) costs more
than its bytes. :class:`PieceTable` holds many pieces as arrays (rows,
metadata number, buffer and byte range per piece) over a few buffers;
:class:`PackedPieces` is the pieces of one insert, by partition id, in that
form. Both build a :class:`PackedData` only where one is asked for, so code
that reads pieces one by one keeps working, and code that knows the arrays
(the shuffler's send path, :func:`mpshuffle.table._columns.gather`) never
builds one.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np
import numpy.typing as npt
import pyarrow as pa

__all__ = [
    "PackedData",
    "PackedPieces",
    "PieceTable",
    "compact_ints",
    "distinct_metadata",
    "expand_ints",
    "narrowest",
    "packed_nbytes",
]

# The first frame of ``to_frames`` is this prefix (nrows, little-endian uint64)
# followed by the adapter's metadata, so a receiver needs no side channel to
# learn the row count.
_NROWS = struct.Struct("<Q")
# compact_ints' header: the width and delta flag, the count, the reference
# value (and, with deltas, the first value).
_COMPACT = struct.Struct("<Bqq")
_FIRST = struct.Struct("<q")
_DELTA = 0x10
_UNSIGNED: dict[int, np.dtype[Any]] = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}
_NATIVE: dict[int, type[np.integer[Any]]] = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.int64}


def _buffer_size(data: Any) -> int:
    # pyarrow.Buffer, bytes, bytearray and memoryview all export the buffer
    # protocol; memoryview(...).nbytes is the size in bytes for any of them.
    size = getattr(data, "size", None)
    if isinstance(size, int):
        return size
    return memoryview(data).nbytes


@dataclass(frozen=True)
class PackedData:
    """One piece of a frame, serialized: a small metadata header + one contiguous buffer.

    Attributes
    ----------
    metadata
        Adapter-defined small header (may be ``b""``); tells the adapter how to
        read ``data`` back (for the built-in adapters: the packing format and,
        where needed, the original column names).
    data
        The bulk bytes: ``bytes``, ``memoryview`` or ``pyarrow.Buffer``. Never
        copied by this class.
    nrows
        Number of rows of the frame piece that ``data`` holds.
    """

    metadata: bytes
    data: Any
    nrows: int

    @property
    def nbytes(self) -> int:
        """Size in bytes: ``len(metadata)`` plus the size of ``data``."""
        return len(self.metadata) + _buffer_size(self.data)

    def to_frames(self) -> list[Any]:
        """Return the frames to send: ``[header, data]``.

        Returns
        -------
        list
            Two buffer objects. ``header`` is ``nrows`` as an 8-byte
            little-endian unsigned integer followed by ``metadata`` (a copy of
            the small header only); ``data`` is ``self.data`` itself, not copied.
        """
        return [_NROWS.pack(self.nrows) + bytes(self.metadata), self.data]

    @classmethod
    def from_frames(cls, frames: Sequence[Any]) -> PackedData:
        """Rebuild a :class:`PackedData` from the output of :meth:`to_frames`.

        Parameters
        ----------
        frames
            ``[header, data]``, each any buffer-protocol object.

        Returns
        -------
        PackedData
            With ``data`` being ``frames[1]`` itself (zero copy).

        Raises
        ------
        ValueError
            If there are not exactly two frames or the header is shorter than
            its 8-byte row-count prefix.
        """
        if len(frames) != 2:
            raise ValueError(f"PackedData needs exactly 2 frames, got {len(frames)}")
        header = memoryview(frames[0]).cast("B")
        if header.nbytes < _NROWS.size:
            raise ValueError(
                f"PackedData header has {header.nbytes} bytes, fewer than its "
                f"{_NROWS.size}-byte row-count prefix"
            )
        (nrows,) = _NROWS.unpack_from(header)
        return cls(metadata=bytes(header[_NROWS.size :]), data=frames[1], nrows=int(nrows))


def packed_nbytes(pieces: Iterable[PackedData]) -> int:
    """Bytes that ``pieces`` hold together: every piece's data, and each distinct metadata once.

    The pieces of one insert share one metadata object (an adapter's schema
    and layout, a few hundred bytes to a few KiB), so ``sum(p.nbytes)``
    would count it once per piece; here it counts once per object.

    Parameters
    ----------
    pieces
        Any pieces.

    Returns
    -------
    int
        Bytes.
    """
    if isinstance(pieces, PieceTable):
        return pieces.nbytes
    total = 0
    seen: dict[int, int] = {}
    for p in pieces:
        total += _buffer_size(p.data)
        if id(p.metadata) not in seen:
            seen[id(p.metadata)] = len(p.metadata)
    return total + sum(seen.values())


def distinct_metadata(pieces: Sequence[PackedData]) -> list[bytes]:
    """The distinct metadata of ``pieces``, in order of first use (a :class:`PieceTable`'s without a pass over its pieces)."""
    if isinstance(pieces, PieceTable):
        return list(pieces.metas)
    return list(dict.fromkeys(p.metadata for p in pieces))


def _as_buffer(data: Any) -> pa.Buffer:
    return data if isinstance(data, pa.Buffer) else pa.py_buffer(data)


class PieceTable(Sequence[PackedData]):
    """Many pieces as arrays over a few buffers: a sequence of :class:`PackedData` built on demand.

    Piece ``i`` belongs to output partition ``pids[i]``, has ``nrows[i]``
    rows and metadata ``metas[meta_of[i]]``, and its data is the ``size[i]``
    bytes at ``offset[i]`` of ``buffers[buffer_of[i]]``. ``table[i]`` is that
    :class:`PackedData` (its data a zero-copy slice); ``table[a:b]`` and
    :meth:`take` are tables of the chosen pieces over the same buffers.

    Parameters
    ----------
    pids, nrows, buffer_of, offset, size
        One entry per piece (shape ``(n,)``; ``int64``, ``buffer_of``
        ``int32``); ``offset`` and ``size`` in bytes.
    meta_of
        Metadata number of each piece (``int32``, shape ``(n,)``).
    metas
        The distinct metadata (bytes; distinct by value where the pieces come
        from :class:`~mpshuffle.memory.postbox.Postbox`, by object at least).
    buffers
        The buffers the pieces lie in (buffer-protocol objects; held, so the
        pieces' memory lives as long as the table or a piece built from it).

    Raises
    ------
    ValueError
        If the arrays differ in length, a metadata or buffer number is out of
        range, or a byte range lies outside its buffer.
    """

    __slots__ = (
        "bases", "buffer_of", "buffers", "copied", "give_back", "mapped", "meta_of", "metas", "nrows", "offset", "pids",
        "size",
    )

    def __init__(
        self, *, pids: npt.ArrayLike, nrows: npt.ArrayLike, meta_of: npt.ArrayLike, metas: Sequence[bytes],
        buffer_of: npt.ArrayLike, offset: npt.ArrayLike, size: npt.ArrayLike, buffers: Sequence[Any],
    ) -> None:
        self.pids = np.asarray(pids, np.int64)
        self.nrows = np.asarray(nrows, np.int64)
        self.meta_of = np.asarray(meta_of, np.int32)
        self.buffer_of = np.asarray(buffer_of, np.int32)
        self.offset = np.asarray(offset, np.int64)
        self.size = np.asarray(size, np.int64)
        self.metas = list(metas)
        self.buffers = [_as_buffer(b) for b in buffers]
        #: Per buffer, ``(mapping, offset of the buffer in it)`` where the
        #: buffer lies in a shared memory mapping of a received message (the
        #: :class:`~mpshuffle.memory.postbox.Postbox` sets it), else ``None``;
        #: see :meth:`release_pages`.
        self.mapped: list[tuple[mmap.mmap, int] | None] | None = None
        #: Each buffer's address (``uint64``) where the maker knew them, else
        #: ``None`` (:attr:`address` asks the buffers).
        self.bases: npt.NDArray[np.uint64] | None = None
        #: Where the maker can give back the pages of these pieces once they
        #: are copied (the :class:`~mpshuffle.memory.postbox.Postbox`: pages
        #: shared with pieces of other partitions included, as the last of
        #: them goes), a function returning the bytes given back; else
        #: ``None``. See :meth:`release_pages`.
        self.give_back: Callable[[], int] | None = None
        #: Set by a reader that copied every byte of every piece into buffers
        #: of its own (:func:`~mpshuffle.table._columns.gather`), so that what
        #: it made holds no view of them: the extract task may then
        #: :meth:`release_pages`.
        self.copied = False
        n = len(self.pids)
        if not all(len(a) == n for a in (self.nrows, self.meta_of, self.buffer_of, self.offset, self.size)):
            raise ValueError("a PieceTable's arrays (pids, nrows, meta_of, buffer_of, offset, size) differ in length")
        if n:
            if self.meta_of.min() < 0 or self.meta_of.max() >= len(self.metas):
                raise ValueError(f"a PieceTable's meta_of is outside its {len(self.metas)} metadata")
            if self.buffer_of.min() < 0 or self.buffer_of.max() >= len(self.buffers):
                raise ValueError(f"a PieceTable's buffer_of is outside its {len(self.buffers)} buffers")
            sizes = np.array([b.size for b in self.buffers], np.int64)
            if (self.offset < 0).any() or (self.size < 0).any() or (
                self.offset + self.size > sizes[self.buffer_of]
            ).any():
                raise ValueError("a PieceTable's piece lies outside its buffer")

    @classmethod
    def _unchecked(
        cls, pids: npt.NDArray[np.int64], nrows: npt.NDArray[np.int64], meta_of: npt.NDArray[Any],
        metas: list[bytes], buffer_of: npt.NDArray[Any], offset: npt.NDArray[np.int64],
        size: npt.NDArray[np.int64], buffers: list[pa.Buffer], mapped: list[tuple[mmap.mmap, int] | None] | None = None,
        bases: npt.NDArray[np.uint64] | None = None,
    ) -> PieceTable:
        """A table of arrays that the caller built consistent (of these dtypes, ``pyarrow.Buffer`` buffers): no checks.

        ``bases``: each buffer's address, where the caller has them (see :attr:`address`).
        """
        table = cls.__new__(cls)
        table.pids, table.nrows, table.meta_of, table.metas = pids, nrows, meta_of, metas
        table.buffer_of, table.offset, table.size, table.buffers = buffer_of, offset, size, buffers
        table.mapped = mapped
        table.bases = bases
        table.give_back = None
        table.copied = False
        return table

    @classmethod
    def of_pieces(cls, pieces: Sequence[PackedData], pids: npt.ArrayLike | None = None) -> PieceTable:
        """The table of ``pieces`` (each piece's data a buffer of its own); ``pids`` default to zeros."""
        number: dict[int, int] = {}
        metas: list[bytes] = []
        for p in pieces:
            if id(p.metadata) not in number:
                number[id(p.metadata)] = len(metas)
                metas.append(p.metadata)
        n = len(pieces)
        return cls(
            pids=np.zeros(n, np.int64) if pids is None else pids,
            nrows=[p.nrows for p in pieces], meta_of=[number[id(p.metadata)] for p in pieces], metas=metas,
            buffer_of=np.arange(n, dtype=np.int32), offset=np.zeros(n, np.int64),
            size=[_buffer_size(p.data) for p in pieces], buffers=[p.data for p in pieces],
        )

    def __len__(self) -> int:
        return len(self.pids)

    @overload
    def __getitem__(self, i: int) -> PackedData: ...
    @overload
    def __getitem__(self, i: slice) -> PieceTable: ...
    def __getitem__(self, i: int | slice) -> PackedData | PieceTable:
        if isinstance(i, slice):
            return self.take(np.arange(len(self))[i])
        if not -len(self) <= i < len(self):
            raise IndexError(f"piece {i} of a table of {len(self)}")
        i = int(i) % len(self)
        off = int(self.offset[i])
        data = self.buffers[int(self.buffer_of[i])].slice(off, int(self.size[i]))
        return PackedData(self.metas[int(self.meta_of[i])], data, int(self.nrows[i]))

    def __iter__(self) -> Iterator[PackedData]:
        for i in range(len(self)):
            yield self[i]

    def __eq__(self, other: object) -> bool:
        """Equal to any sequence of the same pieces (metadata, bytes and rows), e.g. a list of them."""
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def take(self, indices: npt.ArrayLike) -> PieceTable:
        """The table of pieces ``indices`` (in that order), over the same metadata and buffers."""
        ix = np.asarray(indices, np.int64)
        if len(ix) and (ix.min() < -len(self) or ix.max() >= len(self)):
            raise IndexError(f"pieces {ix.min()}..{ix.max()} of a table of {len(self)}")
        return PieceTable._unchecked(
            self.pids[ix], self.nrows[ix], self.meta_of[ix], self.metas,
            self.buffer_of[ix], self.offset[ix], self.size[ix], self.buffers, self.mapped, self.bases,
        )

    def release_piece_pages(self, i: int, stop: int | None = None) -> int:
        """:meth:`release_pages` for piece ``i`` alone (or pieces ``i`` to ``stop - 1``), the table's mappings kept for the others.

        For a consumer that copies the pieces out one at a time (the rechunk's
        :meth:`~mpshuffle.table.ndarray.NDArrayAdapter.unpack`): a piece's
        pages go as soon as it is placed, so an extract never holds all of
        its received pieces (read, so resident) beside its output. A later
        :meth:`release_pages` gives those pages back a second time, which
        frees nothing more; call it only for the pieces not released here.

        Pieces that lie back to back in one mapping (a chunk's pieces of one
        partition, sent together) are given back by one ``madvise`` call
        per run of them: each call on a shared mapping flushes the TLBs of
        every CPU that runs one of the process's threads, and a rechunk at
        16 ranks places ~1,600 pieces of ~40 KB per extract.

        Returns
        -------
        int
            Bytes given back (0 where no piece is in a shared mapping).
        """
        mapped = self.mapped
        if not mapped or not hasattr(mmap, "MADV_REMOVE"):
            return 0
        stop = i + 1 if stop is None else stop
        page = mmap.PAGESIZE
        given = 0
        run: tuple[int, int, int] | None = None  # buffer, first byte, end byte
        for b, at, n in zip(self.buffer_of[i:stop].tolist(), self.offset[i:stop].tolist(),
                            self.size[i:stop].tolist(), strict=True):
            if run is not None and run[0] == b and run[2] == at:
                run = (b, run[1], at + n)
                continue
            if run is not None:
                given += self._release_range(*run, page)
            run = (b, at, at + n)
        if run is not None:
            given += self._release_range(*run, page)
        return given

    def _release_range(self, buffer: int, first: int, end: int, page: int) -> int:
        """Give back the whole pages of bytes ``first:end`` of buffer ``buffer``, where it lies in a mapping."""
        assert self.mapped is not None
        where = self.mapped[buffer]
        if where is None:
            return 0
        mapping, base = where
        lo = -(-(base + first) // page) * page
        hi = (base + end) // page * page
        if hi <= lo:
            return 0
        mapping.madvise(mmap.MADV_REMOVE, lo, hi - lo)
        return hi - lo

    def forget_mappings(self) -> None:
        """Drop the table's mappings: :meth:`release_pages` then gives nothing back (all given back already)."""
        self.mapped = None

    def release_pages(self) -> int:
        """Give the memory pages of pieces that lie in received messages back to the OS.

        For a consumer that has copied every byte it needs out of the pieces
        (a rechunk's extract: :attr:`~mpshuffle.table.base.FrameAdapter.copies_pieces`;
        a frame gathered into new buffers, :attr:`copied`) and will not read
        them again: a received message's pages were freed
        only when every piece of it was gone, and a message holds pieces of
        all the partitions its receiver owns, so a rank held every message
        it received until its last extract. Where the table came from a
        :class:`~mpshuffle.memory.postbox.Postbox` (:attr:`give_back`), the
        postbox gives back every page that only given-back pieces used:
        inside a piece at once, a page shared with pieces of other
        partitions once the last of them is given back (with thousands of
        partitions a piece is a few bytes, so most pages are shared), in
        shared-memory messages and in memory the message was received or
        packed into. Otherwise ``madvise(MADV_REMOVE)`` on each piece's whole
        pages in shared-memory messages (a page shared with a neighbouring
        piece stays); pieces in other memory are left alone. Afterwards the
        released bytes read as zeros; a second call does nothing.

        Returns
        -------
        int
            Bytes given back.
        """
        give_back, self.give_back = self.give_back, None
        if give_back is not None:
            self.mapped = None
            return give_back()
        mapped, self.mapped = self.mapped, None
        if not mapped or not len(self.pids) or not hasattr(mmap, "MADV_REMOVE"):
            return 0
        page = mmap.PAGESIZE
        released = 0
        for b, where in enumerate(mapped):
            if where is None:
                continue
            mapping, base = where
            mine = self.buffer_of == b
            starts = base + self.offset[mine]
            ends = starts + self.size[mine]
            order = np.argsort(starts, kind="stable")
            lo = -(-starts[order] // page) * page
            hi = ends[order] // page * page
            for a, z in zip(lo.tolist(), hi.tolist(), strict=True):
                if z > a:
                    mapping.madvise(mmap.MADV_REMOVE, a, z - a)
                    released += z - a
        return released

    @property
    def address(self) -> npt.NDArray[np.uint64]:
        """Each piece's data address in host memory (``uint64``, shape ``(n,)``).

        From :attr:`bases` where the table's maker gave them (the postbox
        keeps each received frame's address: an output partition of 2000
        inputs lies in ~450 frames, each of which ~200 extracts read), else
        from the buffers.
        """
        bases = self.bases
        if bases is None:
            bases = np.array([b.address for b in self.buffers], np.uint64)
        return bases[self.buffer_of] + self.offset.astype(np.uint64)

    @property
    def nbytes(self) -> int:
        """Bytes the pieces hold: their data and each metadata once."""
        return int(self.size.sum()) + sum(len(m) for m in self.metas)


class PackedPieces(Mapping[int, PackedData]):
    """The pieces of one insert by output partition id, as a :class:`PieceTable` (what :func:`pack` returns).

    A mapping ``{partition_id: PackedData}`` like the dict the adapters
    returned before, built per piece only where one is looked up; the
    shuffler reads :attr:`table`'s arrays instead.

    Parameters
    ----------
    table
        One piece per partition, its ``pids`` strictly ascending.

    Raises
    ------
    ValueError
        If ``table.pids`` is not strictly ascending.
    """

    __slots__ = ("table",)

    def __init__(self, table: PieceTable) -> None:
        if len(table) > 1 and not (np.diff(table.pids) > 0).all():
            raise ValueError("PackedPieces needs one piece per partition, by ascending partition id")
        self.table = table

    def __getitem__(self, pid: int) -> PackedData:
        pids = self.table.pids
        at = int(np.searchsorted(pids, pid))
        if at == len(pids) or pids[at] != pid:
            raise KeyError(pid)
        return self.table[at]

    def __iter__(self) -> Iterator[int]:
        return iter(self.table.pids.tolist())

    def __len__(self) -> int:
        return len(self.table)

    def __contains__(self, pid: object) -> bool:
        pids = self.table.pids
        try:
            at = int(np.searchsorted(pids, pid))  # type: ignore[call-overload]
        except (TypeError, ValueError):
            return False
        return at < len(pids) and pids[at] == pid


def _width(span: int) -> int:
    """Bytes of the narrowest unsigned integer holding ``0 .. span`` (0 for a span of 0)."""
    return _WIDTH_OF_BYTES[(span.bit_length() + 7) >> 3]


# Width in bytes (0, 1, 2, 4, 8) of an unsigned integer of at least k bytes, by k = 0 .. 8.
_WIDTH_OF_BYTES = (0, 1, 2, 4, 4, 8, 8, 8, 8)
# The ufuncs' own reductions: ndarray.min/max and np.diff pass through Python
# wrappers, a few microseconds each, and compact_ints runs six times a chunk.
_MIN, _MAX = np.minimum.reduce, np.maximum.reduce


def narrowest(values: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """``values`` (non-negative ``int64``) in the narrowest unsigned dtype that holds them, ``int64`` past 32 bits.

    ``int64`` rather than ``uint64`` for the widest, so that arrays of
    different widths concatenate to an integer dtype (``uint64`` with
    ``int64`` would give ``float64``).

    Parameters
    ----------
    values
        Integers, none negative.

    Returns
    -------
    numpy.ndarray
        ``uint8``, ``uint16``, ``uint32`` or ``int64``, equal values.
    """
    top = int(values.max()) if len(values) else 0
    return values.astype(_NATIVE[max(_width(top), 1)], copy=False)


def compact_ints(values: npt.ArrayLike, delta: bool = True) -> bytes:
    """``int64`` values in few bytes: their offsets from the smallest, in the narrowest unsigned width.

    Where the differences of neighbours span fewer bytes (ids in ascending
    order, offsets of back-to-back pieces) the differences are stored
    instead. Values that are all equal take no bytes past the header
    (17 bytes); arithmetic is modulo 2**64, so any ``int64`` values round-trip.

    Parameters
    ----------
    values
        One-dimensional integers that fit ``int64``.
    delta
        Whether to try the differences (a few array operations more; worth
        it for values in order).

    Returns
    -------
    bytes
        ``<Bqq``: the width in bytes (0, 1, 2, 4 or 8, ``| 0x10`` for
        differences), the count and the reference (the smallest value or
        difference); with differences the first value (``<q``); then the
        count (less one with differences) unsigned little-endian integers of
        that width, each value less the reference. Read by :func:`expand_ints`.
    """
    v = np.asarray(values)
    if v.dtype != np.int64:
        v = v.astype(np.int64)
    if v.ndim != 1:
        v = v.ravel()
    n = len(v)
    if n == 0:
        return _COMPACT.pack(0, 0, 0)
    lo, hi = int(_MIN(v)), int(_MAX(v))
    if lo == hi:
        return _COMPACT.pack(0, n, lo)
    stored, flag, head = v, 0, b""
    if delta and n > 2:
        diffs = v[1:] - v[:-1]  # modulo 2**64 (array arithmetic wraps silently): their sum is exact as well
        dlo, dhi = int(_MIN(diffs)), int(_MAX(diffs))
        if _width(dhi - dlo) < _width(hi - lo):
            stored, flag, head, lo, hi = diffs, _DELTA, _FIRST.pack(int(v[0])), dlo, dhi
    width = _width(hi - lo)
    out = _COMPACT.pack(width | flag, n, lo) + head
    if width:
        rel = stored.view(np.uint64) - np.uint64(lo % 2**64)
        out += rel.astype(_UNSIGNED[width]).tobytes()
    return out


def _expand(view: memoryview, offset: int) -> tuple[npt.NDArray[np.int64] | int, int, int]:
    """``(values, count, end)`` of :func:`compact_ints`' bytes at ``offset``; values equal to one another as that ``int``."""
    if offset < 0 or offset + _COMPACT.size > view.nbytes:
        raise ValueError(f"compact integers at byte {offset} of {view.nbytes}: no room for their header")
    tag, n, ref = _COMPACT.unpack_from(view, offset)
    width, delta = tag & 0x0F, bool(tag & _DELTA)
    at = offset + _COMPACT.size
    if width not in (0, 1, 2, 4, 8) or tag & ~(0x0F | _DELTA) or n < 0:
        raise ValueError(f"compact integers at byte {offset}: malformed header (tag {tag}, count {n})")
    if not delta:
        end = at + width * n
        if end > view.nbytes:
            raise ValueError(f"compact integers at byte {offset}: {n} of {width} bytes pass the end of {view.nbytes}")
        if not width:
            return ref, n, end
        stored = np.frombuffer(view, _UNSIGNED[width], n, at).astype(np.uint64)
        stored += np.uint64(ref % 2**64)
        return stored.view(np.int64), n, end
    if at + _FIRST.size > view.nbytes:
        raise ValueError(f"compact integers at byte {offset}: truncated")
    (first,) = _FIRST.unpack_from(view, at)
    at += _FIRST.size
    count = max(n - 1, 0)
    end = at + width * count
    if end > view.nbytes:
        raise ValueError(f"compact integers at byte {offset}: {count} of {width} bytes pass the end of {view.nbytes}")
    values = np.empty(n, np.uint64)
    if n:
        values[0] = first % 2**64
        values[1:] = np.frombuffer(view, _UNSIGNED[width], count, at) if width else 0
        values[1:] += np.uint64(ref % 2**64)
        np.cumsum(values, out=values)  # modulo 2**64, as the differences were taken
    return values.view(np.int64), n, end


def expand_ints(data: Any, offset: int = 0) -> tuple[npt.NDArray[np.int64], int]:
    """The values :func:`compact_ints` wrote at byte ``offset`` of ``data``, and the offset past them.

    Parameters
    ----------
    data
        A buffer-protocol object.
    offset
        Where the values start in ``data``, in bytes.

    Returns
    -------
    (values, end)
        ``int64`` values (a new array) and the byte offset just past them.

    Raises
    ------
    ValueError
        If ``data`` ends before the values or the header is malformed.
    """
    values, n, end = _expand(memoryview(data).cast("B"), offset)
    if isinstance(values, int):
        return np.full(n, values, np.int64), end
    return values, end
