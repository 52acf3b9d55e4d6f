"""The buffers of a device run: outbox, received and consolidated buffers in their memory tiers.

A :class:`DeviceBuffer` is one 1-D ``uint8`` buffer of packed pieces; it
lives in one tier of the one store (:mod:`mpshuffle.memory.store`): on the
device (``DEVICE``), in host memory (``HOST``) or in the run's spill file
(``DISK``), and moves down by the store's policy (:class:`Held`,
:func:`~mpshuffle.memory.store.spill_down`). :class:`Outgoing` is an inserted table waiting for
its exchange, :class:`Incoming` what one rank sent of one input partition,
:class:`Output` one consolidated output partition.

Spill file: the store's :class:`~mpshuffle.memory.store.DiskTier`, one file
per run and rank (in ``<spill_dir>/<spill_prefix>-op<op_id>-r<rank>``, as the
host path's postbox), made on the first write and removed with its directory
when the run closes or fails. A received buffer is written piece by piece
(one ``writev``), and an extract reads its partition's pieces back by range;
an outbox buffer is written whole, to be read back for its exchange round,
unless all its rows stay on this rank (:func:`own_pieces`; always so on one
rank): it is written piece by piece like a received buffer, which it becomes.

The array helpers (:func:`empty_device`, :func:`to_device`, :func:`allocate`,
:func:`cupy_module`) import CuPy only when called, so the run's logic can be
tested with NumPy stand-ins.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from mpshuffle.memory import BufferResource, MemoryType, Reservation
from mpshuffle.memory.store import DiskTier, to_host
from mpshuffle.table import owned_partitions

__all__ = [
    "DeviceBuffer",
    "Held",
    "Incoming",
    "Outgoing",
    "Output",
    "Piece",
    "allocate",
    "cupy_module",
    "device_ptr",
    "empty_device",
    "own_pieces",
    "to_device",
]

@dataclasses.dataclass
class DeviceBuffer:
    """One device buffer of the run (an outbox or a received buffer), maybe spilled to host or disk."""

    data: Any  # 1-D uint8, CuPy (device) or NumPy (spilled / host twin); None while on disk
    reservation: Reservation
    on_device: bool = True
    # While on disk: per written segment (offset in the rank's spill file, bytes, DISK reservation).
    disk: list[tuple[int, int, Reservation]] | None = None

    @property
    def tier(self) -> MemoryType:
        """The store tier the buffer is in now."""
        if self.disk is not None:
            return MemoryType.DISK
        return MemoryType.DEVICE if self.on_device else MemoryType.HOST

    def spill(self, resource: BufferResource) -> int:
        """Move to host memory (the device tier's move down); return the bytes moved (0 if already there)."""
        if not self.on_device:
            return 0
        nbytes = int(self.data.nbytes)
        self.data = to_host(self.data)
        self.reservation.release()
        self.reservation = resource.reserve(MemoryType.HOST, nbytes)
        self.on_device = False
        return nbytes

    def spill_to_disk(self, resource: BufferResource, disk: DiskTier, segments: Sequence[tuple[int, int]]) -> int:
        """Append a host buffer's ``(start, end)`` byte ranges to the run's spill file (one write).

        The host memory is given up and each written segment is accounted
        as ``DISK``. Returns the bytes written (0 for a buffer on the
        device or already on disk).

        Raises
        ------
        SpillError
            If the write failed; the buffer stays in host memory (what was
            written goes when the run's directory is removed).
        """
        if self.on_device or self.disk is not None:
            return 0
        ranges = disk.put([self.data[start:end] for start, end in segments])
        self.disk = [(offset, nbytes, resource.reserve(MemoryType.DISK, nbytes)) for offset, nbytes in ranges]
        self.data = None
        self.reservation.release()
        return sum(nbytes for _, nbytes in ranges)

    def load(self, resource: BufferResource, disk: DiskTier) -> int:
        """Read a buffer written as one segment back into host memory; return the bytes read.

        Raises
        ------
        SpillError
            If the spill file cannot be read or ends early.
        """
        if self.disk is None:
            return 0
        ((offset, nbytes, res),) = self.disk
        (view,) = disk.get([(offset, nbytes)])
        self.data = np.frombuffer(view, dtype=np.uint8)
        self.disk = None
        res.release()
        self.reservation = resource.reserve(MemoryType.HOST, nbytes)
        return nbytes

    def release(self) -> None:
        """Give back the buffer's memory and disk reservations (views of it stay valid)."""
        self.reservation.release()
        for *_, res in self.disk or ():
            res.release()


@dataclasses.dataclass
class Held:
    """A :class:`DeviceBuffer` as the store holds it (a :class:`~mpshuffle.memory.store.Spillable`).

    ``segments`` are the ``(start, end)`` byte ranges it is written to disk
    as: one per piece for a received buffer (or an outbox buffer whose rows
    all stay here), the whole buffer for an outbox buffer with rows for peers.
    """

    buffer: DeviceBuffer
    segments: list[tuple[int, int]]
    resource: BufferResource
    disk: DiskTier

    @property
    def tier(self) -> MemoryType:
        """The tier the buffer is in now."""
        return self.buffer.tier

    def move_down(self) -> int:
        """Device -> host, or host -> disk; the bytes moved.

        Raises
        ------
        SpillError
            If writing to disk failed.
        """
        if self.buffer.on_device:
            return self.buffer.spill(self.resource)
        return self.buffer.spill_to_disk(self.resource, self.disk, self.segments)


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
