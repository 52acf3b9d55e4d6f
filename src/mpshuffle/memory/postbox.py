"""The postbox: received chunks of output partitions, under the host budget.

The postbox is the host tier of the one store (:mod:`mpshuffle.memory.store`)
for the host runs, and follows its arrival rule (:func:`~mpshuffle.memory.store.admits`):
chunks are kept in memory while the host use of the worker's
:class:`BufferResource` stays within its budget; a chunk that would pass the
budget goes one tier down at once, into the store's
:class:`~mpshuffle.memory.store.DiskTier`, as its data frames (no per-row or
per-piece work, one ``writev`` into the rank's one spill file), and its
pieces' byte ranges are read back when their partition is popped.

A chunk is held as one :class:`Chunk`: its pieces' partitions, row counts,
metadata and byte ranges are arrays, so nothing is built per piece while it
waits (the cost of a chunk of thousands of one-row pieces is a few arrays,
not an object per piece). The first :meth:`Postbox.pop` after chunks
arrived indexes them all at once (a stable sort of their partition ids); a
pop then builds the pieces of its one partition only. A chunk is kept or
spilled as a whole (its pieces share its receive buffers) and accounted
until its last piece is popped.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from mpshuffle.errors import SpillError
from mpshuffle.memory.packed import PackedData, _buffer_size
from mpshuffle.memory.resource import BufferResource, MemoryType, Reservation
from mpshuffle.memory.spill import SpillDirectory
from mpshuffle.memory.store import DiskTier, admits

__all__ = ["Chunk", "Postbox"]


class Chunk:
    """The pieces of one received chunk, as arrays: one object whatever their number.

    Piece ``k`` belongs to output partition ``pids[k]``, has ``nrows[k]``
    rows and metadata ``metas[meta_of[k]]``, and its data is the
    ``size[k]`` bytes at ``offset[k]`` of ``frames[frame_of[k]]``. Pieces of
    one partition are ordered by ``(input_index, attempt, src, seq + k)``:
    by input partition, then by their position in the sender's sequence.

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
        One entry per piece (shape ``(n,)``; ``int64``, ``meta_of`` and
        ``frame_of`` ``int32``); ``offset`` and ``size`` in bytes.
    metas
        The distinct metadata of the pieces.
    frames
        The data frames (buffer-protocol objects) the pieces lie in.

    Raises
    ------
    ValueError
        If the arrays differ in length, or a piece's byte range is outside
        its frame.
    """

    __slots__ = (
        "attempt", "file_at", "frame_of", "frames", "input_index", "left", "meta_of", "metas",
        "nbytes", "nrows", "offset", "pids", "reservation", "seq", "size", "src",
    )

    def __init__(
        self, input_index: int, attempt: str, src: int, seq: int, *,
        pids: npt.NDArray[Any], nrows: npt.NDArray[Any], meta_of: npt.NDArray[Any],
        frame_of: npt.NDArray[Any], offset: npt.NDArray[Any], size: npt.NDArray[Any],
        metas: Sequence[bytes], frames: Sequence[Any],
    ) -> None:
        n = len(pids)
        if not all(len(a) == n for a in (nrows, meta_of, frame_of, offset, size)):
            raise ValueError("a chunk's piece arrays (pids, nrows, meta_of, frame_of, offset, size) differ in length")
        self.input_index, self.attempt, self.src, self.seq = input_index, attempt, src, seq
        self.pids = np.asarray(pids, np.int64)
        self.nrows = np.asarray(nrows, np.int64)
        self.meta_of = np.asarray(meta_of, np.int32)
        self.frame_of = np.asarray(frame_of, np.int32)
        self.offset = np.asarray(offset, np.int64)
        self.size = np.asarray(size, np.int64)
        self.metas = list(metas)
        self.frames: list[Any] | None = [f if isinstance(f, pa.Buffer) else pa.py_buffer(f) for f in frames]
        if n:
            frame_sizes = np.array([f.size for f in self.frames], np.int64)
            if (self.offset < 0).any() or (self.offset + self.size > frame_sizes[self.frame_of]).any():
                raise ValueError("a chunk's piece lies outside its frame")
        #: Bytes the chunk holds: its pieces' data and each metadata once.
        self.nbytes = int(self.size.sum()) + sum(len(m) for m in self.metas)
        self.left = n
        self.reservation: Reservation | None = None
        self.file_at: npt.NDArray[np.int64] | None = None  # each frame's offset in the spill file

    @classmethod
    def of_pieces(
        cls, input_index: int, attempt: str, src: int, seq: int,
        pieces: Sequence[tuple[int, PackedData]],
    ) -> Chunk:
        """A chunk of ``(partition id, piece)`` pairs, each piece's data a frame of its own."""
        metas: dict[int, int] = {}
        meta_list: list[bytes] = []
        for _, p in pieces:
            if id(p.metadata) not in metas:
                metas[id(p.metadata)] = len(meta_list)
                meta_list.append(p.metadata)
        n = len(pieces)
        return cls(
            input_index, attempt, src, seq,
            pids=np.array([pid for pid, _ in pieces], np.int64),
            nrows=np.array([p.nrows for _, p in pieces], np.int64),
            meta_of=np.array([metas[id(p.metadata)] for _, p in pieces], np.int32),
            frame_of=np.arange(n, dtype=np.int32),
            offset=np.zeros(n, np.int64),
            size=np.array([_buffer_size(p.data) for _, p in pieces], np.int64),
            metas=meta_list, frames=[p.data for _, p in pieces],
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
        self._chunks: list[Chunk | None] = []
        self._unindexed: list[int] = []
        # partition id -> [(chunk numbers, piece numbers)] (arrays), filled by _index.
        self._where: dict[int, list[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]]] = {}
        self._lock = threading.Lock()
        self._error: SpillError | None = None
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
        if admits(self.resource, MemoryType.HOST, chunk.nbytes):
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
            chunk.nbytes = sum(n for _, n in ranges)
            tier = MemoryType.DISK
        with self._lock:
            chunk.reservation = self.resource.reserve(tier, chunk.nbytes)
            self._held[tier] += chunk.nbytes
            self._unindexed.append(len(self._chunks))
            self._chunks.append(chunk)

    def _fail(self, error: SpillError) -> None:
        self._error = error
        self.clear()

    def _index(self) -> None:
        """File the chunks that arrived since the last pop under their partitions (under the lock)."""
        if not self._unindexed:
            return
        numbers = self._unindexed
        self._unindexed = []
        pids = np.concatenate([self._chunks[c].pids for c in numbers])  # type: ignore[union-attr]
        counts = np.array([len(self._chunks[c].pids) for c in numbers], np.int64)  # type: ignore[union-attr]
        chunk_no = np.repeat(np.asarray(numbers, np.int64), counts)
        piece_no = np.arange(len(pids), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        by_pid = np.argsort(pids, kind="stable")
        sorted_pids = pids[by_pid]
        cuts = np.flatnonzero(sorted_pids[1:] != sorted_pids[:-1]) + 1
        bounds = np.concatenate(([0], cuts, [len(pids)])).tolist()
        for lo, hi in itertools.pairwise(bounds):
            if lo == hi:
                continue
            sel = by_pid[lo:hi]
            self._where.setdefault(int(sorted_pids[lo]), []).append((chunk_no[sel], piece_no[sel]))

    def pop(
        self, partition_id: int, keep: Callable[[tuple[int, str, int, int]], bool] | None = None
    ) -> list[PackedData]:
        """Remove and return the pieces of ``partition_id``, in their order (see :class:`Chunk`).

        ``keep(chunk.order())``, if given, selects the chunks whose pieces
        are returned; the others' are dropped (and not read back from disk).

        Spilled pieces are read back (one read of each piece's byte range,
        all into one buffer) and returned as zero-copy slices of that buffer.

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
                return []
            cn = np.concatenate([c for c, _ in found])
            pn = np.concatenate([p for _, p in found])
            numbers = np.unique(cn).tolist()
            chunks = {c: self._chunks[c] for c in numbers}
            if keep is not None:
                dropped = [c for c in numbers if not keep(chunks[c].order())]  # type: ignore[union-attr]
                if dropped:
                    gone = np.isin(cn, dropped)
                    self._done(cn[gone])
                    cn, pn = cn[~gone], pn[~gone]
                    for c in dropped:
                        del chunks[c]
        if not len(cn):
            return []
        live: dict[int, Chunk] = {c: ch for c, ch in chunks.items() if ch is not None}
        order = self._ordered(live, cn, pn)
        cn, pn = cn[order], pn[order]
        try:
            pieces = self._pieces(live, cn.tolist(), pn.tolist())
        except SpillError as e:
            with self._lock:
                self._done(cn)
            self._fail(e)
            raise
        with self._lock:
            self._done(cn)
        return pieces

    @staticmethod
    def _ordered(
        chunks: dict[int, Chunk], cn: npt.NDArray[np.int64], pn: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.int64]:
        """The permutation that puts pieces ``(cn, pn)`` in their order (see :class:`Chunk`)."""
        numbers = sorted(chunks)
        at = np.searchsorted(np.asarray(numbers, np.int64), cn)
        attempts = sorted({chunks[c].attempt for c in numbers})
        rank_of = {a: r for r, a in enumerate(attempts)}
        inp = np.array([chunks[c].input_index for c in numbers], np.int64)[at]
        att = np.array([rank_of[chunks[c].attempt] for c in numbers], np.int64)[at]
        src = np.array([chunks[c].src for c in numbers], np.int64)[at]
        seq = np.array([chunks[c].seq for c in numbers], np.int64)[at] + pn
        return np.lexsort((seq, src, att, inp))

    def _pieces(self, chunks: dict[int, Chunk], cn: list[int], pn: list[int]) -> list[PackedData]:
        """Build the pieces ``(cn[i], pn[i])``; those of spilled chunks read back in one read."""
        out: list[Any] = [None] * len(cn)
        spilled: list[tuple[int, int, int]] = []
        ranges: list[tuple[int, int]] = []
        for i, (c, k) in enumerate(zip(cn, pn, strict=True)):
            ch = chunks[c]
            f, off, size = int(ch.frame_of[k]), int(ch.offset[k]), int(ch.size[k])
            if ch.frames is not None:
                meta = ch.metas[ch.meta_of[k]]
                out[i] = PackedData(meta, ch.frames[f].slice(off, size), int(ch.nrows[k]))
            else:
                assert ch.file_at is not None
                spilled.append((i, c, k))
                ranges.append((int(ch.file_at[f]) + off, size))
        if spilled:
            views = self.disk.get(ranges)
            for (i, c, k), view in zip(spilled, views, strict=True):
                ch = chunks[c]
                out[i] = PackedData(ch.metas[ch.meta_of[k]], view, int(ch.nrows[k]))
        return out

    def _done(self, cn: npt.NDArray[np.int64]) -> None:
        """Count the pieces of chunks ``cn`` (one entry per piece) as gone (under the lock)."""
        if not len(cn):
            return
        numbers, counts = np.unique(cn, return_counts=True)
        held = self._held
        for c, n in zip(numbers.tolist(), counts.tolist(), strict=True):
            ch = self._chunks[c] if c < len(self._chunks) else None  # None: cleared meanwhile
            if ch is None:
                continue
            ch.left -= n
            if ch.left <= 0:
                reservation = ch.reservation
                if reservation is not None and reservation.nbytes:
                    held[reservation.memory_type] -= reservation.nbytes
                    reservation.release()
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
            self._chunks = []
            self._unindexed = []
            self._where.clear()
            self._held = {MemoryType.HOST: 0, MemoryType.DISK: 0}
        self.spill.remove()
