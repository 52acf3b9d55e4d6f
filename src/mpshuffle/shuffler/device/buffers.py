"""The buffers of a device run: outbox, received and consolidated buffers in their memory tiers.

A :class:`DeviceBuffer` is one 1-D ``uint8`` buffer of packed pieces; it
lives on the device (``DEVICE``), in host memory (``HOST``) or in the run's
spill directory (``DISK``). :class:`Outgoing` is an inserted table waiting for
its exchange, :class:`Incoming` what one rank sent of one input partition,
:class:`Output` one consolidated output partition.

Spill files: one directory per run and rank,
``<spill_dir>/<spill_prefix>-op<op_id>-r<rank>``, made on the first write and
removed with everything in it when the run closes or fails. A received
buffer is written piece by piece into one file per output partition (as the
host path's postbox does), so an extract reads one file; an outbox buffer is
written whole into ``outbox/``, to be read back for its exchange round,
unless all its rows stay on this rank (:func:`own_pieces`; always so on one
rank): it is written piece by piece like a received buffer, which it becomes.

The array helpers (:func:`empty_device`, :func:`to_device`, :func:`allocate`,
:func:`cupy_module`) import CuPy only when called, so the run's logic can be
tested with NumPy stand-ins.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from mpshuffle.errors import SpillError
from mpshuffle.memory import BufferResource, MemoryType, Reservation, SpillDirectory
from mpshuffle.table import owned_partitions

__all__ = [
    "DeviceBuffer",
    "Incoming",
    "Outgoing",
    "Output",
    "Piece",
    "allocate",
    "cupy_module",
    "device_ptr",
    "empty_device",
    "over",
    "own_pieces",
    "spill_down",
    "to_device",
]

@dataclasses.dataclass
class DeviceBuffer:
    """One device buffer of the run (an outbox or a received buffer), maybe spilled to host or disk."""

    data: Any  # 1-D uint8, CuPy (device) or NumPy (spilled / host twin); None while on disk
    reservation: Reservation
    on_device: bool = True
    # While on disk: per written segment (file key, offset in that file, bytes, DISK reservation).
    disk: list[tuple[int, int, int, Reservation]] | None = None

    def spill(self, resource: BufferResource) -> int:
        """Move to host memory; return the bytes moved (0 if already there)."""
        if not self.on_device:
            return 0
        nbytes = int(self.data.nbytes)
        data = self.data
        self.data = data.get() if hasattr(data, "get") else data.copy()
        self.reservation.release()
        self.reservation = resource.reserve(MemoryType.HOST, nbytes)
        self.on_device = False
        return nbytes

    def spill_to_disk(
        self, resource: BufferResource, directory: SpillDirectory, segments: Sequence[tuple[int, int, int]]
    ) -> int:
        """Write a host buffer's ``(file key, start, end)`` byte ranges to ``directory``.

        The host memory is given up and the written bytes are accounted as
        ``DISK``. Returns the bytes written (0 for a buffer on the device or
        already on disk).

        Raises
        ------
        SpillError
            If a write failed; the buffer stays in host memory (what was
            written goes when the run's directory is removed).
        """
        if self.on_device or self.disk is not None:
            return 0
        written: list[tuple[int, int, int, Reservation]] = []
        try:
            for key, start, end in segments:
                offset, nbytes = directory.write(key, self.data[start:end])
                written.append((key, offset, nbytes, resource.reserve(MemoryType.DISK, nbytes)))
        except SpillError:
            for *_, res in written:
                res.release()
            raise
        self.disk = written
        self.data = None
        self.reservation.release()
        return sum(w[2] for w in written)

    def load(self, resource: BufferResource, directory: SpillDirectory) -> int:
        """Read a buffer written as one segment back into host memory; return the bytes read.

        Raises
        ------
        SpillError
            If the file cannot be read.
        """
        if self.disk is None:
            return 0
        ((key, offset, nbytes, res),) = self.disk
        view = directory.read(key)  # one key per buffer: the file holds only this buffer
        if len(view) < offset + nbytes:
            raise SpillError(f"spill file {key} in {directory.path} is missing or short (the run was freed)")
        self.data = np.frombuffer(view, dtype=np.uint8)[offset : offset + nbytes]
        self.disk = None
        res.release()
        self.reservation = resource.reserve(MemoryType.HOST, nbytes)
        return nbytes

    def release(self) -> None:
        """Give back the buffer's memory and disk reservations (views of it stay valid)."""
        self.reservation.release()
        for *_, res in self.disk or ():
            res.release()


# One piece of a buffer: (pid, offset in the range, data bytes, rows).
Piece = tuple[int, int, int, int]


@dataclasses.dataclass
class Outgoing:
    """One inserted table, packed: per destination rank a byte range and its pieces."""

    input_index: int
    buffer: DeviceBuffer | None
    ranges: dict[int, tuple[int, int, list[Piece]]]
    meta: bytes  # the pieces' metadata (one for all of them, see piece_metadata)
    attempt: str = ""  # the insert execution that made it (see barrier's ``accepted``)


@dataclasses.dataclass
class Incoming:
    """The bytes one source rank sent of one input partition."""

    input_index: int
    src: int
    buffer: DeviceBuffer
    pieces: list[Piece]
    meta: bytes


@dataclasses.dataclass
class Output:
    """One output partition, consolidated: its rows from every input in one packed piece."""

    buffer: DeviceBuffer
    nrows: int
    meta: bytes



def outbox_ranges(
    pieces: dict[int, Any], npartitions: int, nranks: int
) -> tuple[Any, dict[int, tuple[int, int, list[Piece]]], bytes]:
    """Where each destination rank's pieces lie in one packed buffer.

    Parameters
    ----------
    pieces
        Output partition id -> :class:`~mpshuffle.table.PackedData` whose data
        are views of one buffer, laid out rank-major (as
        :func:`~mpshuffle.table.device.pack_sorted` makes them).

    Returns
    -------
    buffer
        The buffer the pieces are views of, or ``None`` without pieces.
    ranges
        Destination rank -> ``(start, end, pieces)``: its byte range in the
        buffer and each piece's ``(pid, offset in the range, bytes, rows)``.
    meta
        The pieces' shared metadata (``b""`` without pieces).
    """
    ranges: dict[int, tuple[int, int, list[Piece]]] = {}
    if not pieces:
        return None, ranges, b""
    some = next(iter(pieces.values()))
    base = some.data.base if some.data.base is not None else some.data
    base_ptr = device_ptr(base)
    for dest in range(nranks):
        mine = [(p, pieces[p]) for p in owned_partitions(dest, nranks, npartitions) if p in pieces]
        if not mine:
            continue
        start = device_ptr(mine[0][1].data) - base_ptr
        end = device_ptr(mine[-1][1].data) - base_ptr + int(mine[-1][1].data.nbytes)
        ranges[dest] = (start, end, [
            (p, device_ptr(pk.data) - base_ptr - start, int(pk.data.nbytes), pk.nrows) for p, pk in mine
        ])
    return base, ranges, bytes(some.metadata)


def own_pieces(out: Outgoing, rank: int) -> list[Piece] | None:
    """The pieces of an outbox buffer whose rows all stay on ``rank``, offsets from the buffer's start.

    ``None`` where some of its rows go to another rank. Such a buffer needs no
    transfer: at the exchange it becomes this rank's received buffer with
    these pieces, so it can spill as one (piece by piece, one file per
    output partition) and is never read back for a round.
    """
    if set(out.ranges) != {rank}:
        return None
    start, _, pieces = out.ranges[rank]
    return [(pid, off + start, nbytes, rows) for pid, off, nbytes, rows in pieces]


def over(resource: BufferResource, memory_type: MemoryType) -> bool:
    """Whether ``resource``'s use of ``memory_type`` is past its budget."""
    available = resource.available(memory_type)
    return available is not None and available < 0


def spill_down(
    resource: BufferResource,
    entries: list[tuple[DeviceBuffer, list[Piece] | None]],
    scope: Callable[[], AbstractContextManager[Any]],
    spill_in: SpillDirectory,
    spill_out: SpillDirectory,
    outbox_keys: Iterator[int],
    count: Callable[[str, float], None],
) -> None:
    """Move the oldest buffers down a tier while a tier is over its budget.

    Device buffers are copied to host while the ``DEVICE`` use is past its
    budget; then host buffers are written to disk while the ``HOST`` use is
    past its budget (the worker's, shared with its host shuffles).

    Parameters
    ----------
    entries
        Buffers oldest first, each with its pieces (a received buffer, or an
        outbox buffer whose rows all stay on this rank: written piece by
        piece into one file per output partition under ``spill_in``) or
        ``None`` (an outbox buffer with rows for peers, written whole under
        ``spill_out`` with the next key of ``outbox_keys``).
    scope
        Makes the buffers' GPU current (for the device-to-host copies).
    count
        ``count(statistic, amount)`` adds to the run's statistics
        (``bytes_spilled_host``, ``seconds_spill_host``, ``bytes_spilled_disk``,
        ``seconds_spill_disk``), also for what was written before an error.

    Raises
    ------
    SpillError
        If writing to disk failed (e.g. the disk is full).
    """
    if over(resource, MemoryType.DEVICE):
        t0 = time.perf_counter()
        moved = 0
        with scope():
            for b, _ in entries:
                if not over(resource, MemoryType.DEVICE):
                    break
                moved += b.spill(resource)
        count("bytes_spilled_host", moved)
        count("seconds_spill_host", time.perf_counter() - t0)
    if not over(resource, MemoryType.HOST):
        return
    t0 = time.perf_counter()
    written = 0
    try:
        for b, pieces in entries:
            if not over(resource, MemoryType.HOST):
                break
            if b.on_device or b.disk is not None:
                continue
            if pieces is None:
                written += b.spill_to_disk(resource, spill_out, [(next(outbox_keys), 0, int(b.data.nbytes))])
            else:
                segments = [(pid, off, off + nbytes) for pid, off, nbytes, _ in pieces]
                written += b.spill_to_disk(resource, spill_in, segments)
    finally:
        count("bytes_spilled_disk", written)
        count("seconds_spill_disk", time.perf_counter() - t0)


def device_ptr(a: Any) -> int:
    data = getattr(a, "data", None)
    ptr = getattr(data, "ptr", None)
    if ptr is not None:  # CuPy
        return int(ptr)
    return int(a.__array_interface__["data"][0])


def allocate(xp: Any, sizes: list[int]) -> list[Any]:
    """One ``uint8`` array of each size (``MemoryError`` where the device is full)."""
    return [xp.empty(n, dtype=np.uint8) for n in sizes]


def cupy_module() -> Any:
    import cupy

    return cupy


def empty_device(nbytes: int) -> Any:
    import cupy

    return cupy.empty(nbytes, dtype=np.uint8)


def to_device(host: Any) -> Any:
    import cupy

    return cupy.asarray(host)
