"""The one spillable store: tiers device -> host -> disk and the one policy that moves data between them.

Every buffer a run holds lives in one of three tiers, each counted in the
worker's :class:`~mpshuffle.memory.resource.BufferResource` under its
:class:`~mpshuffle.memory.resource.MemoryType`: ``DEVICE`` (GPU memory),
``HOST`` (process memory) and ``DISK`` (the rank's one spill file). The host
runs (:class:`~mpshuffle.memory.postbox.Postbox`) and the device runs
(:mod:`mpshuffle.shuffler.device.buffers`) hold their buffers through this
module's building blocks and follow its one policy:

* **Arrival** (:func:`admits`): a buffer stays in the tier it was made in
  when that tier's budget has room for it; otherwise it goes one tier down
  at once. A host chunk that would pass the host budget is written to disk
  on arrival; a device buffer is already allocated when it is counted, so
  it is admitted and the next rule applies.
* **Over budget** (:func:`spill_down`): while a tier's use is past its
  budget, its **oldest** buffers move one tier down (device -> host, then
  host -> disk), oldest first, until the tier is within budget. The oldest
  is read last (outputs are extracted after every input is in), so moving
  it costs the least waiting. **Room is made below first**: a device buffer
  comes down to host only once the host tier can take it within its budget
  (idle pooled memory given back first, :meth:`BufferResource.reclaim`,
  then the oldest host buffers written to disk); where the host holds
  nothing this store can move, it passes straight to disk through a
  transfer block. So the host stays within ``spill_host`` with a disk tier.
  The arrival rule is the same rule for a buffer that arrives from the
  network rather than from the device: the postbox gives idle pooled
  memory back before a chunk goes to disk.
* **Coming back**: nothing moves up on its own. A buffer comes back when it
  is read (an extract, an exchange round), into host memory, as the byte
  ranges it needs (:meth:`DiskTier.get`), never a whole file.

The tiers are building blocks tested one by one: :func:`to_host` (the
device tier's move down, a copy into host memory) and :class:`DiskTier`
(the disk tier: every buffer of the run appended to the rank's one spill
file, :meth:`SpillDirectory.append`, and read back by range,
:meth:`SpillDirectory.read_ranges`: one open file per run and rank whatever
the number of partitions). Anything with a ``tier`` and a ``move_down``
(:class:`Spillable`) can be held; :func:`spill_down` needs no GPU, so the
policy is tested with NumPy stand-ins for device buffers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import numpy as np

from mpshuffle.memory.resource import BufferResource, MemoryType
from mpshuffle.memory.spill import SpillDirectory

__all__ = ["MAP_MIN_BYTES", "TIERS", "DiskTier", "Spillable", "admits", "over", "spill_down", "to_host"]

#: The tiers, top (fastest) first; data moves down this order and comes back only when read.
TIERS = (MemoryType.DEVICE, MemoryType.HOST, MemoryType.DISK)

#: Spilled ranges of at least this many bytes are mapped for reading (:meth:`DiskTier.view`); smaller
#: ones are read into one buffer. On the 2-core development VM (``benchmarks/spill_read_paths.py``: 300 MB
#: of ranges from the page cache, a second thread of the process busy, the reading thread's CPU seconds,
#: medians of 3), read against mapped: 20 KB ranges 0.12 against 0.60, 64 KiB 0.11 against 0.22, 200 KB
#: 0.076 against 0.086, 512 KiB 0.062 against 0.045, 1 MiB 0.058 against 0.037
#: (``benchmarks/results/README.md``, session 23).
MAP_MIN_BYTES = 256 * 1024


def over(resource: BufferResource, memory_type: MemoryType) -> bool:
    """Whether ``resource``'s use of ``memory_type`` is past its budget (never so without a budget)."""
    available = resource.available(memory_type)
    return available is not None and available < 0


def admits(resource: BufferResource, memory_type: MemoryType, nbytes: int) -> bool:
    """Whether an arriving buffer of ``nbytes`` bytes stays in tier ``memory_type`` (the arrival rule).

    True without a budget, for an empty buffer, or when ``nbytes`` fits in
    what is left of the budget; otherwise the buffer goes one tier down at once.
    """
    available = resource.available(memory_type)
    return available is None or nbytes <= available or not nbytes


def to_host(data: Any, out: Any = None) -> Any:
    """The device tier's move down: a host (NumPy) copy of ``data``.

    ``data`` is a CuPy array (copied with ``.get()``, on the current
    stream, synchronously) or a NumPy stand-in (copied). ``out``, a 1-D
    ``uint8`` host array of ``data``'s size (a pooled page-locked block),
    receives the copy; without it the copy goes to fresh memory.
    """
    if out is None:
        return data.get() if hasattr(data, "get") else data.copy()
    if hasattr(data, "get"):
        data.get(out=out)
    else:
        np.copyto(out, data)
    return out


class Spillable(Protocol):
    """A buffer the store can move down: where it is now, its size there, and a move down."""

    @property
    def tier(self) -> MemoryType:
        """The tier the buffer is in now."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes the buffer holds in its tier (what moving it frees there)."""
        ...

    def move_down(self, to: MemoryType) -> int:
        """Move to tier ``to`` (below the buffer's); return the bytes moved (0 where it cannot move).

        A device buffer moves to ``HOST`` or, where the host tier has no
        room for it, straight to ``DISK`` (through a staging block); a host
        buffer moves to ``DISK``.

        Raises
        ------
        SpillError
            If writing to disk failed.
        """
        ...


def spill_down(
    resource: BufferResource,
    entries: Sequence[Spillable],
    count: Callable[[str, float], None],
    scope: Callable[[], AbstractContextManager[Any]] = nullcontext,
    *,
    host_cost: Callable[[int], int] | None = None,
) -> None:
    """The over-budget rule: move the oldest buffers down a tier while a tier is past its budget.

    Tiers are handled top first. While the ``DEVICE`` use is past its
    budget, the oldest device buffer moves down; **room is made below
    first**: while the host tier cannot take it, idle pooled host memory is
    given back (:meth:`BufferResource.reclaim`) and then the oldest host
    buffers go to disk, so the host stays within its budget; only where that leaves no room (nothing of this run on the
    host, the rest the worker's other runs') does the buffer go straight to
    disk. Then, while the ``HOST`` use is past its budget (the worker's,
    shared with its other runs), the oldest host buffers go to disk.

    Parameters
    ----------
    resource
        Where the tiers' budgets and uses are counted.
    entries
        The buffers, oldest first.
    count
        ``count(statistic, amount)`` adds to the run's statistics:
        ``bytes_spilled_host`` and ``seconds_spill_host`` (device -> host),
        ``bytes_spilled_disk`` and ``seconds_spill_disk`` (to disk, from the
        host or straight from the device); also for what was moved before
        an error.
    scope
        Makes the buffers' GPU current while device buffers move.
    host_cost
        ``host_cost(nbytes)``: the host bytes a device buffer of ``nbytes``
        adds to the ``HOST`` use when it moves there: its block's size, less
        the idle pooled block it would take over (reserved already, so
        room); by default ``nbytes``.
    Raises
    ------
    SpillError
        If writing to disk failed (e.g. the disk is full).
    """
    moved = {"host": 0, "disk": 0}
    seconds = {"host": 0.0, "disk": 0.0}

    def host_fits(nbytes: int) -> bool:
        available = resource.available(MemoryType.HOST)
        return available is None or (host_cost(nbytes) if host_cost else nbytes) <= available

    def to_disk(b: Spillable) -> None:
        t = time.perf_counter()
        moved["disk"] += b.move_down(MemoryType.DISK)
        seconds["disk"] += time.perf_counter() - t

    try:
        if over(resource, MemoryType.DEVICE):
            with scope():
                for b in entries:
                    if not over(resource, MemoryType.DEVICE):
                        break
                    if b.tier is not MemoryType.DEVICE:
                        continue
                    nbytes = b.nbytes
                    if not host_fits(nbytes):
                        resource.reclaim(MemoryType.HOST)
                    for h in entries:
                        if host_fits(nbytes):
                            break
                        if h.tier is MemoryType.HOST:
                            to_disk(h)
                    if host_fits(nbytes):
                        t = time.perf_counter()
                        moved["host"] += b.move_down(MemoryType.HOST)
                        seconds["host"] += time.perf_counter() - t
                    else:
                        to_disk(b)
        if over(resource, MemoryType.HOST):
            resource.reclaim(MemoryType.HOST)
            for h in entries:
                if not over(resource, MemoryType.HOST):
                    break
                if h.tier is MemoryType.HOST:
                    to_disk(h)
    finally:
        for key in ("host", "disk"):
            if moved[key] or seconds[key]:
                count(f"bytes_spilled_{key}", moved[key])
                count(f"seconds_spill_{key}", seconds[key])


class DiskTier:
    """The disk tier of one run on one rank: buffers appended to one spill file, read back by range.

    Wraps the run's :class:`SpillDirectory` (its one-file-per-rank layout)
    and counts what passes through it; the ``DISK`` reservations are its
    callers' (a host chunk takes one for all its pieces, a device buffer
    one per piece).

    Parameters
    ----------
    directory
        The run's spill directory (created on the first :meth:`put`).

    Attributes
    ----------
    bytes_written, bytes_read
        Bytes of buffers written and read back so far (padding not counted).
    seconds_write, seconds_read
        Wall time spent writing and reading, in seconds.
    """

    def __init__(self, directory: SpillDirectory) -> None:
        self.directory = directory
        self.bytes_written = 0
        self.bytes_read = 0
        self.seconds_write = 0.0
        self.seconds_read = 0.0

    @property
    def path(self) -> str:
        """The spill directory's path."""
        return self.directory.path

    def put(self, buffers: Sequence[Any]) -> list[tuple[int, int]]:
        """Append ``buffers`` (buffer-protocol objects) to the rank's spill file in one write.

        Returns
        -------
        list of (int, int)
            ``(offset, nbytes)`` of each buffer in the file, for :meth:`get`.

        Raises
        ------
        SpillError
            If writing failed (a full disk is named as such) or the run's
            directory was removed.
        """
        t0 = time.perf_counter()
        offsets = self.directory.append(buffers)
        sizes = [_size(b) for b in buffers]
        self.seconds_write += time.perf_counter() - t0
        self.bytes_written += sum(sizes)
        return list(zip(offsets, sizes, strict=True))

    def get(self, ranges: Sequence[tuple[int, int]], allocate: Callable[[int], Any] | None = None) -> list[Any]:
        """Read the ``(offset, nbytes)`` ranges back, into one aligned host buffer.

        ``allocate(nbytes)``, where given, makes that buffer (a pooled block);
        otherwise it is fresh memory.

        Returns
        -------
        list of memoryview
            One view per range, of that range's bytes (zero-copy slices of
            one buffer, each starting at an :data:`~mpshuffle.memory.pool.ALIGNMENT`
            boundary).

        Raises
        ------
        SpillError
            If the file cannot be read or ends early.
        """
        if not ranges:
            return []
        buf, positions = self.read(ranges, allocate)
        return [buf[at : at + n] for (_, n), at in zip(ranges, positions, strict=True)]

    def read(
        self, ranges: Sequence[tuple[int, int]], allocate: Callable[[int], Any] | None = None
    ) -> tuple[Any, list[int]]:
        """Read the ``(offset, nbytes)`` ranges back into one aligned host buffer: it and where each starts.

        As :meth:`get` without a view per range (positions are multiples of
        :data:`~mpshuffle.memory.pool.ALIGNMENT`).

        Raises
        ------
        SpillError
            If the file cannot be read or ends early.
        """
        t0 = time.perf_counter()
        buf, positions = self.directory.read_ranges(ranges, allocate)
        self.seconds_read += time.perf_counter() - t0
        self.bytes_read += sum(n for _, n in ranges)
        return buf, positions

    def view(self, ranges: Sequence[tuple[int, int]]) -> list[tuple[Any, int]]:
        """The ``(offset, nbytes)`` ranges for reading once: per range, a read-only buffer and where it starts.

        As :meth:`read` for readers that only read the ranges (the host runs'
        extracts, which copy every piece into the output). A range of at
        least :data:`MAP_MIN_BYTES` is a read-only mapping of the file's pages
        (:meth:`SpillDirectory.map_ranges`): no copy into fresh memory. The
        smaller ranges are read into one buffer of fresh memory
        (:meth:`read`), which they all name: a mapping costs ``mmap``,
        ``madvise`` and, when its last view goes, ``munmap``, whose TLB
        shootdown interrupts every other core running one of the worker's
        threads, so below that size copying the bytes costs less. Where the
        file or the system cannot be mapped that way, every range is read.

        Raises
        ------
        SpillError
            If the file cannot be read or ends early.
        """
        large = [k for k, (_, nbytes) in enumerate(ranges) if nbytes >= MAP_MIN_BYTES]
        mapped: list[tuple[Any, int]] = []
        if large:
            t0 = time.perf_counter()
            got = self.directory.map_ranges([ranges[k] for k in large])
            if got is None:
                buf, positions = self.read(ranges)
                return [(buf, at) for at in positions]
            mapped = got
            self.seconds_read += time.perf_counter() - t0
            self.bytes_read += sum(ranges[k][1] for k in large)
        if len(large) == len(ranges):
            return mapped
        out: list[tuple[Any, int]] = [(None, 0)] * len(ranges)
        for k, view in zip(large, mapped, strict=True):
            out[k] = view
        small = [k for k, (_, nbytes) in enumerate(ranges) if nbytes < MAP_MIN_BYTES]
        buf, positions = self.read([ranges[k] for k in small])
        for k, at in zip(small, positions, strict=True):
            out[k] = (buf, at)
        return out

    def remove(self) -> None:
        """Delete the spill file and its directory; later writes raise :class:`SpillError`. Idempotent."""
        self.directory.remove()


def _size(data: Any) -> int:
    for name in ("nbytes", "size"):  # NumPy / CuPy / memoryview, pyarrow.Buffer
        size = getattr(data, name, None)
        if isinstance(size, int):
            return size
    return memoryview(data).nbytes
