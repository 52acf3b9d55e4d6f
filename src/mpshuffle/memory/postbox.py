"""The postbox: received chunks of output partitions, under the host budget.

The postbox is the host tier of the one store (:mod:`mpshuffle.memory.store`)
for the host runs, and follows its arrival rule (:func:`~mpshuffle.memory.store.admits`):
chunks are kept in memory while the host use of the worker's
:class:`BufferResource` stays within its budget; a chunk that would pass the
budget goes one tier down at once, into the store's
:class:`~mpshuffle.memory.store.DiskTier`, as its data frames (no per-row or
per-piece work, one ``writev`` into the rank's one spill file), and its
pieces' byte ranges are mapped back (read where the file cannot be mapped)
when their partition is popped.

A chunk is held as one :class:`Chunk`: its pieces' partitions, row counts,
metadata and byte ranges are arrays, so nothing is built per piece while it
waits (the cost of a chunk of thousands of one-row pieces is a few arrays,
not an object per piece). The first :meth:`Postbox.pop` after chunks
arrived indexes them all at once (their pieces as one segment of arrays, a
stable sort of their partition ids); a pop then gathers its one
partition's entries and returns them as a
:class:`~mpshuffle.memory.packed.PieceTable`, still without an object per
piece. A chunk is kept or
spilled as a whole (its pieces share its receive buffers) and accounted
until its last piece is popped.
"""

from __future__ import annotations

import functools
import itertools
import mmap
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from mpshuffle.errors import SpillError
from mpshuffle.memory._pages import libc as _libc
from mpshuffle.memory.packed import PackedData, PieceTable, _expand, compact_ints, narrowest
from mpshuffle.memory.resource import BufferResource, MemoryType, Reservation
from mpshuffle.memory.spill import SpillDirectory
from mpshuffle.memory.store import DiskTier, admits

__all__ = ["Chunk", "Postbox", "compact_pieces", "expand_pieces"]


def compact_pieces(
    pids: npt.ArrayLike, nrows: npt.ArrayLike, meta_of: npt.ArrayLike, frame_of: npt.ArrayLike,
    offset: npt.ArrayLike, size: npt.ArrayLike,
) -> bytes:
    """A chunk's piece arrays in few bytes (a chunk header's, read by :meth:`Chunk.received`).

    Each array by :func:`~mpshuffle.memory.packed.compact_ints`, in this
    order; ``offset`` as each piece's gap after the previous piece of its
    frame (0 for pieces back to back, as the shuffler sends them), so for
    ascending partition ids, small row counts and pieces of one frame a
    piece costs a few bytes, not 40.

    Parameters
    ----------
    pids, nrows, meta_of, frame_of, offset, size
        One entry per piece, as :class:`Chunk` takes them.

    Returns
    -------
    bytes
        The six arrays, one after another.
    """
    frame = np.asarray(frame_of, np.int64)
    off = np.asarray(offset, np.int64)
    sz = np.asarray(size, np.int64)
    gap = off.copy()
    if len(off) > 1:
        gap[1:] -= off[:-1] + sz[:-1]
        first = np.flatnonzero(frame[1:] != frame[:-1]) + 1  # a new run of one frame: its offset as it is
        gap[first] = off[first]
    return b"".join((
        compact_ints(pids), compact_ints(nrows, delta=False), compact_ints(meta_of, delta=False),
        compact_ints(frame, delta=False), compact_ints(gap, delta=False), compact_ints(sz, delta=False),
    ))


def _expand_pieces(data: Any) -> tuple[list[Any], int]:
    """:func:`compact_pieces`' arrays as :func:`expand_pieces` gives them, arrays of equal values as that ``int``; and their length."""
    view = memoryview(data).cast("B")
    arrays: list[Any] = []
    at = 0
    lengths = set()
    for _ in range(6):
        values, n, at = _expand(view, at)
        arrays.append(values)
        lengths.add(n)
    if len(lengths) != 1:
        raise ValueError("a chunk's piece arrays (pids, nrows, meta_of, frame_of, offset, size) differ in length")
    n = lengths.pop()
    frame_of, gap, size = arrays[3], arrays[4], arrays[5]
    sizes = np.full(n, size, np.int64) if isinstance(size, int) else size
    if isinstance(frame_of, int) and isinstance(gap, int):
        # One frame (as the shuffler sends them): the pieces' sizes, summed.
        offset = np.cumsum(sizes)
        offset -= sizes
        if gap:
            offset += gap * np.arange(1, n + 1)
    else:
        # offset = the gaps and the sizes of the pieces before, summed within each run of one frame.
        frames = np.full(n, frame_of, np.int64) if isinstance(frame_of, int) else frame_of
        step = np.full(n, gap, np.int64) if isinstance(gap, int) else gap.copy()
        step[1:] += sizes[:-1]
        change = np.ones(n, bool)
        change[1:] = frames[1:] != frames[:-1]
        starts = np.flatnonzero(change)
        step[starts] -= np.concatenate(([0], sizes[:-1]))[starts]  # a run's first piece: its gap alone
        total = np.cumsum(step)
        offset = total - (total[starts] - step[starts])[np.cumsum(change) - 1] if n else total
    arrays[4] = offset
    return arrays, n


def expand_pieces(data: Any) -> tuple[npt.NDArray[np.int64], ...]:
    """``(pids, nrows, meta_of, frame_of, offset, size)`` of :func:`compact_pieces`' bytes (``int64``).

    Raises
    ------
    ValueError
        If the bytes are truncated or malformed, or the arrays differ in length.
    """
    arrays, n = _expand_pieces(data)
    return tuple(np.full(n, a, np.int64) if isinstance(a, int) else a for a in arrays)


_PAGE = mmap.PAGESIZE
#: Pieces counted on their pages at a time when chunks are filed (bounds the temporary arrays).
_EDGE_BATCH = 1 << 18
#: Frames spanning fewer pages give none back before their chunk goes, and a frame's free pages
#: go back this many at least at a time (see ``Postbox._give_back``).
_GIVE_BACK_PAGES = 8
#: ``Postbox._edges`` of a page free to go back, not given back yet.
_FREE = -1
#: A frame's free pages go back in about this many calls (see ``Postbox._give_back``).
_GIVE_BACK_ROUNDS = 8
#: ``madvise`` advice that frees a shared mapping's pages in its file (``/dev/shm``).
_MADV_REMOVE = getattr(mmap, "MADV_REMOVE", 9)
#: ``madvise`` advice that frees private anonymous pages (they read as zeros after).
_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)


def _grown(values: npt.NDArray[Any], keep: int, size: int) -> npt.NDArray[Any]:
    """``values`` in an array of ``size`` entries, its first ``keep`` kept, the rest zeros."""
    grown = np.zeros(size, values.dtype)
    grown[:keep] = values[:keep]
    return grown


def _madvise_ranges(lo: npt.NDArray[np.int64], hi: npt.NDArray[np.int64], advice: npt.NDArray[Any]) -> int:
    """Give back pages ``lo[k] .. hi[k]`` (page numbers in memory, end excluded) with ``advice[k]``; bytes given back.

    Neighbouring ranges with the same advice go in one call. A call the
    kernel refuses gives nothing back (the pages stay, as they would
    without it).
    """
    if not len(lo):
        return 0
    lib = _libc()
    order = np.argsort(lo, kind="stable")
    lo, hi, advice = lo[order], hi[order], advice[order]
    joins = (lo[1:] == hi[:-1]) & (advice[1:] == advice[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    ends = np.append(starts[1:], len(lo)) - 1
    given = 0
    for a, z, how in zip(lo[starts].tolist(), hi[ends].tolist(), advice[starts].tolist(), strict=True):
        if lib.madvise(a * _PAGE, (z - a) * _PAGE, how) == 0:
            given += (z - a) * _PAGE
    return given


def _dtype_for(top: int) -> type[np.integer[Any]]:
    """The dtype :func:`~mpshuffle.memory.packed.narrowest` gives values up to ``top``."""
    return narrowest(np.array([max(top, 0)], np.int64)).dtype.type


def _low(values: npt.NDArray[np.int64] | int) -> int:
    return values if isinstance(values, int) else int(values.min())


def _high(values: npt.NDArray[np.int64] | int) -> int:
    return values if isinstance(values, int) else int(values.max())


def _mapping_of(frame: Any, buffer: pa.Buffer) -> tuple[mmap.mmap, int] | None:
    """``(mapping, offset of the frame in it)`` if ``frame`` is a memoryview of an ``mmap``, else ``None``."""
    mapping = frame.obj if isinstance(frame, memoryview) else None
    if not isinstance(mapping, mmap.mmap) or not buffer.size:
        return None
    return mapping, buffer.address - pa.py_buffer(mapping).address


class Chunk:
    """The pieces of one received chunk, as compact arrays: one object whatever their number.

    Piece ``k`` belongs to output partition ``pids[k]``, has ``nrows[k]``
    rows and metadata ``metas[meta_of[k]]``, and its data is the
    ``size[k]`` bytes at ``offset[k]`` of ``frames[frame_of[k]]``. Pieces of
    one partition are ordered by ``(input_index, attempt, src, seq + k)``:
    by input partition, then by their position in the sender's sequence.
    The arrays are held as :func:`compact_pieces` bytes (a few bytes a
    piece while the chunk waits to be filed; :meth:`arrays` expands them);
    once a :class:`Postbox` has filed the chunk under its partitions they
    are dropped (the postbox's arrays hold what they said).

    Parameters
    ----------
    input_index
        The input partition the pieces came from.
    attempt
        Id of the insert execution that sent them.
    src
        Rank that sent them.
    seq
        The sender's sequence number of the chunk's first piece.
    pids, nrows, meta_of, frame_of, offset, size
        One entry per piece (shape ``(n,)``, integers); ``offset`` and
        ``size`` in bytes.
    metas
        The distinct metadata of the pieces.
    frames
        The data frames (buffer-protocol objects) the pieces lie in.
    given
        Whether the frames' memory is the chunk's alone: nothing else reads
        or writes it (the sender packed it for these pieces and let it go,
        or the transport received it into memory of its own). Then a
        :class:`Postbox` may give the pages of pieces already popped and
        copied back to the OS before the chunk's last piece is popped (see
        :meth:`Postbox.pop`). Frames in a received shared-memory mapping
        are the chunk's alone whatever this says.

    Raises
    ------
    ValueError
        If the arrays differ in length, or a piece's metadata, frame or byte
        range is outside the chunk's.
    """

    __slots__ = (
        "attempt", "data_bytes", "file_at", "frames", "frames_at", "given", "input_index", "left", "mapped", "metas",
        "nbytes", "npieces", "pieces", "reservation", "seq", "src", "top_rows", "top_size",
    )

    def __init__(
        self, input_index: int, attempt: str, src: int, seq: int, *,
        pids: npt.ArrayLike, nrows: npt.ArrayLike, meta_of: npt.ArrayLike,
        frame_of: npt.ArrayLike, offset: npt.ArrayLike, size: npt.ArrayLike,
        metas: Sequence[bytes], frames: Sequence[Any], given: bool = False,
    ) -> None:
        arrays = [np.asarray(a) for a in (pids, nrows, meta_of, frame_of, offset, size)]
        if not all(len(a) == len(arrays[0]) for a in arrays):
            raise ValueError("a chunk's piece arrays (pids, nrows, meta_of, frame_of, offset, size) differ in length")
        self._set(input_index, attempt, src, seq, compact_pieces(*arrays), metas, frames, given)

    @classmethod
    def received(
        cls, input_index: int, attempt: str, src: int, seq: int, *, pieces: Any, metas: Sequence[bytes],
        frames: Sequence[Any], given: bool = False,
    ) -> Chunk:
        """A chunk whose piece arrays are :func:`compact_pieces` bytes (a received header's), kept as they are.

        Raises
        ------
        ValueError
            As the constructor, or if ``pieces`` is malformed.
        """
        chunk = cls.__new__(cls)
        chunk._set(input_index, attempt, src, seq, bytes(pieces), metas, frames, given)
        return chunk

    def _set(
        self, input_index: int, attempt: str, src: int, seq: int, pieces: bytes, metas: Sequence[bytes],
        frames: Sequence[Any], given: bool,
    ) -> None:
        self.input_index, self.attempt, self.src, self.seq = input_index, attempt, src, seq
        self.given = bool(given)
        self.pieces = pieces
        self.metas = list(metas)
        self.frames: list[Any] | None = [f if isinstance(f, pa.Buffer) else pa.py_buffer(f) for f in frames]
        #: Per frame, ``(mapping, offset)`` where it is a view of a shared
        #: memory mapping (a message received through ``/dev/shm``), else
        #: ``None``: what :meth:`PieceTable.release_pages` may give back.
        self.mapped: list[tuple[mmap.mmap, int] | None] = [
            _mapping_of(f, buf) for f, buf in zip(frames, self.frames, strict=True)
        ]
        (_, nrows, meta_of, frame_of, offset, size), n = _expand_pieces(pieces)
        sizes = np.full(n, size, np.int64) if isinstance(size, int) else size
        #: The number of pieces, and the largest row count and size among them (0 without pieces).
        self.npieces, self.top_rows, self.top_size = n, _high(nrows) if n else 0, _high(size) if n else 0
        if n:
            if _low(meta_of) < 0 or _high(meta_of) >= len(self.metas):
                raise ValueError(f"a chunk's piece names a metadata outside its {len(self.metas)}")
            if _low(frame_of) < 0 or _high(frame_of) >= len(self.frames):
                raise ValueError(f"a chunk's piece names a frame outside its {len(self.frames)}")
            frame_sizes = np.array([f.size for f in self.frames], np.int64)
            ends = offset + sizes
            if isinstance(frame_of, int):
                outside = sizes.min() < 0 or offset.min() < 0 or ends.max() > frame_sizes[frame_of]
            else:
                outside = bool((offset < 0).any() or (sizes < 0).any() or (ends > frame_sizes[frame_of]).any())
            if outside:
                raise ValueError("a chunk's piece lies outside its frame")
        #: Bytes of the pieces' data.
        self.data_bytes = int(sizes.sum())
        #: Bytes the chunk holds: its pieces' data and each metadata once.
        self.nbytes = self.data_bytes + sum(len(m) for m in self.metas)
        self.left = n
        self.reservation: Reservation | None = None
        self.file_at: npt.NDArray[np.int64] | None = None  # each frame's offset in the spill file
        self.frames_at = 0  # where its frames start in the postbox's frame list, once indexed

    def arrays(self) -> tuple[npt.NDArray[np.int64], ...]:
        """``(pids, nrows, meta_of, frame_of, offset, size)``, ``int64`` (empty once filed)."""
        return expand_pieces(self.pieces)

    @classmethod
    def of_pieces(
        cls, input_index: int, attempt: str, src: int, seq: int,
        pieces: Sequence[tuple[int, PackedData]],
    ) -> Chunk:
        """A chunk of ``(partition id, piece)`` pairs, each piece's data a frame of its own."""
        t = PieceTable.of_pieces([p for _, p in pieces], [pid for pid, _ in pieces])
        return cls(
            input_index, attempt, src, seq, pids=t.pids, nrows=t.nrows, meta_of=t.meta_of,
            frame_of=t.buffer_of, offset=t.offset, size=t.size, metas=t.metas, frames=t.buffers,
        )

    def order(self) -> tuple[int, str, int, int]:
        """``(input_index, attempt, src, seq)``: what orders this chunk's pieces among others."""
        return (self.input_index, self.attempt, self.src, self.seq)


class Postbox:
    """Chunks of this rank's output partitions, popped by partition id.

    Every chunk held in memory is accounted as host memory in the
    :class:`BufferResource`; spilled chunks are accounted as disk.

    Parameters
    ----------
    resource
        The worker's buffer resource (host budget, spill directory, owner).
    name
        Names the postbox; its spill directory is
        ``<resource.spill_dir>/<resource.spill_prefix>-<name>``.

    Attributes
    ----------
    disk
        The store's disk tier for this postbox (its one spill file); its
        counters are :attr:`bytes_spilled`, :attr:`bytes_unspilled`,
        :attr:`seconds_spill` and :attr:`seconds_unspill`.
    """

    def __init__(self, resource: BufferResource, name: str) -> None:
        self.resource = resource
        self.name = name
        self.spill = SpillDirectory(resource.spill_path(name), owner=resource.owner)
        self.disk = DiskTier(self.spill)
        self._lock = threading.Lock()
        self._error: SpillError | None = None
        self._reset()

    def _reset(self) -> None:
        self._chunks: list[Chunk | None] = []
        self._left = np.zeros(16, np.int64)  # pieces of each chunk not popped yet
        self._unindexed: list[int] = []
        # Per chunk, what orders its pieces (filled by _index, as arrays).
        self._orders: list[tuple[int, int, int, int]] = []  # (input_index, attempt number, src, seq)
        self._order_arrays = np.zeros((4, 0), np.int64)
        self._attempts: dict[str, int] = {}
        self._attempt_rank = np.zeros(0, np.int64)
        self._kept = np.zeros(0, np.int8)  # per chunk: -1 not asked yet, 0 dropped, 1 kept
        self._kept_by: Any = None
        # Distinct metadata (by value) and the in-memory chunks' frames, numbered.
        self._metas: dict[bytes, int] = {}
        self._meta_list: list[bytes] = []
        self._frames: list[Any] = []
        self._frame_maps: list[tuple[mmap.mmap, int] | None] = []  # per frame, Chunk.mapped
        # Per frame, its address (the first len(self._frames) entries; grown by doubling).
        self._frame_addr = np.zeros(16, np.uint64)
        # Pages of popped pieces given back (see _give_back): per frame its
        # end address, the madvise advice that frees its pages (0: none may
        # be) and the number of its first page in _edges; per page of the
        # frames that may give pages back, the pieces not given back yet
        # that begin or end on it (a page inside a piece is that piece's alone).
        self._frame_end = np.zeros(16, np.uint64)
        self._frame_advice = np.zeros(16, np.int8)
        self._frame_page = np.zeros(16, np.int64)
        # Per frame, its pages in _edges, and its free edge pages not given
        # back yet (they go together, see _give_back).
        self._frame_pages = np.zeros(16, np.int64)
        self._frame_waiting = np.zeros(16, np.int64)
        self._edges = np.zeros(0, np.int32)
        self._npages = 0
        self._epoch = getattr(self, "_epoch", 0) + 1  # a table popped before a clear gives nothing back after it
        # partition id -> [(segment, piece numbers in it)], filled by _index.
        self._where: dict[int, list[tuple[_Segment, npt.NDArray[Any]]]] = {}
        self._held = {MemoryType.HOST: 0, MemoryType.DISK: 0}

    def add(self, partition_id: int, order: tuple[int, str, int, int], piece: PackedData) -> None:
        """Hold ``piece`` of output partition ``partition_id``, ordered by ``order`` (see :class:`Chunk`).

        Raises
        ------
        SpillError
            As :meth:`add_chunk`.
        """
        self.add_chunk(Chunk.of_pieces(*order, [(partition_id, piece)]))

    def add_chunk(self, chunk: Chunk) -> None:
        """Hold the pieces of one received chunk, in memory or spilled together.

        Raises
        ------
        SpillError
            If spilling failed (e.g. the disk is full). The run's spill
            files are removed, and every later call raises the same error.
        """
        if self._error is not None:
            raise self._error
        if not chunk.left:
            return
        if admits(self.resource, MemoryType.HOST, chunk.nbytes) or (
            self.resource.reclaim(MemoryType.HOST) and admits(self.resource, MemoryType.HOST, chunk.nbytes)
        ):
            tier = MemoryType.HOST
        else:
            frames = chunk.frames or []
            try:
                ranges = self.disk.put(frames)
            except SpillError as e:
                self._fail(e)
                raise
            chunk.file_at = np.array([at for at, _ in ranges], np.int64)
            chunk.frames = None
            chunk.mapped = []  # the mapping goes with its frames
            chunk.nbytes = sum(n for _, n in ranges)
            tier = MemoryType.DISK
        with self._lock:
            chunk.reservation = self.resource.reserve(tier, chunk.nbytes)
            self._held[tier] += chunk.nbytes
            number = len(self._chunks)
            if number == len(self._left):
                self._left = np.concatenate((self._left, np.zeros(len(self._left), np.int64)))
            self._left[number] = chunk.left
            self._unindexed.append(number)
            self._chunks.append(chunk)

    def move_to_disk(self) -> int:
        """Move every chunk held in memory to the disk tier; returns the bytes moved.

        For a worker whose memory manager stopped it (Dask pauses a worker
        above its pause fraction and starts no task): the chunks a run holds
        in memory are memory Dask cannot spill, and with no task running no
        partition is extracted to free them, so the worker would stay paused.
        Moved chunks are read back by range at their extracts, as chunks
        spilled on arrival are. Pieces already popped are not affected.

        Returns
        -------
        int
            Bytes written to the spill file (the chunks' frames, whole; 0 if
            nothing was held in memory).

        Raises
        ------
        SpillError
            If writing failed; the run's spill files are removed, and every
            later call raises the same error.
        """
        if self._error is not None:
            raise self._error
        moved = 0
        with self._lock:
            held = [
                (c, ch) for c, ch in enumerate(self._chunks)
                if ch is not None and ch.frames is not None and ch.reservation is not None
                and ch.reservation.memory_type is MemoryType.HOST and self._left[c] > 0
            ]
            if not held:
                return 0
            indexed = set(self._unindexed)
            file_of_frame = np.full(len(self._frames), -1, np.int64)
            for c, ch in held:
                frames = ch.frames or []
                try:
                    ranges = self.disk.put(frames)
                except SpillError as e:
                    self._error = e
                    raise
                file_at = np.array([at for at, _ in ranges], np.int64)
                if c not in indexed:  # filed under its partitions: its pieces name global frame numbers
                    file_of_frame[ch.frames_at : ch.frames_at + len(frames)] = file_at
                    self._frames[ch.frames_at : ch.frames_at + len(frames)] = [None] * len(frames)
                    self._frame_maps[ch.frames_at : ch.frames_at + len(frames)] = [None] * len(frames)
                ch.file_at = file_at
                ch.frames = None
                ch.mapped = []  # the mapping goes with its frames
                assert ch.reservation is not None
                self._held[MemoryType.HOST] -= ch.reservation.nbytes
                ch.reservation.release()
                ch.nbytes = sum(n for _, n in ranges)
                ch.reservation = self.resource.reserve(MemoryType.DISK, ch.nbytes)
                self._held[MemoryType.DISK] += ch.nbytes
                moved += ch.nbytes
            if (file_of_frame >= 0).any():
                seen: set[int] = set()
                for entries in self._where.values():
                    for segment, _ in entries:
                        if id(segment) in seen:
                            continue
                        seen.add(id(segment))
                        in_memory = np.flatnonzero(segment.frame >= 0)
                        to = file_of_frame[segment.frame[in_memory]]
                        now = in_memory[to >= 0]
                        segment.position = segment.position.astype(np.int64)  # file positions pass 32 bits
                        segment.position[now] += to[to >= 0]
                        segment.frame[now] = -1
        return moved

    def _fail(self, error: SpillError) -> None:
        self._error = error
        self.clear()

    def _meta_number(self, meta: bytes) -> int:
        number = self._metas.get(meta)
        if number is None:
            number = self._metas[meta] = len(self._meta_list)
            self._meta_list.append(meta)
        return number

    def _index(self) -> None:
        """File the chunks that arrived since the last pop under their partitions (under the lock).

        All their pieces become one :class:`_Segment` (arrays over the
        pieces); each partition gets the numbers of its pieces in it, from
        one stable sort. The segment's arrays are made at their final
        (narrow) dtypes first, from bounds their chunks' headers give, and
        filled chunk by chunk, so that filing holds little more than the
        segment itself: with every chunk's pieces expanded at once, the
        first extract of 2000 -> 2000 partitions of 20,000 rows held
        ~190 MB a worker beside its ~40 MB segment (2 M pieces).
        """
        if not self._unindexed:
            return
        numbers = self._unindexed
        self._unindexed = []
        chunks: list[Chunk] = [self._chunks[c] for c in numbers]  # type: ignore[misc]
        counts = np.array([ch.npieces for ch in chunks], np.int64)
        position_top = 0
        for ch in chunks:
            for m in ch.metas:
                self._meta_number(m)
            frame_bytes = max((f.size for f in ch.frames), default=0) if ch.frames is not None else ch.nbytes
            top = frame_bytes + (int(ch.file_at.max()) if ch.file_at is not None and len(ch.file_at) else 0)
            position_top = max(position_top, top)
        n = int(counts.sum())
        segment = _Segment(
            chunk=np.repeat(np.asarray(numbers, np.uint32), counts),
            nrows=np.empty(n, _dtype_for(max((ch.top_rows for ch in chunks), default=0))),
            meta=np.empty(n, _dtype_for(len(self._meta_list))), frame=np.empty(n, np.int32),
            position=np.empty(n, _dtype_for(position_top)),
            size=np.empty(n, _dtype_for(max((ch.top_size for ch in chunks), default=0))),
        )
        pids = np.empty(n, np.int64)
        first_frame = len(self._frames)
        given: list[bool] = []
        at = 0
        for ch, count in zip(chunks, counts.tolist(), strict=True):
            key = (ch.input_index, self._attempts.setdefault(ch.attempt, len(self._attempts)), ch.src, ch.seq)
            self._orders.append(key)
            part = slice(at, at + count)
            at += count
            pids[part], segment.nrows[part], meta_of, frame_of, offset, segment.size[part] = ch.arrays()
            segment.meta[part] = np.array([self._metas[m] for m in ch.metas], np.int64)[meta_of]
            if ch.frames is not None:
                ch.frames_at = len(self._frames)
                self._frames.extend(ch.frames)
                self._frame_maps.extend(ch.mapped)
                given.extend([ch.given] * len(ch.frames))
                segment.frame[part] = frame_of + ch.frames_at
                segment.position[part] = offset
            else:
                assert ch.file_at is not None
                segment.frame[part] = -1
                segment.position[part] = ch.file_at[frame_of] + offset
            ch.pieces = _NO_PIECES  # the segment holds what they said
        if given:
            self._note_addresses(first_frame, given)
            for lo in range(0, n, _EDGE_BATCH):
                self._count_edges(segment, slice(lo, lo + _EDGE_BATCH))
        self._order_arrays = np.array(self._orders, np.int64).reshape(-1, 4).T
        if len(self._attempt_rank) != len(self._attempts):  # attempt number -> its rank by value
            self._attempt_rank = np.argsort(np.argsort(np.array(list(self._attempts), dtype=object)))
        by_pid = narrowest(np.argsort(pids, kind="stable"))
        sorted_pids = pids[by_pid]
        del pids
        cuts = np.flatnonzero(sorted_pids[1:] != sorted_pids[:-1]) + 1
        bounds = np.concatenate(([0], cuts, [n])).tolist()
        for lo, hi in itertools.pairwise(bounds):
            if lo < hi:
                self._where.setdefault(int(sorted_pids[lo]), []).append((segment, by_pid[lo:hi]))

    def _note_addresses(self, at: int, given: Sequence[bool]) -> None:
        """Remember the addresses of the frames from number ``at`` on, and how their pages may go (under the lock).

        ``given``: per frame, its chunk's ``given``.
        """
        frames, mapped = self._frames[at:], self._frame_maps[at:]
        end = at + len(frames)
        if end > len(self._frame_addr):
            size = max(end, 2 * len(self._frame_addr))
            self._frame_addr = _grown(self._frame_addr, at, size)
            self._frame_end = _grown(self._frame_end, at, size)
            self._frame_advice = _grown(self._frame_advice, at, size)
            self._frame_page = _grown(self._frame_page, at, size)
            self._frame_pages = _grown(self._frame_pages, at, size)
            self._frame_waiting = _grown(self._frame_waiting, at, size)
        addr = np.array([f.address for f in frames], np.uint64)  # Chunk's frames are pyarrow Buffers
        self._frame_addr[at:end] = addr
        self._frame_end[at:end] = addr + np.array([f.size for f in frames], np.uint64)
        advice = [
            _MADV_REMOVE if m is not None else _MADV_DONTNEED if g else 0 for m, g in zip(mapped, given, strict=True)
        ] if _libc() is not None else [0] * len(frames)
        self._frame_advice[at:end] = advice
        # Page numbers in _edges for the frames whose pages may go: those of
        # a few pages or more (a smaller frame has at most a page or two
        # wholly its own, not worth the accounting).
        first = (addr // _PAGE).astype(np.int64)
        npages = ((self._frame_end[at:end] + (_PAGE - 1)) // _PAGE).astype(np.int64) - first
        small = npages < _GIVE_BACK_PAGES
        npages[small | (self._frame_advice[at:end] == 0)] = 0
        self._frame_advice[at:end][small] = 0
        self._frame_page[at:end] = self._npages + np.cumsum(npages) - npages
        self._frame_pages[at:end] = npages
        self._npages += int(npages.sum())
        if self._npages > len(self._edges):
            self._edges = _grown(self._edges, len(self._edges), max(self._npages, 2 * len(self._edges)))

    def _count_edges(self, segment: _Segment, part: slice) -> None:
        """Count pieces ``part`` of ``segment``, in memory, on the pages they share (see :meth:`_give_back`;
        under the lock)."""
        if not self._npages:
            return
        frame = segment.frame[part].astype(np.int64)
        size = segment.size[part]
        mine = (frame >= 0) & (size > 0)
        mine[mine] = self._frame_advice[frame[mine]] != 0
        if not mine.any():
            return
        pages, _, _, _, _ = self._pages_of(frame[mine], segment.position[part][mine], size[mine])
        if len(pages):
            lo, hi = int(pages.min()), int(pages.max()) + 1
            self._edges[lo:hi] += np.bincount(pages - lo, minlength=hi - lo).astype(np.int32)

    def _pages_of(
        self, frame: npt.NDArray[np.int64], position: npt.NDArray[Any], size: npt.NDArray[Any]
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64],
               npt.NDArray[np.int64]]:
        """The pages of pieces (in frames that give pages back): ``(edges, edge_frame, lo, hi, whole_frame)``.

        ``edges`` are the numbers in :attr:`_edges` of the pages a piece
        covers in part (where it begins or ends beside other bytes), with
        the frame of each; ``lo .. hi`` (page numbers in memory, end
        excluded) the pages each piece covers wholly, in frame ``whole_frame``.
        """
        start = self._frame_addr[frame].astype(np.int64) + position.astype(np.int64)
        end = start + size.astype(np.int64)
        first, last = start // _PAGE, (end - 1) // _PAGE
        lo, hi = -(-start // _PAGE), end // _PAGE
        some = lo < hi
        part_first = (first < lo) | (first >= hi)
        part_last = (last != first) & (last >= hi)
        shift = self._page_shift(frame)
        edges = np.concatenate(((first - shift)[part_first], (last - shift)[part_last]))
        return edges, np.concatenate((frame[part_first], frame[part_last])), lo[some], hi[some], frame[some]

    def _give_back(
        self, epoch: int, frame: npt.NDArray[np.int64], position: npt.NDArray[Any], size: npt.NDArray[Any]
    ) -> int:
        """Give back the pages that only popped and copied pieces used, as the last of them is given up.

        ``frame``, ``position`` and ``size`` are pieces of one popped table
        in frames whose pages may go (:class:`Chunk`'s ``given``, or a shared
        mapping). The pages a piece covers wholly are its own and go at once.
        A page pieces share is free when no piece counted on it is left (and
        it lies wholly inside its frame); a frame's free pages go together,
        once they are :data:`_GIVE_BACK_ROUNDS`-th of its pages (and at least
        :data:`_GIVE_BACK_PAGES`): with thousands of partitions a piece is
        a few hundred bytes, each extract frees about one page of each frame
        it reads, and one ``madvise`` per page (~40 µs each on the loaded
        2-core VM, its TLB shootdowns waiting for the other vCPU) cost ~10
        CPU-s at 2000 -> 2000 partitions of 20,000 rows. As a rank extracts
        in partition order its frames free pages together, so about a
        ``_GIVE_BACK_ROUNDS``-th of what it holds waits at most. The table
        that calls this holds its frames, so every page given back is still
        theirs.
        """
        with self._lock:
            if epoch != self._epoch or not len(frame):
                return 0
            pages, owner, lo, hi, whole_frame = self._pages_of(frame, position, size)
            pages, at, times = np.unique(pages, return_index=True, return_counts=True)
            self._edges[pages] -= times.astype(np.int32)
            free = self._edges[pages] == 0
            pages, owner = pages[free], owner[at[free]]
            shift = self._page_shift(owner)
            inside = ((pages + shift) * _PAGE >= self._frame_addr[owner].astype(np.int64)) & (
                (pages + shift + 1) * _PAGE <= self._frame_end[owner].astype(np.int64))
            self._edges[pages[inside]] = _FREE
            frames, waiting = np.unique(owner[inside], return_counts=True)
            self._frame_waiting[frames] += waiting
            batch = np.maximum(self._frame_pages[frames] // _GIVE_BACK_ROUNDS, _GIVE_BACK_PAGES)
            full = frames[self._frame_waiting[frames] >= batch]
            los, his, advice = [lo], [hi], [self._frame_advice[whole_frame]]
            for f in full.tolist():
                base = int(self._frame_page[f])
                span = self._edges[base : base + int(self._frame_pages[f])]
                ready = np.flatnonzero(span == _FREE)
                span[ready] = 0
                self._frame_waiting[f] = 0
                ready += base + int(self._page_shift(np.array([f]))[0])
                los.append(ready)
                his.append(ready + 1)
                advice.append(np.full(len(ready), self._frame_advice[f], np.int8))
        return _madvise_ranges(np.concatenate(los), np.concatenate(his), np.concatenate(advice))

    def _page_shift(self, frame: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Per frame, its page number in memory less its page number in :attr:`_edges`."""
        return (self._frame_addr[frame] // _PAGE).astype(np.int64) - self._frame_page[frame]

    def pop(
        self, partition_id: int, keep: Callable[[tuple[int, str, int, int]], bool] | None = None
    ) -> PieceTable:
        """Remove and return the pieces of ``partition_id``, in their order (see :class:`Chunk`).

        ``keep(chunk.order())``, if given, selects the chunks whose pieces
        are returned; the others' are dropped (and not read back from disk).
        It is asked once per chunk while it is the same function.

        Spilled pieces come back as read-only mappings of their byte ranges
        of the spill file (:meth:`~mpshuffle.memory.store.DiskTier.view`:
        one per piece, no copy), or where the file cannot be mapped, read
        into one buffer (one read of each piece's range) and returned as
        zero-copy slices of it.

        Returns
        -------
        PieceTable
            The pieces (empty if there are none): their arrays, over the
            chunks' frames and the spilled pieces' mappings (or read-back
            buffer); no object is built per piece until one is asked for.

        Raises
        ------
        SpillError
            If the run's spilling failed before, or the spill file cannot be read.
        """
        if self._error is not None:
            raise self._error
        with self._lock:
            self._index()
            found = self._where.pop(partition_id, [])
            if not found:
                return _empty_table()
            pieces = _Segment.joined(found)
            if keep is not None:
                kept = self._kept_mask(pieces.chunk, keep)
                if not kept.all():
                    self._done(pieces.chunk[~kept])
                    pieces = pieces.take(np.flatnonzero(kept))
            if not len(pieces.chunk):
                return _empty_table()
            # A chunk's pieces come in its order (the order of the segment), so
            # sorting by chunk, stably, orders them by the sender's sequence.
            inp, att, src, seq = self._order_arrays[:, pieces.chunk]
            pieces = pieces.take(np.lexsort((seq, src, self._attempt_rank[att], inp)))
            in_memory = pieces.frame >= 0
            frames, frame_at = np.unique(pieces.frame[in_memory], return_inverse=True)
            frame_list = frames.tolist()
            buffers = [self._frames[f] for f in frame_list]
            bases = self._frame_addr[frames]
            mapped = [self._frame_maps[f] for f in frame_list]
            metas, meta_of = np.unique(pieces.meta, return_inverse=True)
            meta_list = [self._meta_list[m] for m in metas.tolist()]
            give_back = None
            if self._npages:
                mine = np.flatnonzero(in_memory)
                mine = mine[self._frame_advice[pieces.frame[mine]] != 0]
                mine = mine[pieces.size[mine] > 0]
                if len(mine):
                    give_back = functools.partial(
                        self._give_back, self._epoch, pieces.frame[mine].astype(np.int64),
                        pieces.position[mine], pieces.size[mine],
                    )
        buffer_of = np.full(len(pieces.chunk), len(buffers), np.int32)
        buffer_of[in_memory] = frame_at
        offset = pieces.position.astype(np.int64)
        if not in_memory.all():
            on_disk = np.flatnonzero(~in_memory)
            ranges = list(zip(pieces.position[on_disk].tolist(), pieces.size[on_disk].tolist(), strict=True))
            try:
                read_back = self.disk.view(ranges)
            except SpillError as e:
                with self._lock:
                    self._done(pieces.chunk)
                self._fail(e)
                raise
            # One buffer per distinct read-back buffer (a mapping per piece,
            # or one buffer they all share where the file was read instead).
            seen: dict[int, int] = {}
            for k, (buf, at) in zip(on_disk.tolist(), read_back, strict=True):
                number = seen.get(id(buf))
                if number is None:
                    number = seen[id(buf)] = len(buffers)
                    buffers.append(pa.py_buffer(buf))
                buffer_of[k] = number
                offset[k] = at
        table = PieceTable._unchecked(
            np.full(len(pieces.chunk), partition_id, np.int64), pieces.nrows.astype(np.int64),
            meta_of.astype(np.int32), meta_list, buffer_of, offset, pieces.size.astype(np.int64), buffers,
            # count(None) in C: a generator over the ~450 frames of a 2000 -> 2000
            # output partition cost ~0.1 ms a pop where none is mapped.
            mapped + [None] * (len(buffers) - len(mapped)) if mapped.count(None) < len(mapped) else None,
            bases if len(bases) == len(buffers) else None,  # with spilled pieces' buffers: asked of them
        )
        table.give_back = give_back
        with self._lock:
            self._done(pieces.chunk)
        return table

    def _kept_mask(
        self, chunk: npt.NDArray[np.int64], keep: Callable[[tuple[int, str, int, int]], bool]
    ) -> npt.NDArray[np.bool_]:
        """Whether each piece's chunk is kept by ``keep`` (asked once per chunk; under the lock).

        The verdicts are an array by chunk number, so a pop asks ``keep`` only
        for chunks no earlier pop asked about: an output partition has pieces
        from up to one chunk per input, and looking each one up in Python on
        every pop cost ~1 ms a pop at 2000 -> 2000.
        """
        if keep != self._kept_by:  # not `is`: a bound method is a new object at every access
            self._kept, self._kept_by = np.zeros(0, np.int8), keep
        if len(self._kept) < len(self._chunks):
            grown = np.full(max(len(self._chunks), 2 * len(self._kept)), -1, np.int8)
            grown[: len(self._kept)] = self._kept
            self._kept = grown
        verdict = self._kept[chunk]
        unknown = verdict < 0
        if unknown.any():
            for c in np.unique(chunk[unknown]).tolist():
                ch = self._chunks[c]
                self._kept[c] = bool(keep(ch.order())) if ch is not None else False
            verdict = self._kept[chunk]
        return verdict.astype(np.bool_)

    def _done(self, cn: npt.NDArray[np.int64]) -> None:
        """Count the pieces of chunks ``cn`` (one entry per piece) as gone (under the lock)."""
        if not len(cn):
            return
        numbers, counts = np.unique(cn, return_counts=True)
        numbers, counts = numbers[numbers < len(self._chunks)], counts[numbers < len(self._chunks)]  # cleared meanwhile
        self._left[numbers] -= counts
        held = self._held
        for c in numbers[self._left[numbers] <= 0].tolist():
            ch = self._chunks[c]
            if ch is None:
                continue
            reservation = ch.reservation
            if reservation is not None and reservation.nbytes:
                held[reservation.memory_type] -= reservation.nbytes
                reservation.release()
            if ch.frames is not None:
                self._frames[ch.frames_at : ch.frames_at + len(ch.frames)] = [None] * len(ch.frames)
                self._frame_maps[ch.frames_at : ch.frames_at + len(ch.frames)] = [None] * len(ch.frames)
            self._chunks[c] = None  # its frames go now

    @property
    def bytes_spilled(self) -> int:
        """Bytes of piece data written to disk so far."""
        return self.disk.bytes_written

    @property
    def bytes_unspilled(self) -> int:
        """Bytes of piece data read back from disk so far."""
        return self.disk.bytes_read

    @property
    def seconds_spill(self) -> float:
        """Wall time spent writing the spill file, in seconds."""
        return self.disk.seconds_write

    @property
    def seconds_unspill(self) -> float:
        """Wall time spent reading the spill file, in seconds."""
        return self.disk.seconds_read

    @property
    def nbytes(self) -> int:
        """Bytes of the chunks held in memory (spilled ones not counted; a chunk counts until its last piece is popped)."""
        with self._lock:
            return self._held[MemoryType.HOST]

    @property
    def nbytes_spilled(self) -> int:
        """Bytes of the chunks on disk whose pieces are not all popped yet."""
        with self._lock:
            return self._held[MemoryType.DISK]

    def clear(self) -> None:
        """Drop every piece, release its memory and delete the spill files. Idempotent."""
        with self._lock:
            for ch in self._chunks:
                if ch is not None and ch.reservation is not None:
                    ch.reservation.release()
            self._reset()
        self.spill.remove()


class _Segment:
    """Pieces of the chunks one :meth:`Postbox._index` filed, as arrays (one entry per piece).

    ``chunk`` is the postbox's chunk number (``uint32``), ``nrows`` the
    piece's rows, ``meta`` the postbox's metadata number, ``frame`` the
    postbox's frame number (``int32``, ``-1`` for a spilled chunk),
    ``position`` the byte offset in that frame (in the spill file for a
    spilled chunk) and ``size`` its bytes; each in the narrowest dtype its
    values need (:func:`~mpshuffle.memory.packed.narrowest`). The pieces of
    one chunk follow each other in their order in the chunk.
    """

    __slots__ = ("chunk", "frame", "meta", "nrows", "position", "size")

    def __init__(
        self, *, chunk: npt.NDArray[Any], nrows: npt.NDArray[Any], meta: npt.NDArray[Any],
        frame: npt.NDArray[Any], position: npt.NDArray[Any], size: npt.NDArray[Any],
    ) -> None:
        self.chunk, self.nrows, self.meta = chunk, nrows, meta
        self.frame, self.position, self.size = frame, position, size

    def take(self, ix: npt.NDArray[Any]) -> _Segment:
        return _Segment(**{k: getattr(self, k)[ix] for k in self.__slots__})

    @staticmethod
    def joined(parts: Sequence[tuple[_Segment, npt.NDArray[Any]]]) -> _Segment:
        """The pieces ``ix`` of each ``(segment, ix)``, one after another."""
        if len(parts) == 1:
            segment, ix = parts[0]
            return segment.take(ix)
        return _Segment(**{
            k: np.concatenate([getattr(seg, k)[ix] for seg, ix in parts]) for k in _Segment.__slots__
        })


_NO_PIECES = compact_pieces([], [], [], [], [], [])


def _empty_table() -> PieceTable:
    return PieceTable.of_pieces([])
