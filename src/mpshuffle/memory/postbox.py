"""The postbox: received pieces of output partitions, under the host budget.

The postbox is the host tier of the one store (:mod:`mpshuffle.memory.store`)
for the host runs, and follows its arrival rule (:func:`~mpshuffle.memory.store.admits`):
pieces are kept in memory while the host use of the worker's
:class:`BufferResource` stays within its budget; a chunk that would pass the
budget goes one tier down at once, into the store's
:class:`~mpshuffle.memory.store.DiskTier`, as its packed buffers (no per-row
work, one ``writev`` into the rank's one spill file), and its pieces' byte
ranges are read back when their partition is popped.
A chunk's pieces usually share one receive buffer, so a chunk is kept or
spilled as a whole: keeping a single piece would pin the whole buffer.

What a chunk costs does not grow with its number of pieces beyond a list
entry each: one reservation per chunk (given back when its last piece is
popped), metadata counted once per distinct object
(:func:`~mpshuffle.memory.packed.packed_nbytes`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from mpshuffle.errors import SpillError
from mpshuffle.memory.packed import PackedData, packed_nbytes
from mpshuffle.memory.resource import BufferResource, MemoryType, Reservation
from mpshuffle.memory.spill import SpillDirectory
from mpshuffle.memory.store import DiskTier, admits

__all__ = ["Postbox"]


class _Spilled:
    """Index entry of a spilled piece: where its buffer is in the rank's spill file."""

    __slots__ = ("metadata", "nbytes", "nrows", "offset")

    def __init__(self, metadata: bytes, nrows: int, offset: int, nbytes: int) -> None:
        self.metadata = metadata
        self.nrows = nrows
        self.offset = offset
        self.nbytes = nbytes


class _Share:
    """One chunk's reservation, given back when the last of its ``left`` pieces is popped."""

    __slots__ = ("left", "reservation")

    def __init__(self, reservation: Reservation, left: int) -> None:
        self.reservation = reservation
        self.left = left

    def done(self, n: int = 1) -> None:
        self.left -= n
        if self.left <= 0:
            self.reservation.release()


_Entry = tuple[Any, "PackedData | _Spilled", _Share]


class Postbox:
    """Pieces of this rank's output partitions, keyed by partition id.

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
        self._pieces: dict[int, list[_Entry]] = {}
        self._lock = threading.Lock()
        self._error: SpillError | None = None
        self._held = {MemoryType.HOST: 0, MemoryType.DISK: 0}

    def add(self, partition_id: int, order: Any, piece: PackedData) -> None:
        """Hold ``piece`` of output partition ``partition_id``; ``order`` sorts pieces.

        Raises
        ------
        SpillError
            As :meth:`add_chunk`.
        """
        self.add_chunk([(partition_id, order, piece)])

    def add_chunk(self, entries: Sequence[tuple[int, Any, PackedData]]) -> None:
        """Hold the pieces of one received chunk, in memory or spilled together.

        Parameters
        ----------
        entries
            ``(partition_id, order, piece)`` for every piece of the chunk;
            ``order`` sorts the pieces of a partition.

        Raises
        ------
        SpillError
            If spilling failed (e.g. the disk is full). The run's spill
            files are removed, and every later call raises the same error.
        """
        if self._error is not None:
            raise self._error
        if not entries:
            return
        nbytes = packed_nbytes(piece for _, _, piece in entries)
        if admits(self.resource, MemoryType.HOST, nbytes):
            with self._lock:
                share = _Share(self.resource.reserve(MemoryType.HOST, nbytes), len(entries))
                self._held[MemoryType.HOST] += nbytes
                for pid, order, piece in entries:
                    self._pieces.setdefault(pid, []).append((order, piece, share))
            return
        try:
            ranges = self.disk.put([piece.data for _, _, piece in entries])
        except SpillError as e:
            self._fail(e)
            raise
        spilled = [
            (pid, order, _Spilled(piece.metadata, piece.nrows, offset, size))
            for (pid, order, piece), (offset, size) in zip(entries, ranges, strict=True)
        ]
        disk = sum(record.nbytes for _, _, record in spilled)
        with self._lock:
            share = _Share(self.resource.reserve(MemoryType.DISK, disk), len(spilled))
            self._held[MemoryType.DISK] += disk
            for pid, order, record in spilled:
                self._pieces.setdefault(pid, []).append((order, record, share))

    def _fail(self, error: SpillError) -> None:
        self._error = error
        self.clear()

    def pop(self, partition_id: int, keep: Callable[[Any], bool] | None = None) -> list[PackedData]:
        """Remove and return the pieces of ``partition_id``, sorted by their ``order``.

        ``keep(order)``, if given, selects the pieces to return; the others
        are dropped (and not read back from disk).

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
            entries = self._pieces.pop(partition_id, [])
            if keep is not None:
                dropped = [e for e in entries if not keep(e[0])]
                if dropped:
                    self._done(dropped)
                    entries = [e for e in entries if keep(e[0])]
        spilled = [(k, e[1]) for k, e in enumerate(entries) if type(e[1]) is _Spilled]
        if spilled:
            try:
                views = self.disk.get([(r.offset, r.nbytes) for _, r in spilled])  # type: ignore[union-attr]
            except SpillError as e:
                with self._lock:
                    self._done(entries)
                self._fail(e)
                raise
            for (k, record), view in zip(spilled, views, strict=True):
                order, _, share = entries[k]
                entries[k] = (order, PackedData(record.metadata, view, record.nrows), share)  # type: ignore[union-attr]
        entries.sort(key=lambda e: e[0])
        with self._lock:
            self._done(entries)
        return [piece for _, piece, _ in entries]  # type: ignore[misc]

    def _done(self, entries: Sequence[_Entry]) -> None:
        """Count ``entries`` as gone from their chunks (under the lock)."""
        held = self._held
        for e in entries:
            share = e[2]
            share.left -= 1
            if share.left <= 0:
                reservation = share.reservation
                if reservation.nbytes:
                    held[reservation.memory_type] -= reservation.nbytes
                    reservation.release()

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
            shares = {id(share): share for es in self._pieces.values() for _, _, share in es}
            self._pieces.clear()
            for share in shares.values():
                share.reservation.release()
            self._held = {MemoryType.HOST: 0, MemoryType.DISK: 0}
        self.spill.remove()
