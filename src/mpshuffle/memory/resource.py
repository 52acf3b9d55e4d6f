"""Budgets and reservations per memory type."""

from __future__ import annotations

import enum
import os
import tempfile
import threading
from collections.abc import Callable

from mpshuffle.errors import MPShuffleError

__all__ = ["BufferResource", "MemoryType", "Reservation"]


class MemoryType(enum.Enum):
    """Where a buffer lives, fastest first."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


class Reservation:
    """Bytes of one memory type held for a buffer; give them back with :meth:`release`."""

    __slots__ = ("_resource", "memory_type", "nbytes")

    def __init__(self, resource: BufferResource, memory_type: MemoryType, nbytes: int) -> None:
        self._resource = resource
        self.memory_type = memory_type
        self.nbytes = nbytes

    def release(self) -> None:
        """Return the reserved bytes to the resource. Idempotent."""
        if self.nbytes:
            self._resource._release(self.memory_type, self.nbytes)
            self.nbytes = 0


class BufferResource:
    """Budgets and current use of each memory type on one worker.

    Parameters
    ----------
    limits
        Budget in bytes per memory type; a missing type or ``None`` means
        unbounded.
    spill_dir
        Directory under which spill files are written; by default the
        system's temporary directory.
    owner
        Names the rank and worker that own the resource, in error messages.
    spill_prefix
        Start of the name of every spill directory made under ``spill_dir``
        (the worker context puts the generation in it).
    """

    def __init__(
        self,
        limits: dict[MemoryType, int | None] | None = None,
        spill_dir: str | None = None,
        *,
        owner: str = "",
        spill_prefix: str = "mpshuffle",
    ) -> None:
        self.limits: dict[MemoryType, int | None] = dict(limits or {})
        self.spill_dir: str = spill_dir or tempfile.gettempdir()
        self.owner = owner
        self.spill_prefix = spill_prefix
        self._used = {mt: 0 for mt in MemoryType}
        self._peak = {mt: 0 for mt in MemoryType}
        self._lock = threading.Lock()
        self._reclaimers: dict[MemoryType, list[Callable[[], int]]] = {}

    def add_reclaimer(self, memory_type: MemoryType, reclaim: Callable[[], int]) -> None:
        """Register ``reclaim()``: gives back idle memory of ``memory_type`` it holds (a pool's free
        blocks) and returns the bytes given back; :meth:`reclaim` calls it when the budget is short."""
        self._reclaimers.setdefault(memory_type, []).append(reclaim)

    def reclaim(self, memory_type: MemoryType) -> int:
        """Have every registered reclaimer of ``memory_type`` give its idle memory back; the bytes freed.

        What the store does before it moves buffers down a tier for room
        (:mod:`mpshuffle.memory.store`): memory kept only for reuse goes first.
        """
        return sum(reclaim() for reclaim in list(self._reclaimers.get(memory_type, ())))

    def spill_path(self, name: str) -> str:
        """The spill directory of the part of the worker called ``name`` (a run on a rank):
        ``<spill_dir>/<spill_prefix>-<name>``."""
        return os.path.join(self.spill_dir, f"{self.spill_prefix}-{name}")

    def limit(self, memory_type: MemoryType) -> int | None:
        """Budget of ``memory_type`` in bytes, or ``None`` if unbounded."""
        return self.limits.get(memory_type)

    def used(self, memory_type: MemoryType) -> int:
        """Bytes of ``memory_type`` currently reserved."""
        return self._used[memory_type]

    def peak(self, memory_type: MemoryType) -> int:
        """Largest number of bytes of ``memory_type`` reserved at once."""
        return self._peak[memory_type]

    def available(self, memory_type: MemoryType) -> int | None:
        """Bytes left under the budget (may be negative), or ``None`` if unbounded."""
        limit = self.limits.get(memory_type)
        return None if limit is None else limit - self._used[memory_type]

    def reserve(self, memory_type: MemoryType, nbytes: int) -> Reservation:
        """Account ``nbytes`` of ``memory_type``, even past the budget.

        The caller decides what to do over budget (spill); see
        :meth:`available`.

        Raises
        ------
        MPShuffleError
            If ``nbytes`` is negative.
        """
        if nbytes < 0:
            raise MPShuffleError(f"cannot reserve a negative number of bytes ({nbytes})")
        with self._lock:
            used = self._used[memory_type] + nbytes
            self._used[memory_type] = used
            self._peak[memory_type] = max(self._peak[memory_type], used)
        return Reservation(self, memory_type, nbytes)

    def _release(self, memory_type: MemoryType, nbytes: int) -> None:
        with self._lock:
            self._used[memory_type] -= nbytes
