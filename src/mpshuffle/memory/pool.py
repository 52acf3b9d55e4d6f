"""A pool of host memory reused across chunks and runs: :class:`HostPool`.

Fresh memory costs a page fault per page on first touch (about 3 µs per
4 KiB page on the 2-core development machine: more than hashing and
scattering the same bytes). A worker's shuffle buffers live only for a
while (an insert's pieces for other ranks until they are sent, everything
until its partition is extracted), so the pool keeps their memory mapped and
hands it out again.

:meth:`HostPool.allocate` returns a mutable ``pyarrow.Buffer``; its memory
goes back to the pool when that buffer and every slice and view of it are
gone (a ``weakref.finalize`` on the numpy array the buffer exports), from
whichever thread drops the last reference. Blocks are kept by size class
(sizes rounded up by at most 1/8), so a request is served by a block of its
own class or the next two.

Bounds: the pool keeps at most ``per_class`` free blocks of a size class
(the few an insert cycles through; blocks freed in bulk at extract are not
worth keeping) and ``limit`` bytes in all, and those
bytes are reserved as host memory in the worker's
:class:`~mpshuffle.memory.BufferResource`, so they count against
``spill_host``; a block freed while the host budget is exceeded, or while
the pool does not *retain* (no run is active), is given back at once.

Where its blocks come from is the pool's ``fresh`` function: aligned NumPy
memory by default, the bytes a request asks for faulted in at once
(:func:`~mpshuffle.memory._pages.populate_write`: one ``madvise`` instead
of a trap per 4 KiB page, since the scatter or a received chunk writes them
right after; the size class's slack stays untouched), page-locked memory for the device runs' pools
(:func:`mpshuffle.memory.device.pinned_empty`: a copy between the GPU and
page-locked memory runs at ~55 GB/s against ~11 GB/s for pageable memory,
but a fresh page-locked block costs about as much as the copy into fresh
pageable memory it would save, so such memory pays only where it is reused).
:meth:`HostPool.array` hands out a NumPy array instead of a ``pyarrow.Buffer``;
:meth:`HostPool.reusable` says how many idle bytes a request would take over,
so the store can count them as room (:func:`mpshuffle.memory.store.spill_down`).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from mpshuffle.memory._pages import ALIGNMENT, aligned_empty, populate_write
from mpshuffle.memory.resource import MemoryType

if TYPE_CHECKING:
    import numpy.typing as npt
    import pyarrow as pa

    from mpshuffle.memory.resource import BufferResource, Reservation

__all__ = ["ALIGNMENT", "HostPool", "aligned_empty"]


def _round_up(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def size_class(nbytes: int) -> int:
    """Bytes of the block that serves a request of ``nbytes``: rounded up to 1/8 of a power of two.

    Never less than 64 KiB; so at most 1/8 of a block is slack.
    """
    n = max(int(nbytes), 1)
    granule = max(64 * 1024, 1 << max(n.bit_length() - 4, 0))
    return -(-n // granule) * granule


def _classes(cls: int) -> tuple[int, int, int]:
    # A request is served by a block of its own class or of the next two.
    return cls, size_class(cls + cls // 8), size_class(cls + cls // 4)


class HostPool:
    """Reused host memory for one worker's shuffle buffers (see the module docstring).

    Parameters
    ----------
    limit
        Bytes of free blocks the pool may keep (``0``: none; every request
        gets fresh memory).
    resource
        Where the kept free bytes are reserved as host memory; ``None``
        accounts nothing.
    per_class
        Free blocks kept per size class.
    fresh
        ``fresh(nbytes)``: a new 1-D ``uint8`` block of exactly ``nbytes``
        bytes, 64-byte aligned (default: NumPy memory).

    Attributes
    ----------
    reused_bytes
        Bytes handed out in blocks the pool had kept.
    fresh_bytes
        Bytes handed out in fresh memory.
    retain
        Whether freed blocks are kept (the owner turns it off while no run
        is active, so an idle worker holds no pooled memory).
    """

    limit: int
    reused_bytes: int
    fresh_bytes: int
    retain: bool

    def __init__(
        self, limit: int, resource: BufferResource | None = None, *, per_class: int = 4,
        fresh: Callable[[int], npt.NDArray[np.uint8]] | None = None,
    ) -> None:
        if limit < 0 or per_class < 0:
            raise ValueError(f"pool limit and per_class must be >= 0, got {limit}, {per_class}")
        self.limit = int(limit)
        self.per_class = int(per_class)
        self.reused_bytes = 0
        self.fresh_bytes = 0
        self.retain = True
        self._resource = resource
        self._fresh = fresh or aligned_empty
        self._populate = fresh is None
        self._free: dict[int, list[npt.NDArray[np.uint8]]] = {}
        self._idle = 0
        # Reentrant: a buffer collected by the garbage collector while this
        # thread holds the lock gives its block back from inside.
        self._lock = threading.RLock()
        self._reservation: Reservation | None = None
        self._closed = False

    @property
    def idle_bytes(self) -> int:
        """Bytes of free blocks the pool keeps (reserved as host memory)."""
        return self._idle

    def allocate(self, nbytes: int) -> pa.Buffer:
        """Return a mutable buffer of ``nbytes`` bytes, 64-byte aligned, reused where possible.

        The memory returns to the pool once the buffer and every slice and
        view of it are gone; write into it through ``numpy.frombuffer(buf,
        numpy.uint8)``, which keeps it alive.

        Raises
        ------
        ValueError
            If ``nbytes`` is negative.
        """
        import pyarrow as pa

        if nbytes < 0:
            raise ValueError(f"cannot allocate a negative number of bytes ({nbytes})")
        cls = size_class(nbytes)
        block = None
        with self._lock:
            for c in _classes(cls):
                blocks = self._free.get(c)
                if blocks:
                    block = blocks.pop()
                    self._idle -= c
                    self.reused_bytes += nbytes
                    self._account()
                    break
        if block is None:
            block = self._fresh(cls)
            if self._populate:
                populate_write(block[:nbytes])
            self.fresh_bytes += nbytes
        view = block[:nbytes]
        weakref.finalize(view, self._give, block)
        return pa.py_buffer(view)

    def array(self, nbytes: int) -> npt.NDArray[np.uint8]:
        """As :meth:`allocate`, as a writable 1-D ``uint8`` NumPy array.

        The array's base is the pooled buffer, so the block returns to the
        pool only once the array and every slice of it are gone.
        """
        return np.frombuffer(self.allocate(nbytes), np.uint8)

    def reusable(self, nbytes: int) -> int:
        """Bytes of the idle block a request of ``nbytes`` would take over (0: it would get fresh memory)."""
        with self._lock:
            for c in _classes(size_class(nbytes)):
                if self._free.get(c):
                    return c
        return 0

    def _give(self, block: npt.NDArray[np.uint8]) -> None:
        size = int(block.shape[0])
        with self._lock:
            kept = self._free.setdefault(size, [])
            if (
                self._closed or not self.retain or self._idle + size > self.limit
                or len(kept) >= self.per_class or self._over_budget(size)
            ):
                return  # dropped: numpy frees it
            kept.append(block)
            self._idle += size
            self._account()

    def _over_budget(self, size: int) -> bool:
        if self._resource is None:
            return False
        available = self._resource.available(MemoryType.HOST)
        return available is not None and available < size

    def _account(self) -> None:
        if self._resource is None:
            return
        if self._reservation is not None:
            self._reservation.release()
        self._reservation = self._resource.reserve(MemoryType.HOST, self._idle) if self._idle else None

    def trim(self) -> int:
        """Give back every kept free block; return the bytes given back."""
        with self._lock:
            freed = self._idle
            self._free.clear()
            self._idle = 0
            self._account()
        return freed

    def close(self) -> None:
        """Give back the free blocks and keep none from now on. Idempotent."""
        with self._lock:
            self._closed = True
        self.trim()

    def stats(self) -> dict[str, int]:
        """``idle_bytes``, ``reused_bytes`` and ``fresh_bytes`` so far."""
        with self._lock:
            return {"idle_bytes": self._idle, "reused_bytes": self.reused_bytes,
                    "fresh_bytes": self.fresh_bytes}
