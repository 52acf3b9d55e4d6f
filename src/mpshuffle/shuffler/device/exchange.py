"""The pieces of a device exchange that need no run state: round sizes, headers, consolidation.

An exchange moves every rank's outbox in *rounds*; both sides of every pair
must post their NCCL transfers in the same order without further messages,
so every rank first sends every peer its *headers* (per input slot: input
partition, byte range for that peer, pieces, metadata) and the number of
slots it can take per round; all ranks then take the smallest number.
After the last round a rank may *consolidate* its output partitions: one
batched copy gathers each partition's pieces into one packed buffer; the
copy's segments are planned here (:func:`plan_consolidation`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from mpshuffle.errors import ShuffleError
from mpshuffle.memory import BufferResource, MemoryType
from mpshuffle.table.device import column_blocks, piece_dtypes

if TYPE_CHECKING:
    from mpshuffle.comm import Communicator
    from mpshuffle.shuffler.device.buffers import Incoming, Outgoing

__all__ = ["UNBOUNDED_SLOTS", "Consolidation", "keep_accepted", "plan_consolidation", "plan_gather", "slots_per_round", "swap_headers"]

# Headers of an exchange, taken with Communicator.recv: ("mpsd-x", op_id, "headers").
XTAG = "mpsd-x"

# Slots per round a rank without a device budget announces (all ranks take the smallest).
UNBOUNDED_SLOTS = 2**31


def keep_accepted(outbox: list[Outgoing], accepted: list[str] | None) -> list[Outgoing]:
    """The outbox tables of the insert attempts the barrier accepted; the others' buffers are released.

    An insert execution that Dask abandoned (its run restarted while it ran)
    may have packed its table too; only the attempt whose result Dask kept
    counts, or its rows would come out twice. ``accepted`` is the attempt id
    per input partition, or ``None`` (keep all).
    """
    if accepted is None:
        return outbox

    def kept(o: Outgoing) -> bool:
        return 0 <= o.input_index < len(accepted) and accepted[o.input_index] == o.attempt

    for o in outbox:
        if not kept(o) and o.buffer is not None:
            o.buffer.release()
            o.buffer = None
    return [o for o in outbox if kept(o)]


def slots_per_round(resource: BufferResource, outbox: list[Outgoing]) -> int:
    """How many input slots this rank can take per round under its device budget.

    A round holds, for a moment, the slots' outbox ranges and what they
    bring in; with about as much coming in as going out, a slot costs twice
    the largest outbox buffer. At least 1; without a budget, no limit
    (:data:`UNBOUNDED_SLOTS`: the ranks that have one decide).
    """
    available = resource.available(MemoryType.DEVICE)
    if available is None:
        return UNBOUNDED_SLOTS
    biggest = max((end for o in outbox for _, end, _ in o.ranges.values()), default=0)
    return max(1, int(available // max(1, 2 * biggest)))


def swap_headers(
    comm: Communicator, op_id: int, outbox: list[Outgoing], per_round: int, timeout: float
) -> tuple[dict[int, list[Any]], int]:
    """Send every peer this rank's headers and take theirs (on the exchange thread).

    Returns
    -------
    headers : dict[int, list]
        Per peer rank, one ``[input_index, start, end, pieces, meta]`` per
        slot of its outbox, the range being what it sends to this rank.
    per_round : int
        The smallest number of slots per round any rank announced.

    Raises
    ------
    ShuffleError
        If a peer's headers did not come within ``timeout`` seconds.
    """
    rank, nranks = comm.rank, comm.nranks
    tag = (XTAG, op_id, "headers")
    for dest in range(nranks):
        if dest != rank:
            entries = [[o.input_index, *o.ranges.get(dest, (0, 0, [])), o.meta] for o in outbox]
            comm.send_nowait(dest, tag, [msgpack.packb({"per_round": per_round, "entries": entries})])
    headers: dict[int, list[Any]] = {}
    for src in range(nranks):
        if src != rank:
            try:
                header = msgpack.unpackb(bytes(comm.recv(src, tag, timeout)[0]))
            except Exception as e:
                raise ShuffleError(f"piece headers from rank {src} failed: {e}") from e
            headers[src] = header["entries"]
            per_round = min(per_round, int(header["per_round"]))
    return headers, per_round


@dataclasses.dataclass(frozen=True)
class Consolidation:
    """The plan of one consolidation (see :func:`plan_consolidation`).

    Attributes
    ----------
    pids
        Output partition ids, ascending (shape ``(k,)``).
    totals
        Rows of each of them (shape ``(k,)``).
    sizes
        Bytes of each one's consolidated buffer (shape ``(k,)``).
    segments
        Copies for :func:`~mpshuffle.memory.device.batched_copy`, one row
        ``(source buffer, source offset, output, output offset, bytes)`` per
        piece and column (shape ``(m, 5)``).
    """

    pids: np.ndarray
    totals: np.ndarray
    sizes: np.ndarray
    segments: np.ndarray


def plan_consolidation(incoming: list[Incoming], meta: bytes) -> Consolidation:
    """Plan gathering each output partition's pieces of ``incoming`` into one packed buffer.

    ``incoming`` is in (input partition, source rank) order; each output's
    rows keep that order. All pieces share the metadata ``meta``; a packed
    piece holds its columns one after the other, each 64-byte aligned
    (:func:`~mpshuffle.table.device.column_blocks`).
    """
    # One row per received piece: (piece's buffer, byte offset there, pid, rows).
    table = np.array(
        [(k, off, pid, rows) for k, inc in enumerate(incoming) for pid, off, _, rows in inc.pieces],
        dtype=np.int64,
    ).reshape(-1, 4)
    return plan_gather(table, meta)


def plan_gather(table: Any, meta: bytes) -> Consolidation:
    """Plan copying pieces into one packed buffer per output partition: the segments of one batched copy.

    ``table`` has one row per piece, ``(source buffer, byte offset there,
    partition id, rows)``, in the order each partition's rows keep; all
    pieces share the metadata ``meta``; a packed piece holds its columns one
    after the other, each 64-byte aligned
    (:func:`~mpshuffle.table.device.column_blocks`). Used by the
    consolidation (every owned partition at once) and by an extract's gather
    (:mod:`mpshuffle.shuffler.device.gather`, one partition).
    """
    items = np.array([d.itemsize for d in piece_dtypes(meta)], dtype=np.int64)
    table = np.asarray(table, dtype=np.int64).reshape(-1, 4)
    # Stable by pid: within a partition pieces stay in (input, source) order.
    table = table[np.argsort(table[:, 2], kind="stable")]
    pids, first, counts = np.unique(table[:, 2], return_index=True, return_counts=True)
    rows = table[:, 3]
    totals = np.add.reduceat(rows, first) if len(rows) else np.zeros(0, dtype=np.int64)
    # Row of each piece within its partition's output.
    before = np.cumsum(rows) - rows
    row_in_part = before - np.repeat(before[first], counts)
    blocks_in = column_blocks(rows, items)  # pieces x columns
    blocks_out = column_blocks(totals, items)  # partitions x columns
    part_of_piece = np.repeat(np.arange(len(pids)), counts)
    segments = np.empty((len(table), len(items), 5), dtype=np.int64)
    segments[:, :, 0] = table[:, 0:1]
    segments[:, :, 1] = table[:, 1:2] + (np.cumsum(blocks_in, axis=1) - blocks_in)
    segments[:, :, 2] = part_of_piece[:, None]
    out_offs = (np.cumsum(blocks_out, axis=1) - blocks_out)[part_of_piece]
    segments[:, :, 3] = out_offs + row_in_part[:, None] * items[None, :]
    segments[:, :, 4] = rows[:, None] * items[None, :]
    return Consolidation(pids, totals, blocks_out.sum(axis=1), segments.reshape(-1, 5))
