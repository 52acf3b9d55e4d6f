"""The postbox: received pieces of output partitions, under the host budget."""

from __future__ import annotations

import threading
from typing import Any

from mpshuffle.memory.resource import BufferResource, MemoryType, Reservation
from mpshuffle.table import PackedData

__all__ = ["Postbox"]


class Postbox:
    """Pieces of this rank's output partitions, keyed by partition id.

    Every piece is accounted as host memory in the :class:`BufferResource`
    while it is held.

    Parameters
    ----------
    resource
        The worker's buffer resource.
    name
        Names the postbox in spill file names and errors.
    """

    def __init__(self, resource: BufferResource, name: str) -> None:
        self.resource = resource
        self.name = name
        self._pieces: dict[int, list[tuple[Any, PackedData, Reservation]]] = {}
        self._lock = threading.Lock()
        self.bytes_spilled = 0
        self.bytes_unspilled = 0

    def add(self, partition_id: int, order: Any, piece: PackedData) -> None:
        """Hold ``piece`` of output partition ``partition_id``; ``order`` sorts pieces."""
        reservation = self.resource.reserve(MemoryType.HOST, piece.nbytes)
        with self._lock:
            self._pieces.setdefault(partition_id, []).append((order, piece, reservation))

    def pop(self, partition_id: int) -> list[PackedData]:
        """Remove and return the pieces of ``partition_id``, sorted by their ``order``."""
        with self._lock:
            entries = self._pieces.pop(partition_id, [])
        entries.sort(key=lambda e: e[0])
        out = [piece for _, piece, _ in entries]
        for _, _, reservation in entries:
            reservation.release()
        return out

    @property
    def nbytes(self) -> int:
        """Bytes held in the postbox."""
        with self._lock:
            return sum(p.nbytes for entries in self._pieces.values() for _, p, _ in entries)

    def clear(self) -> None:
        """Drop every piece and release its memory."""
        with self._lock:
            entries = [e for es in self._pieces.values() for e in es]
            self._pieces.clear()
        for _, _, reservation in entries:
            reservation.release()
