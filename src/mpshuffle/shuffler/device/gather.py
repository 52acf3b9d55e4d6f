"""An extract's gather: one output partition's pieces, wherever they lie, into one packed device piece.

A partition that the exchange could not consolidate (a buffer was spilled)
has one piece per input partition and source rank, some on the device,
some in host memory, some in the rank's spill file. Handing them over as
they are costs the device adapter a copy to the device and a concatenation
per piece and column (48 pieces x 4 columns of pageable memory per extract
in ``benchmarks/results/gpu/README.md`` section 5). Here they become one
piece in two steps:

1. **stage**: the pieces off the device are copied into one device buffer,
   each at a 64-byte aligned position: host pieces one copy each (from
   their page-locked spill blocks), pieces on disk read by range into a
   transfer block (:attr:`~mpshuffle.shuffler.device.buffers.HostBlocks.stage`,
   at most :data:`~mpshuffle.shuffler.device.buffers.STAGE_BYTES` a read
   unless one piece is larger) and copied from there, one copy per block;
2. **gather**: one :func:`~mpshuffle.memory.device.batched_copy` from the
   pieces on the device and the staged buffer into the packed piece
   (columns one after the other, rows in (input partition, source rank)
   order: what the consolidation makes, :func:`~mpshuffle.shuffler.device.exchange.plan_gather`).

The device memory it takes (:func:`device_bytes`: the staged buffer and the
piece, both at once until the staged buffer is dropped) is the caller's to account against the
device budget. With NumPy stand-ins (no GPU) the same steps run on the host.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mpshuffle.memory.device import batched_copy
from mpshuffle.shuffler.device.exchange import plan_gather
from mpshuffle.table.device import column_blocks, piece_dtypes

__all__ = ["Located", "device_bytes", "gather"]

_ALIGN = 64


@dataclasses.dataclass(frozen=True)
class Located:
    """One piece of the partition and where its bytes lie: exactly one of ``device``, ``host``, ``file_offset``.

    Attributes
    ----------
    nbytes, nrows
        The piece's bytes and rows.
    device
        A device buffer holding the piece at ``offset``.
    host
        A host buffer holding the piece at ``offset``.
    offset
        Where the piece starts in ``device`` or ``host``.
    file_offset
        Where the piece starts in the rank's spill file (``-1``: not on disk).
    """

    nbytes: int
    nrows: int
    device: Any = None
    host: Any = None
    offset: int = 0
    file_offset: int = -1


def _padded(n: int) -> int:
    return n + (-n) % _ALIGN


def device_bytes(pieces: Sequence[Located], meta: bytes) -> tuple[int, int]:
    """Device bytes a :func:`gather` of ``pieces`` (of metadata ``meta``) allocates: the staged buffer and the piece."""
    items = np.array([d.itemsize for d in piece_dtypes(meta)], dtype=np.int64)
    rows = sum(p.nrows for p in pieces)
    return (
        sum(_padded(p.nbytes) for p in pieces if p.device is None),
        int(column_blocks(np.array([rows]), items).sum()),
    )


def gather(
    pieces: Sequence[Located],
    meta: bytes,
    *,
    xp: Any,
    read: Callable[[Sequence[tuple[int, int]]], tuple[Any, list[int]]],
    stage_bytes: int,
) -> tuple[Any, int]:
    """Gather ``pieces`` (in the order their rows keep) into one packed buffer on the device.

    Parameters
    ----------
    pieces
        The partition's pieces, all of the metadata ``meta``.
    xp
        The array module of the device buffers (CuPy; NumPy for stand-ins).
    read
        ``read(ranges)``: reads ``(file offset, bytes)`` ranges of the spill
        file into one host block and returns it and each range's position
        (multiples of 64; :meth:`~mpshuffle.memory.store.DiskTier.read` with
        a transfer block).
    stage_bytes
        Most bytes of spill-file ranges read into one block (a larger piece
        is read alone).

    Returns
    -------
    buffer, nrows
        The packed piece (1-D ``uint8`` on the device) and its rows.

    Raises
    ------
    SpillError
        If the spill file cannot be read.
    MemoryError
        If the device has no room for the staged buffer or the piece.
    """
    off_device = [k for k, p in enumerate(pieces) if p.device is None]
    on_disk = [k for k in off_device if pieces[k].host is None]
    # The pieces on disk first, one after the other: a block read of several is
    # then one contiguous range of the staged buffer.
    at = {}
    total = 0
    for k in on_disk + [k for k in off_device if pieces[k].host is not None]:
        at[k] = total
        total += _padded(pieces[k].nbytes)
    staged = xp.empty(total, dtype=np.uint8) if off_device else None
    for k in off_device:
        p = pieces[k]
        if p.host is not None:
            _to_device(xp, staged, at[k], p.host[p.offset : p.offset + p.nbytes])
    # Spill-file ranges in blocks: their positions in a block are the same 64-byte
    # padding as in the staged buffer, so each block is one copy to the device.
    first = 0
    while first < len(on_disk):
        last, span = first + 1, _padded(pieces[on_disk[first]].nbytes)
        while last < len(on_disk) and span + _padded(pieces[on_disk[last]].nbytes) <= stage_bytes:
            span += _padded(pieces[on_disk[last]].nbytes)
            last += 1
        group = on_disk[first:last]
        block, positions = read([(pieces[k].file_offset, pieces[k].nbytes) for k in group])
        start = at[group[0]]
        assert all(at[k] - start == pos for k, pos in zip(group, positions, strict=True))
        end = positions[-1] + pieces[group[-1]].nbytes
        _to_device(xp, staged, start, block[:end])
        del block
        first = last
    sources: list[Any] = []
    index: dict[int, int] = {}
    table = []
    for k, p in enumerate(pieces):
        if p.device is not None:
            key = id(p.device)
            if key not in index:
                index[key] = len(sources)
                sources.append(p.device)
            table.append((index[key], p.offset, 0, p.nrows))
        else:
            table.append((-1, at[k], 0, p.nrows))
    if staged is not None:
        sources.append(staged)
        table = [(len(sources) - 1 if s < 0 else s, off, pid, rows) for s, off, pid, rows in table]
    plan = plan_gather(np.array(table, dtype=np.int64).reshape(-1, 4), meta)
    nrows = int(plan.totals.sum())
    size = int(plan.sizes.sum())
    out = xp.empty(size, dtype=np.uint8)
    if len(plan.segments):
        batched_copy(sources, [out], plan.segments)
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()
    return out, nrows


def _to_device(xp: Any, staged: Any, at: int, host: Any) -> None:
    n = int(host.nbytes)
    if not n:
        return
    if xp is np:
        staged[at : at + n] = host
    else:
        staged[at : at + n].set(np.asarray(host))
