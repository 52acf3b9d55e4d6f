"""The baseline of ``gpu_bench.py``: a bulk-synchronous device shuffle over NCCL.

Not part of mpshuffle: the library's device shuffle is
:class:`mpshuffle.shuffler.device.DeviceRun`. This one is kept beside its
benchmark as the transport baseline that ``DeviceRun`` is measured against
(no outbox, no barrier task, no consolidation: each round is received straight
into per-column output buffers). ``gpu_bench.py`` imports it from this folder.

A :class:`DeviceShuffle` exists on every rank for one shuffle. It runs in
*rounds*: in each round every rank calls :meth:`DeviceShuffle.insert` with
one :class:`~mpshuffle.table.device.DeviceTable` (possibly empty), together.
A round

1. hashes the key columns and orders the rows by owner rank, then output
   partition (a stable radix argsort of narrow ids, on the device);
2. gathers every column in that order (one pass over the data, on the device);
3. sends each peer the ``npartitions`` row counts over the host communicator
   (the only host traffic: a few bytes per partition);
4. receives each column straight into one output buffer per column, laid out
   partition by partition (and within a partition source rank by source
   rank), with one grouped NCCL exchange: every (column, partition) piece is
   one NCCL send matched by one receive at its final place, so no unpack copy
   is needed;
5. if the device buffers of received rounds pass the device budget, spills
   the oldest rounds to host memory.

:meth:`DeviceShuffle.extract` returns an output partition: zero-copy column
views when it came in one round and is on the device, else one
concatenation (and a host-to-device copy of spilled rounds).

Rounds are bulk synchronous, unlike the host :class:`~mpshuffle.shuffler.Shuffler`'s
streaming inserts: NCCL point-to-point transfers must be posted by both
sides in the same order, and a round gives every rank that order without
further messages.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from mpshuffle.errors import ShuffleError
from mpshuffle.memory import BufferResource, MemoryType, Reservation
from mpshuffle.table.device import (
    DeviceAdapter,
    DeviceTable,
    concat_tables,
    partition_order,
    rank_major_pids,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from mpshuffle.comm.base import Communicator
    from mpshuffle.comm.nccl import NcclTransport

__all__ = ["DeviceShuffle"]

TAG = "mpsdev"


@dataclasses.dataclass
class _Round:
    """The rows one round delivered to this rank: one buffer per column."""

    columns: dict[str, Any]
    # pid -> (first row, number of rows) in every column buffer
    ranges: dict[int, tuple[int, int]]
    reservation: Reservation
    on_device: bool = True

    @property
    def nbytes(self) -> int:
        return sum(int(c.nbytes) for c in self.columns.values())


class DeviceShuffle:
    """One rank's share of a device shuffle (see the module docstring).

    Parameters
    ----------
    comm
        Host communicator of the ranks (control messages).
    transport
        NCCL transport over the same ranks (device bytes).
    npartitions
        Number of output partitions; partition ``p`` goes to rank ``p % nranks``.
    on
        Key column names, in order.
    op_id
        Id of the shuffle, unique among those running on ``comm``.
    resource
        Accounts device and host bytes; its ``DEVICE`` limit is the device
        budget (``spill_device``) past which received rounds spill to host.
        Unbounded if ``None``.
    timeout
        Seconds to wait for a peer's row counts.

    Attributes
    ----------
    statistics
        ``seconds_partition``, ``seconds_counts``, ``seconds_exchange``,
        ``seconds_spill``, ``bytes_inserted``, ``bytes_received``,
        ``bytes_spilled``, ``rounds``.
    """

    def __init__(
        self,
        comm: Communicator,
        transport: NcclTransport,
        npartitions: int,
        on: Sequence[str],
        *,
        op_id: int = 0,
        resource: BufferResource | None = None,
        timeout: float = 300.0,
    ) -> None:
        if transport.nranks != comm.nranks or transport.rank != comm.rank:
            raise ShuffleError("the NCCL transport and the communicator have different ranks")
        if not 1 <= npartitions:
            raise ValueError(f"npartitions must be >= 1, got {npartitions}")
        self.comm = comm
        self.transport = transport
        self.npartitions = int(npartitions)
        self.on = list(on)
        self.op_id = op_id
        self.resource = resource or BufferResource()
        self.timeout = timeout
        self.owned = list(range(comm.rank, self.npartitions, comm.nranks))
        self.statistics: dict[str, float] = {
            "seconds_partition": 0.0, "seconds_counts": 0.0, "seconds_exchange": 0.0,
            "seconds_spill": 0.0, "bytes_inserted": 0, "bytes_received": 0,
            "bytes_spilled": 0, "rounds": 0,
        }
        self._adapter = DeviceAdapter()
        self._meta: DeviceTable | None = None
        self._rounds: list[_Round] = []
        self._extracted: set[int] = set()

    # -- insert ------------------------------------------------------------
    def insert(self, table: DeviceTable) -> None:
        """Run one round with this rank's ``table`` (collective: all ranks call it).

        Raises
        ------
        ShuffleError
            If ``table``'s columns differ from the first round's, a key column
            is missing, or a peer's counts do not arrive in time.
        """
        if self._meta is None:
            self._meta = table.empty_like()
        elif table.dtypes != self._meta.dtypes:
            raise ShuffleError(
                f"shuffle {self.op_id}: table with columns {table.dtypes} in round "
                f"{self.statistics['rounds']}, the first round had {self._meta.dtypes}"
            )
        missing = [k for k in self.on if k not in table.columns]
        if missing:
            raise ShuffleError(f"shuffle {self.op_id}: key column(s) {missing} not in {table.names}")
        rank, nranks, npart = self.comm.rank, self.comm.nranks, self.npartitions
        xp = table.xp
        rnd = int(self.statistics["rounds"])

        t0 = time.perf_counter()
        ids = self._adapter.partition_ids(table, self.on, npart)
        order, counts = partition_order(ids, npart, nranks)
        del ids
        sorted_cols = {k: xp.take(c, order) for k, c in table.columns.items()}
        del order
        t1 = time.perf_counter()

        tag = (TAG, self.op_id, rnd, "counts")
        payload = [counts.astype("<i8").tobytes()]
        for dest in range(nranks):
            if dest != rank:
                self.comm.send_nowait(dest, tag, payload)
        all_counts = np.zeros((nranks, npart), dtype=np.int64)
        all_counts[rank] = counts
        for src in range(nranks):
            if src != rank:
                try:
                    frames = self.comm.recv(src, tag, self.timeout)
                except Exception as e:
                    raise ShuffleError(
                        f"shuffle {self.op_id} round {rnd}: row counts from rank {src} failed: {e}"
                    ) from e
                all_counts[src] = np.frombuffer(bytes(frames[0]), dtype="<i8")
        t2 = time.perf_counter()

        # Send side: rows of partition p start after all partitions before it
        # in rank-major order.
        starts = np.zeros(npart, dtype=np.int64)
        pos = 0
        for p in rank_major_pids(npart, nranks):
            starts[p] = pos
            pos += int(counts[p])
        # Receive side: partition-major, source-minor.
        ranges: dict[int, tuple[int, int]] = {}
        recv_off = np.zeros((nranks, npart), dtype=np.int64)
        total = 0
        for p in self.owned:
            first = total
            for s in range(nranks):
                recv_off[s, p] = total
                total += int(all_counts[s, p])
            ranges[p] = (first, total - first)
        out = {k: xp.empty(total, dtype=c.dtype) for k, c in table.columns.items()}
        sends: dict[int, list[Any]] = {}
        recvs: dict[int, list[Any]] = {}
        for peer in range(nranks):
            sends[peer] = [
                sorted_cols[k][starts[p] : starts[p] + counts[p]]
                for k in table.columns
                for p in range(peer, npart, nranks)
                if counts[p]
            ]
            recvs[peer] = [
                out[k][recv_off[peer, p] : recv_off[peer, p] + all_counts[peer, p]]
                for k in table.columns
                for p in self.owned
                if all_counts[peer, p]
            ]
        nbytes = sum(int(c.nbytes) for c in out.values())
        reservation = self.resource.reserve(MemoryType.DEVICE, nbytes)
        try:
            self.transport.exchange(sends, recvs)
        except BaseException:
            reservation.release()
            raise
        del sends, sorted_cols
        t3 = time.perf_counter()
        self._rounds.append(_Round(out, ranges, reservation, on_device=xp is not np))
        self.statistics["rounds"] = rnd + 1
        self.statistics["bytes_inserted"] += table.nbytes
        self.statistics["bytes_received"] += nbytes
        self.statistics["seconds_partition"] += t1 - t0
        self.statistics["seconds_counts"] += t2 - t1
        self.statistics["seconds_exchange"] += t3 - t2
        self._spill_over_budget()

    def _spill_over_budget(self) -> None:
        available = self.resource.available(MemoryType.DEVICE)
        if available is None or available >= 0:
            return
        t0 = time.perf_counter()
        for rnd in self._rounds:
            if self.resource.available(MemoryType.DEVICE) >= 0:  # type: ignore[operator]
                break
            if not rnd.on_device:
                continue
            host = {k: c.get() for k, c in rnd.columns.items()}
            nbytes = rnd.nbytes
            rnd.reservation.release()
            rnd.columns = host
            rnd.reservation = self.resource.reserve(MemoryType.HOST, nbytes)
            rnd.on_device = False
            self.statistics["bytes_spilled"] += nbytes
        self.statistics["seconds_spill"] += time.perf_counter() - t0

    # -- extract -----------------------------------------------------------
    def extract(self, partition_id: int) -> DeviceTable:
        """Return output partition ``partition_id``, on the device.

        Rows come ordered by round, then source rank, then their order in the
        source table. Call after the last round; each partition once.

        Raises
        ------
        ShuffleError
            If the partition is not owned by this rank, was already extracted,
            or nothing was inserted.
        """
        if partition_id not in self.owned:
            raise ShuffleError(
                f"output partition {partition_id} of device shuffle {self.op_id} is not owned by "
                f"rank {self.comm.rank}"
            )
        if partition_id in self._extracted:
            raise ShuffleError(
                f"output partition {partition_id} of device shuffle {self.op_id} was already extracted"
            )
        if self._meta is None:
            raise ShuffleError(f"device shuffle {self.op_id}: extract before any insert")
        self._extracted.add(partition_id)
        pieces = []
        for rnd in self._rounds:
            first, n = rnd.ranges[partition_id]
            if n:
                pieces.append(DeviceTable({k: c[first : first + n] for k, c in rnd.columns.items()}))
        if not pieces:
            return self._meta.empty_like()
        result = concat_tables(pieces, self._meta)
        if len(self._extracted) == len(self.owned):
            self.close()
        return result

    # -- cleanup -----------------------------------------------------------
    @property
    def device_bytes(self) -> int:
        """Bytes of received rounds held on the device."""
        return sum(r.nbytes for r in self._rounds if r.on_device)

    def close(self) -> None:
        """Drop this rank's received buffers (extracted views stay valid). Idempotent."""
        for rnd in self._rounds:
            rnd.reservation.release()
        self._rounds = []
