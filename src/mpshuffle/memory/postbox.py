"""The postbox: received pieces of output partitions, under the host budget.

Pieces are kept in memory while the host use of the worker's
:class:`BufferResource` stays within its budget; a chunk that would pass the
budget is written to the run's :class:`SpillDirectory` instead, as its packed
buffers (no per-row work), and read back when its partition is popped.
A chunk's pieces usually share one receive buffer, so a chunk is kept or
spilled as a whole: keeping a single piece would pin the whole buffer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from mpshuffle.errors import SpillError
from mpshuffle.memory.packed import PackedData
from mpshuffle.memory.resource import BufferResource, MemoryType, Reservation
from mpshuffle.memory.spill import SpillDirectory

__all__ = ["Postbox"]


class _Spilled:
    """Index entry of a spilled piece: where its buffer is in the partition's file."""

    __slots__ = ("metadata", "nbytes", "nrows", "offset")

    def __init__(self, metadata: bytes, nrows: int, offset: int, nbytes: int) -> None:
        self.metadata = metadata
        self.nrows = nrows
        self.offset = offset
        self.nbytes = nbytes


class Postbox:
    """Pieces of this rank's output partitions, keyed by partition id.

    Every piece held in memory is accounted as host memory in the
    :class:`BufferResource`; spilled pieces are accounted as disk.

    Parameters
    ----------
    resource
        The worker's buffer resource (host budget, spill directory, owner).
    name
        Names the postbox; its spill directory is
        ``<resource.spill_dir>/<resource.spill_prefix>-<name>``.

    Attributes
    ----------
    bytes_spilled, bytes_unspilled
        Bytes of piece data written to disk and read back so far.
    seconds_spill, seconds_unspill
        Wall time spent writing and reading spill files, in seconds.
    """

    def __init__(self, resource: BufferResource, name: str) -> None:
        self.resource = resource
        self.name = name
        self.spill = SpillDirectory(resource.spill_path(name), owner=resource.owner)
        self._pieces: dict[int, list[tuple[Any, PackedData | _Spilled, Reservation]]] = {}
        self._lock = threading.Lock()
        self._error: SpillError | None = None
        self.bytes_spilled = 0
        self.bytes_unspilled = 0
        self.seconds_spill = 0.0
        self.seconds_unspill = 0.0

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
        nbytes = sum(piece.nbytes for _, _, piece in entries)
        available = self.resource.available(MemoryType.HOST)
        if available is None or nbytes <= available or not nbytes:
            self._keep(entries)
            return
        t0 = time.perf_counter()
        try:
            spilled = [
                (pid, order, _Spilled(piece.metadata, piece.nrows, *self.spill.write(pid, piece.data)))
                for pid, order, piece in entries
            ]
        except SpillError as e:
            self._fail(e)
            raise
        self.seconds_spill += time.perf_counter() - t0
        with self._lock:
            for pid, order, record in spilled:
                reservation = self.resource.reserve(MemoryType.DISK, record.nbytes)
                self._pieces.setdefault(pid, []).append((order, record, reservation))
                self.bytes_spilled += record.nbytes

    def _keep(self, entries: Sequence[tuple[int, Any, PackedData]]) -> None:
        with self._lock:
            for pid, order, piece in entries:
                reservation = self.resource.reserve(MemoryType.HOST, piece.nbytes)
                self._pieces.setdefault(pid, []).append((order, piece, reservation))

    def _fail(self, error: SpillError) -> None:
        self._error = error
        self.clear()

    def pop(self, partition_id: int, keep: Callable[[Any], bool] | None = None) -> list[PackedData]:
        """Remove and return the pieces of ``partition_id``, sorted by their ``order``.

        ``keep(order)``, if given, selects the pieces to return; the others
        are dropped (and not read back from disk).

        Spilled pieces are read back (one read of the partition's file) and
        returned as zero-copy slices of that buffer.

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
            for _, _, reservation in dropped:
                reservation.release()
            if dropped:
                entries = [e for e in entries if keep(e[0])]
        if any(isinstance(e[1], _Spilled) for e in entries):
            t0 = time.perf_counter()
            spilled = sum(item.nbytes for _, item, _ in entries if isinstance(item, _Spilled))
            try:
                buf = self.spill.read(partition_id)
            except SpillError as e:
                for _, _, reservation in entries:
                    reservation.release()
                self._fail(e)
                raise
            self.seconds_unspill += time.perf_counter() - t0
            entries = [
                (order, _unspill(item, buf), res) if isinstance(item, _Spilled) else (order, item, res)
                for order, item, res in entries
            ]
            self.bytes_unspilled += spilled
        entries.sort(key=lambda e: e[0])
        out = [piece for _, piece, _ in entries]
        for _, _, reservation in entries:
            reservation.release()
        return out  # type: ignore[return-value]

    @property
    def nbytes(self) -> int:
        """Bytes held in memory by the postbox (spilled pieces not counted)."""
        with self._lock:
            return sum(
                p.nbytes for entries in self._pieces.values() for _, p, _ in entries
                if isinstance(p, PackedData)
            )

    @property
    def nbytes_spilled(self) -> int:
        """Bytes of pieces currently on disk."""
        with self._lock:
            return sum(
                p.nbytes for entries in self._pieces.values() for _, p, _ in entries
                if isinstance(p, _Spilled)
            )

    def clear(self) -> None:
        """Drop every piece, release its memory and delete the spill files. Idempotent."""
        with self._lock:
            entries = [e for es in self._pieces.values() for e in es]
            self._pieces.clear()
        for _, _, reservation in entries:
            reservation.release()
        self.spill.remove()


def _unspill(record: _Spilled, buf: memoryview) -> PackedData:
    return PackedData(
        metadata=record.metadata,
        data=buf[record.offset : record.offset + record.nbytes],
        nrows=record.nrows,
    )
