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
from mpshuffle.memory.pool import HostPool, size_class
from mpshuffle.memory.store import DiskTier, to_host
from mpshuffle.table import owned_partitions

__all__ = [
    "STAGE_BYTES",
    "DeviceBuffer",
    "Held",
    "HostBlocks",
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

@dataclasses.dataclass(frozen=True)
class HostBlocks:
    """Where a device run's copies in host memory come from: the worker's pooled blocks.

    ``spill`` serves buffers moved device -> host (and outbox buffers read
    back from disk for their round); ``stage`` serves transfer blocks of at
    most :data:`STAGE_BYTES`: a device buffer passing straight to disk, and
    spilled pieces read back on their way to the device
    (:mod:`mpshuffle.shuffler.device.gather`). ``None``: fresh memory every
    time. See :meth:`mpshuffle.shuffler.context.WorkerContext` for their
    bounds.
    """

    spill: HostPool | None = None
    stage: HostPool | None = None

    def spill_array(self, nbytes: int) -> Any:
        """A host array of ``nbytes`` for a spilled buffer (pooled where there is a pool)."""
        return self.spill.array(nbytes) if self.spill is not None else _host_empty(nbytes)

    def held_bytes(self, nbytes: int) -> int:
        """Host bytes a spilled buffer of ``nbytes`` holds: its pooled block's size class."""
        return size_class(nbytes) if self.spill is not None and nbytes else nbytes

    def host_cost(self, nbytes: int) -> int:
        """Host bytes a spill of ``nbytes`` adds to the ``HOST`` use: its block, less an idle block it takes over."""
        if self.spill is None:
            return nbytes
        return self.held_bytes(nbytes) - self.spill.reusable(nbytes)

    def stage_array(self, nbytes: int) -> Any:
        """A transfer block of at least ``nbytes`` (one size, :data:`STAGE_BYTES`, up to that, so blocks are reused)."""
        size = max(int(nbytes), STAGE_BYTES)
        return self.stage.array(size) if self.stage is not None else _host_empty(size)


#: Bytes of one transfer block (:attr:`HostBlocks.stage`): a copy to or from the device of
#: this size runs at the bus's speed in page-locked memory, and the blocks stay few.
STAGE_BYTES = 64 * 2**20


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

    @property
    def nbytes(self) -> int:
        """Bytes the buffer holds in its tier (its data's; on disk, its segments')."""
        if self.disk is not None:
            return sum(n for _, n, _ in self.disk)
        return int(self.data.nbytes) if self.data is not None else 0

    def spill(self, resource: BufferResource, blocks: HostBlocks | None = None) -> int:
        """Move to host memory (the device tier's move down); return the bytes moved (0 if already there).

        The copy goes into a block of ``blocks.spill`` (page-locked and reused
        across spills and runs where the worker has a GPU), accounted as
        ``HOST`` at the block's size.
        """
        if not self.on_device:
            return 0
        blocks = blocks or HostBlocks()
        nbytes = int(self.data.nbytes)
        host = to_host(self.data, blocks.spill_array(nbytes))
        self.reservation.release()
        self.data = host
        self.reservation = resource.reserve(MemoryType.HOST, blocks.held_bytes(nbytes))
        self.on_device = False
        return nbytes

    def spill_to_disk(self, resource: BufferResource, disk: DiskTier, segments: Sequence[tuple[int, int]]) -> int:
        """Append a host buffer's ``(start, end)`` byte ranges to the run's spill file (one write).

        The host memory is given up (its reservation first, so a pooled block
        goes back to its pool within the budget) and each written segment is
        accounted as ``DISK``. Returns the bytes written (0 for a buffer on
        the device or already on disk).

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
        self.reservation.release()
        self.data = None
        return sum(nbytes for _, nbytes in ranges)

    def spill_through(
        self, resource: BufferResource, disk: DiskTier, segments: Sequence[tuple[int, int]], blocks: HostBlocks,
    ) -> int:
        """Move a device buffer straight to disk, through transfer blocks; return the bytes written.

        For a host tier with no room even after the store made room there:
        the ``segments`` (as :meth:`spill_to_disk`'s) are copied to a
        transfer block of :attr:`HostBlocks.stage` a group at a time (a group
        spans at most :data:`STAGE_BYTES`, or one larger segment) and
        appended from there; host memory holds no more than one block.

        Raises
        ------
        SpillError
            If a write failed; the buffer stays on the device.
        """
        if not self.on_device:
            return 0
        written: list[tuple[int, int]] = []
        for first, last in _groups(segments, STAGE_BYTES):
            lo, hi = segments[first][0], segments[last - 1][1]
            block = blocks.stage_array(hi - lo)
            to_host(self.data[lo:hi], block[: hi - lo])
            written += disk.put([block[s - lo : e - lo] for s, e in segments[first:last]])
            del block
        self.disk = [(offset, nbytes, resource.reserve(MemoryType.DISK, nbytes)) for offset, nbytes in written]
        self.reservation.release()
        self.data = None
        self.on_device = False
        return sum(nbytes for _, nbytes in written)

    def load(self, resource: BufferResource, disk: DiskTier, blocks: HostBlocks | None = None) -> int:
        """Read a buffer written as one segment back into host memory; return the bytes read.

        Raises
        ------
        SpillError
            If the spill file cannot be read or ends early.
        """
        if self.disk is None:
            return 0
        blocks = blocks or HostBlocks()
        ((offset, nbytes, res),) = self.disk
        (view,) = disk.get([(offset, nbytes)], blocks.spill_array)
        self.data = np.frombuffer(view, dtype=np.uint8)
        self.disk = None
        res.release()
        self.reservation = resource.reserve(MemoryType.HOST, blocks.held_bytes(nbytes))
        return nbytes

    def release(self) -> None:
        """Give back the buffer's memory and disk reservations (views of it stay valid)."""
        self.reservation.release()
        for *_, res in self.disk or ():
            res.release()


def _groups(segments: Sequence[tuple[int, int]], span: int) -> list[tuple[int, int]]:
    """``[first, last)`` index ranges of consecutive ``segments`` that each span at most ``span`` bytes
    (or one segment, where it alone is larger)."""
    groups: list[tuple[int, int]] = []
    first = 0
    for k in range(1, len(segments) + 1):
        if k == len(segments) or segments[k][1] - segments[first][0] > span:
            groups.append((first, k))
            first = k
    return groups


def _host_empty(nbytes: int) -> Any:
    raw = np.empty(nbytes + 64, dtype=np.uint8)
    start = (-raw.ctypes.data) % 64
    return raw[start : start + nbytes]


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
    blocks: HostBlocks = dataclasses.field(default_factory=HostBlocks)

    @property
    def tier(self) -> MemoryType:
        """The tier the buffer is in now."""
        return self.buffer.tier

    @property
    def nbytes(self) -> int:
        """Bytes the buffer holds in its tier."""
        return self.buffer.nbytes

    def move_down(self, to: MemoryType) -> int:
        """Device -> host, device -> disk (through transfer blocks) or host -> disk; the bytes moved.

        Raises
        ------
        SpillError
            If writing to disk failed.
        """
        if self.buffer.on_device:
            if to is MemoryType.HOST:
                return self.buffer.spill(self.resource, self.blocks)
            return self.buffer.spill_through(self.resource, self.disk, self.segments, self.blocks)
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
