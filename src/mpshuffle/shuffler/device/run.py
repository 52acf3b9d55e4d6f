"""One rank's share of a device run: device tables moved GPU to GPU over NCCL.

The device twin of the host :class:`~mpshuffle.shuffler.host.Shuffler`
(same phases, same lifecycle in the :class:`~mpshuffle.shuffler.context.WorkerContext`),
for :class:`~mpshuffle.table.device.DeviceTable` partitions with CuPy columns.

* **insert** (task thread): hash-partition the table on its GPU and pack its
  rows into one device buffer, ordered by owner rank, so that the pieces for
  each destination rank are one contiguous byte range. The buffer stays on
  this rank in the run's *outbox*, accounted as ``DEVICE`` memory; past the
  device budget (``spill_device``) the oldest outbox buffers are copied to
  host memory (and accounted as ``HOST``), and past the host budget
  (``spill_host``) the oldest host buffers are written to the run's spill
  file (accounted as ``DISK``): the one store's policy
  (:mod:`mpshuffle.memory.store`), as for the host runs.
* **barrier**: the barrier task sends ``inputs-done`` to every rank over the
  host communicator, naming per input partition the insert attempt whose
  result Dask kept (an abandoned insert execution's table is left out of the
  exchange). On receipt each rank starts one collective *exchange* on
  a thread of its own (never on the progress thread or a worker's event
  loop): the NCCL transport is created there on first use (once per
  generation; its unique id travels over the host communicator and its
  blocking join happens on this thread), the byte ranges and piece headers
  go to every peer over the host communicator, then the outbox buffers move
  in *rounds*, each round one grouped NCCL send/receive straight between the
  GPUs of the next few input buffers of every rank (as many as the most
  constrained rank's device budget leaves room for, sent along with the
  headers; one where a rank is over its budget). Received buffers are
  accounted as ``DEVICE`` and spilled to host (and on to disk) past the
  budgets after each round, so the device holds about the budget plus one
  round. An outbox buffer on disk is read back to host for its round, unless
  all its rows stay on this rank (always so on one rank): such a buffer is
  written to disk piece by piece as a received one is, and stays there. After
  the last round, where nothing was spilled and the budget leaves room, the
  rank *consolidates*: one batched-copy kernel gathers every owned output
  partition's rows into one packed piece (ordered by input partition, then
  source rank) and the received buffers are freed. Each rank acknowledges the
  barrier when its exchange ended (with the error, if any).
* **extract**: waits for the exchange and returns the partition's one
  consolidated piece; without consolidation, its pieces (on the device, in
  host memory, or byte ranges of the rank's spill file) gathered into one
  device piece (:mod:`mpshuffle.shuffler.device.gather`), or, where their
  dtypes differ, the pieces themselves ordered by input partition, which the
  device adapter concatenates on the GPU.

Exchanges of one generation run one at a time on each rank, in rank 0's
order (:meth:`~mpshuffle.shuffler.device.state.DeviceState.turn`). The
buffers and their spill files are described in
:mod:`mpshuffle.shuffler.device.buffers`.

Limitations: buffers on disk are read back to host memory, never straight to
the device (no GPUDirect Storage). A peer lost in the middle of an NCCL round
is not detected by NCCL itself; the barrier's and extract's timeouts end the
tasks.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from mpshuffle.errors import ShuffleError, ShuffleTimeoutError, SpillError
from mpshuffle.memory import BufferResource, MemoryType, SpillDirectory
from mpshuffle.memory.device import batched_copy
from mpshuffle.memory.store import DiskTier, over, spill_down
from mpshuffle.shuffler.device import buffers, exchange
from mpshuffle.shuffler.device.buffers import (
    STAGE_BYTES,
    DeviceBuffer,
    Held,
    HostBlocks,
    Incoming,
    Outgoing,
    Output,
    Piece,
)
from mpshuffle.shuffler.device.gather import Located, device_bytes, gather
from mpshuffle.shuffler.device.state import DEVICE_TAG, DeviceState
from mpshuffle.shuffler.run import Run
from mpshuffle.table import PackedData
from mpshuffle.table.device import (
    DeviceAdapter,
    DeviceTable,
    pack_sorted,
    partition_order,
    rank_major_pids,
)

if TYPE_CHECKING:
    from mpshuffle.comm import Communicator, Frames, Tag
    from mpshuffle.table import FrameAdapter

__all__ = ["DeviceRun"]

logger = logging.getLogger(__name__)

class DeviceRun(Run):
    """One rank's state of one device shuffle run (see the module docstring).

    The lifecycle (barrier acknowledgements, owned partitions, fail, close,
    statistics) is :class:`~mpshuffle.shuffler.run.Run`'s.

    Parameters
    ----------
    comm
        The generation's host communicator.
    op_id
        Id of the run, unique within the generation.
    resource
        The worker's budgets; its ``DEVICE`` limit is the device budget, its
        ``HOST`` limit the host budget past which buffers go to disk, under
        its ``spill_dir`` (in ``<spill_prefix>-op<op_id>-r<rank>``).
    state
        This rank's GPU and transport; ``None`` only for a single rank
        (no transport needed), e.g. NumPy device tables in tests.
    key
        Distinguishes the generation's NCCL transport (the generation id).
    timeout
        Seconds any wait of the run may take (the barrier, extract's wait
        for the exchange, peers' headers, the NCCL transport's unique id,
        this rank's turn).
    on_done
        Called once with ``op_id`` when the run's state is freed.
    blocks
        The worker's pooled host blocks for spilled buffers and transfers
        (:class:`~mpshuffle.shuffler.device.buffers.HostBlocks`); by default
        fresh memory every time.
    """

    label = "device shuffle op"
    ack_meaning = "finish the exchange"

    def __init__(
        self,
        comm: Communicator,
        op_id: int,
        *,
        resource: BufferResource,
        state: DeviceState | None,
        key: str,
        timeout: float,
        on_done: Callable[[int], None] | None = None,
        blocks: HostBlocks | None = None,
    ) -> None:
        super().__init__(comm, op_id, resource=resource, timeout=timeout, on_done=on_done)
        self.state = state
        self._blocks = blocks or HostBlocks()
        self.key = key
        self._outbox: list[Outgoing] = []
        self._incoming: list[Incoming] = []
        self._outputs: dict[int, Output] = {}
        self._thread: threading.Thread | None = None
        self._reply_to: list[int] = []
        self._exchanged = threading.Event()
        self._adapter = DeviceAdapter()
        # The store's disk tier: every buffer that goes to disk is appended to
        # the rank's one spill file and read back by range (as the host path's postbox).
        path = resource.spill_path(f"op{op_id}-r{comm.rank}")  # named as the host path's postbox
        self._disk = DiskTier(SpillDirectory(path, owner=resource.owner))
        # Held by a spill pass and by _free, so a pass never moves a freed buffer.
        self._spill_lock = threading.Lock()
        self._freed = False

    def scope(self) -> AbstractContextManager[Any]:
        """Make this rank's GPU current (a no-op without a GPU)."""
        return self.state.scope() if self.state is not None else contextlib.nullcontext()

    # -- insert (task thread) ------------------------------------------------
    def insert_frame(
        self, input_index: int, frame: Any, adapter: FrameAdapter, on: Sequence[Any],
        npartitions: int, ids: Any = None, attempt: str = "",
    ) -> None:
        """:meth:`insert` ``frame`` as the device table ``adapter`` views it as (a cudf frame without a copy)."""
        self.insert(input_index, adapter.device_table(frame), on, npartitions, ids, attempt=attempt)

    def insert(
        self, input_index: int, frame: DeviceTable, on: Sequence[Any], npartitions: int,
        ids: Any = None, attempt: str = "",
    ) -> None:
        """Partition and pack one input table into this rank's outbox (no transfer yet).

        Parameters
        ----------
        input_index
            Index of the input partition (orders rows in the output).
        frame
            The table, on this rank's GPU.
        on
            Key columns (hash partitioning) unless ``ids`` is given.
        npartitions
            Number of output partitions.
        ids
            Optional output partition id of every row (shape ``(n,)``).
        attempt
            Names this insert execution; the exchange leaves out the tables of
            attempts the barrier did not accept (see :meth:`barrier`).

        Raises
        ------
        ShuffleError
            If the run failed or its inputs are done, the table is on another
            GPU than this rank's, or a multi-rank run has no GPU.
        """
        self._raise_if_failed()
        if self._inputs_done:
            raise ShuffleError(f"insert after the barrier in device shuffle op {self.op_id}")
        nranks = self.comm.nranks
        if self.state is None and nranks > 1:
            raise ShuffleError(
                f"device shuffle op {self.op_id}: rank {self.comm.rank} sees no GPU (CuPy with a "
                "visible CUDA device is needed on every worker)"
            )
        if self.state is not None:
            self.state.check_table(frame, f"input partition {input_index}", self.comm.rank)
        t0 = time.perf_counter()
        with self.scope():
            if ids is None:
                ids = self._adapter.partition_ids(frame, list(on), npartitions)
            order, counts = partition_order(ids, npartitions, nranks)
            del ids
            pieces = pack_sorted(frame, order, counts, rank_major_pids(npartitions, nranks))
            del order
        buffer, ranges, meta = buffers.outbox_ranges(pieces, npartitions, nranks)
        if buffer is not None:
            buffer = DeviceBuffer(buffer, self.resource.reserve(MemoryType.DEVICE, int(buffer.nbytes)))
        with self._lock:
            self._outbox.append(Outgoing(input_index, buffer, ranges, meta, attempt))
            self.statistics["bytes_inserted"] += frame.nbytes
            self.statistics["seconds_insert"] += time.perf_counter() - t0
        self._spill_over_budget()

    def _spill_over_budget(self) -> None:
        """Move the oldest buffers down a tier while a tier is over its budget (the store's rule).

        Device buffers are copied to host while the ``DEVICE`` use is past its
        budget, each after room was made for it on the host; then host
        buffers are written to disk while the ``HOST`` use is past its budget
        (the worker's, shared with its host shuffles).

        Raises
        ------
        SpillError
            If writing to disk failed (e.g. the disk is full); the run is
            failed first, which frees its buffers and spill files.
        """
        if not (over(self.resource, MemoryType.DEVICE) or over(self.resource, MemoryType.HOST)):
            return
        try:
            with self._spill_lock:
                if not self._freed:
                    self._spill_locked()
        except SpillError as e:
            self.fail(e)
            raise

    def _spill_locked(self) -> None:
        with self._lock:
            # Oldest first: the outbox in insert order, then received buffers.
            entries = [
                self._held(o.buffer, buffers.own_pieces(o, self.comm.rank))
                for o in self._outbox if o.buffer is not None
            ]
            entries += [self._held(i.buffer, i.pieces) for i in self._incoming]
        spill_down(self.resource, entries, self._count, self.scope, host_cost=self._blocks.host_cost)

    def _held(self, buffer: DeviceBuffer, pieces: list[Piece] | None) -> Held:
        """``buffer`` as the store holds it: written piece by piece, or whole where ``pieces`` is ``None``."""
        if pieces is None:
            segments = [(0, int(buffer.data.nbytes))] if buffer.data is not None else []
        else:
            segments = [(off, off + nbytes) for _, off, nbytes, _ in pieces]
        return Held(buffer, segments, self.resource, self._disk, self._blocks)

    def _load(self, buffer: DeviceBuffer) -> None:
        """Read an outbox buffer that is on disk back into host memory, for its round.

        Raises
        ------
        ShuffleError
            If the run was freed meanwhile, or (a :class:`SpillError`) the
            file cannot be read; the run is failed then.
        """
        if buffer.disk is None:
            return
        t0 = time.perf_counter()
        try:
            with self._spill_lock:
                if self._freed:
                    self._raise_if_failed()
                    raise ShuffleError(f"device shuffle op {self.op_id} was closed during its exchange")
                nbytes = buffer.load(self.resource, self._disk, self._blocks)
        except SpillError as e:
            self.fail(e)
            raise
        with self._lock:
            self.statistics["bytes_unspilled_disk"] += nbytes
            self.statistics["seconds_unspill_disk"] += time.perf_counter() - t0

    # -- barrier -------------------------------------------------------------
    def barrier(self, npartitions: int, accepted: list[str] | None = None) -> None:
        """Start the exchange on every rank and wait until all finished it.

        Parameters
        ----------
        npartitions
            Number of output partitions.
        accepted
            Per input partition, the insert ``attempt`` whose result Dask
            kept; every rank leaves other attempts' tables out of its
            exchange. ``None`` keeps every table.

        Raises
        ------
        ShuffleError
            With a rank's exchange error, or naming the ranks that did not
            finish within :attr:`timeout` seconds.
        """
        # A run that already failed here starts no exchange anywhere: peers
        # would otherwise wait in NCCL for this rank.
        self._raise_if_failed()
        info = msgpack.packb({"npartitions": npartitions, "accepted": accepted})
        for dest in range(self.comm.nranks):
            self.comm.send_nowait(dest, (DEVICE_TAG, self.op_id, "inputs-done"), [info])
        self._wait_acks(self.timeout)

    # -- messages (progress thread) -----------------------------------------
    def receive(self, src: int, tag: Tag, frames: Frames) -> None:
        """Handle a control message of this run (on the progress thread; never blocks)."""
        kind = tag[2]
        if kind == "inputs-done":
            info = msgpack.unpackb(frames[0])
            with self._lock:
                self._reply_to.append(src)
                if self._thread is None and not self._closed:
                    self._mark_inputs_done(int(info["npartitions"]), info.get("accepted"))
                    self._thread = threading.Thread(
                        target=self._exchange_thread, daemon=True,
                        name=f"mpshuffle-device-exchange-op{self.op_id}",
                    )
                    self._thread.start()
                    return
                done = self._exchanged.is_set() or self._closed
            if done:
                self._ack(src)
        elif kind == "ack":
            self._record_ack(src, bytes(frames[0]).decode() if frames else "")
        elif kind == "turn" and self.state is not None:
            with self._lock:  # _free drops the turn after setting _freed, under this lock
                if not self._freed:
                    self.state.add_turn(self.op_id)

    def _ack(self, dest: int) -> None:
        err = "" if self._error is None else str(self._error) or type(self._error).__name__
        self.comm.send_nowait(dest, (DEVICE_TAG, self.op_id, "ack"), [err.encode()])

    # -- the exchange (its own thread) --------------------------------------
    def _exchange_thread(self) -> None:
        try:
            if self.state is None:
                self._exchange(None)
            else:
                with self.state.turn(self.comm, self.op_id, self.timeout, self._raise_if_failed), self.state.scope():
                    self._exchange(self.state)
        except BaseException as e:  # noqa: BLE001 -- reported to the barrier and to extract
            logger.error("mpshuffle: device exchange of op %d failed: %s", self.op_id, e)
            self.fail(e)
        finally:
            with self._lock:
                self._exchanged.set()
                reply_to = list(self._reply_to)
            for dest in reply_to:
                self._ack(dest)

    def _exchange(self, state: DeviceState | None) -> None:
        comm, rank, nranks = self.comm, self.comm.rank, self.comm.nranks
        t0 = time.perf_counter()
        with self._lock:
            outbox = sorted(self._outbox, key=lambda o: o.input_index)
            accepted = self._accepted
        outbox = exchange.keep_accepted(outbox, accepted)
        per_round = exchange.slots_per_round(self.resource, outbox)
        headers, per_round = exchange.swap_headers(comm, self.op_id, outbox, per_round, self.timeout)
        transport = state.transport(comm, self.key, self.timeout) if state and nranks > 1 else None
        t1 = time.perf_counter()
        self.statistics["seconds_headers"] += t1 - t0
        nslots = max([len(outbox)] + [len(h) for h in headers.values()])
        for first in range(0, nslots, per_round):
            self._raise_if_failed()
            tr = time.perf_counter()
            sends: dict[int, list[Any]] = {}
            recvs: dict[int, list[Any]] = {}
            got: list[Incoming] = []
            outs = [o for o in outbox[first : first + per_round] if o.buffer is not None]
            kept: set[int] = set()
            # In slot order on both sides: NCCL matches a peer's sends and receives by order.
            for k in range(first, min(first + per_round, nslots)):
                out = outbox[k] if k < len(outbox) else None
                if out is not None and out.buffer is not None:
                    if buffers.own_pieces(out, rank) is None:
                        # Rows for peers: a buffer on disk comes back for its round. One
                        # whose rows all stay here went to disk as received pieces do.
                        self._load(out.buffer)
                    data = out.buffer.data
                    for dest, (start, end, pieces) in out.ranges.items():
                        if dest == rank:
                            # This rank's range stays where it is: the outbox buffer
                            # (and its accounting) becomes a received buffer, its
                            # pieces' offsets made relative to the whole buffer.
                            kept.add(id(out))
                            own = [(pid, off + start, nbytes, rows) for pid, off, nbytes, rows in pieces]
                            got.append(Incoming(out.input_index, rank, out.buffer, own, out.meta))
                        else:
                            part = data[start:end]
                            sends.setdefault(dest, []).append(part if out.buffer.on_device else buffers.to_device(part))
                            self.statistics["bytes_sent"] += end - start
                for src, header in headers.items():
                    if k < len(header) and header[k][2] > header[k][1]:
                        input_index, start, end, pieces, meta = header[k]
                        buf = buffers.empty_device(end - start)
                        recvs.setdefault(src, []).append(buf)
                        res = self.resource.reserve(MemoryType.DEVICE, end - start)
                        got.append(Incoming(input_index, src, DeviceBuffer(buf, res), [tuple(p) for p in pieces], meta))
            if sends or recvs:
                assert transport is not None
                transport.exchange(sends, recvs)
            del sends, recvs
            for out in outs:
                if out.buffer is not None and id(out) not in kept:
                    out.buffer.release()
                out.buffer = None
            with self._lock:
                if self._freed:  # the run failed meanwhile; nothing else would release these
                    for g in got:
                        g.buffer.release()
                self._incoming.extend(got if not self._freed else [])
                self.statistics["bytes_received"] += sum(p[2] for g in got for p in g.pieces)
                self.statistics["rounds"] += 1
                self.statistics["seconds_exchange"] += time.perf_counter() - tr
            self._spill_over_budget()
        self._consolidate()
        with self._lock:
            self._outbox = []
            nothing_owned = not self._owned
        if nothing_owned:
            self.close()

    def _consolidate(self) -> None:
        """Gather each owned partition's pieces into one packed piece, in one kernel.

        After the exchange a partition's rows lie in one piece per input
        partition and source rank; an extract would rebuild and concatenate
        them all (on the GPU, a few kernels and many Python objects per
        piece, about 6 ms per output partition of 64 pieces on an H200).
        Here every received buffer's column blocks are copied into one
        buffer per owned partition, ordered by (input partition, source
        rank), with one :func:`~mpshuffle.memory.device.batched_copy`, and the
        received buffers are freed.

        Skipped (extract then takes the pieces as they are) where a received
        buffer was spilled to host or disk, where the inputs' column dtypes
        differ (extract casts them), or where the partitions' bytes do not
        fit in what is left of the device budget or on the device (the
        allocation raised ``MemoryError``): for a moment the device holds
        both forms.
        """
        t0 = time.perf_counter()
        with self._lock:
            incoming = sorted(self._incoming, key=lambda i: (i.input_index, i.src))
            if self._freed or not incoming:
                return
        meta = incoming[0].meta
        if any(not i.buffer.on_device or i.buffer.disk is not None or i.meta != meta for i in incoming):
            return
        plan = exchange.plan_consolidation(incoming, meta)
        sizes = plan.sizes
        available = self.resource.available(MemoryType.DEVICE)
        if available is not None and available < int(sizes.sum()):
            return
        xp = np if isinstance(incoming[0].buffer.data, np.ndarray) else buffers.cupy_module()
        try:
            outputs = buffers.allocate(xp, sizes.tolist())
        except MemoryError:  # the budget had room, the device not (Dask's data shares it)
            logger.info("mpshuffle: op %d: no device memory to consolidate; extracts take the pieces", self.op_id)
            return
        with self.scope():
            batched_copy([i.buffer.data for i in incoming], outputs, plan.segments)
            if xp is not np:
                xp.cuda.get_current_stream().synchronize()
        with self._lock:
            if self._freed:
                return
            for pid, n, out, size in zip(plan.pids.tolist(), plan.totals.tolist(), outputs, sizes.tolist(), strict=True):
                res = self.resource.reserve(MemoryType.DEVICE, size)
                self._outputs[pid] = Output(DeviceBuffer(out, res), n, meta)
            for inc in self._incoming:
                inc.buffer.release()
            self._incoming = []
            self.statistics["bytes_consolidated"] += int(sizes.sum())
            self.statistics["seconds_consolidate"] += time.perf_counter() - t0

    # -- extract (task thread) ----------------------------------------------
    def extract(self, partition_id: int) -> list[PackedData]:
        """Pieces of output partition ``partition_id``, ordered by input partition.

        Waits for this rank's exchange first. A consolidated partition is one
        piece, whose buffer (and its ``DEVICE`` accounting) passes to the
        caller. Otherwise pieces are views into the received buffers (device,
        or host where spilled), or slices of the partition's spill file, read
        into host memory once by this call (and deleted). After the rank's
        last owned partition the run's state is freed.

        Raises
        ------
        PartitionGoneError
            If the partition was already extracted.
        ShuffleError
            If the run failed, the exchange did not end within :attr:`timeout`
            seconds, or the partition is not owned here; a
            :class:`SpillError` if its spill file cannot be read (the run is
            failed then).
        """
        t0 = time.perf_counter()
        if not self._exchanged.wait(self.timeout):
            raise ShuffleTimeoutError(
                f"device shuffle op {self.op_id} on rank {self.comm.rank}: the exchange did not "
                f"finish within {self.timeout:g} s"
            )
        self._raise_if_failed()
        t1 = time.perf_counter()
        with self._lock:
            self._take(partition_id)
            output = self._outputs.pop(partition_id, None)
            hits = [
                (inc, i) for inc in self._incoming
                for i, piece in enumerate(inc.pieces) if piece[0] == partition_id
            ]
        try:
            if output is not None:  # consolidated: one piece, handed over to the caller
                output.buffer.release()
                found = [((0, 0), PackedData(output.meta, output.buffer.data, output.nrows))]
            else:
                hits.sort(key=lambda h: (h[0].input_index, h[0].src))
                gathered = self._gather(partition_id, hits)
                if gathered is not None:
                    found = [((0, 0), gathered)]
                else:
                    found = self._pieces_of(partition_id, hits)
                    found.sort(key=lambda x: x[0])
        finally:
            # Whichever extract ends last frees the run (see ShuffleRun._done_taking).
            last = self._done_taking()
        with self._lock:
            self.statistics["seconds_wait"] += t1 - t0
            self.statistics["seconds_extract"] += time.perf_counter() - t1
        if last:
            self.close()
        return [p for _, p in found]

    def _gather(self, partition_id: int, hits: list[tuple[Incoming, int]]) -> PackedData | None:
        """The partition's pieces gathered into one packed piece on the device, or ``None`` (pieces as they are).

        See :mod:`mpshuffle.shuffler.device.gather`. Its device memory (the
        staged buffer and the piece) is reserved as ``DEVICE`` while it runs,
        so every spill decision meanwhile (a concurrent insert's) counts it;
        the piece is handed over with the extract, as a consolidated one is.
        It moves nothing down to make room for itself: the run's buffers are
        freed only when it ends, so room made here would be taken from the
        partitions extracted next (over the first few extracts every device
        buffer would move down, and with a disk tier push host buffers to
        disk). So the device holds at most its budget plus one gather per
        extract running. ``None`` where the pieces' metadata differ (the
        adapter casts them) or the device had no room (``MemoryError``).

        Raises
        ------
        ShuffleError
            If the run was freed meanwhile, or (a :class:`SpillError`) the
            spill file cannot be read; the run is failed then.
        """
        if not hits or any(inc.meta != hits[0][0].meta for inc, _ in hits):
            return None
        meta = hits[0][0].meta
        t0 = time.perf_counter()
        with self._spill_lock:
            if self._freed:
                self._raise_if_failed()
                raise ShuffleError(f"device shuffle op {self.op_id} was closed during an extract")
            located, disk_res = self._locate(hits)
        staged_bytes, out_bytes = device_bytes(located, meta)
        gpu = self.state is not None or any(
            p.device is not None and not isinstance(p.device, np.ndarray) for p in located
        )
        xp = buffers.cupy_module() if gpu else np
        staged_res = self.resource.reserve(MemoryType.DEVICE, staged_bytes)
        out_res = self.resource.reserve(MemoryType.DEVICE, out_bytes)
        seconds = self._disk.seconds_read
        try:
            with self.scope():
                data, nrows = gather(
                    located, meta, xp=xp, stage_bytes=STAGE_BYTES,
                    read=lambda ranges: self._disk.read(ranges, self._blocks.stage_array),
                )
        except MemoryError:
            logger.info("mpshuffle: op %d: no device memory to gather partition %d; extract takes the pieces",
                        self.op_id, partition_id)
            return None
        except SpillError as e:
            self.fail(e)
            raise
        finally:
            staged_res.release()
            out_res.release()
        unspilled = 0
        for res in disk_res:
            unspilled += res.nbytes
            res.release()
        with self._lock:
            self.statistics["bytes_unspilled_disk"] += unspilled
            self.statistics["seconds_unspill_disk"] += self._disk.seconds_read - seconds
            self.statistics["bytes_gathered"] += int(data.nbytes)
            self.statistics["seconds_gather"] += time.perf_counter() - t0
        return PackedData(meta, data, nrows)

    @staticmethod
    def _locate(hits: list[tuple[Incoming, int]]) -> tuple[list[Located], list[Any]]:
        """Where each piece of ``hits`` lies now (under the spill lock), and the ``DISK`` reservations of those on disk."""
        located: list[Located] = []
        disk_res: list[Any] = []
        for inc, i in hits:
            _, off, nbytes, nrows = inc.pieces[i]
            b = inc.buffer
            if b.disk is not None:
                foff, _, res = b.disk[i]
                located.append(Located(nbytes, nrows, file_offset=foff))
                disk_res.append(res)
            elif b.on_device:
                located.append(Located(nbytes, nrows, device=b.data, offset=off))
            else:
                located.append(Located(nbytes, nrows, host=b.data, offset=off))
        return located, disk_res

    def _pieces_of(
        self, partition_id: int, hits: list[tuple[Incoming, int]]
    ) -> list[tuple[tuple[int, int], PackedData]]:
        """The pieces ``(input partition, source rank), PackedData`` of ``hits`` (received, piece index).

        Pieces on disk are read back by range from the rank's one spill file
        (one read of them all, into one host buffer), and their ``DISK``
        reservations are released.
        """
        found: list[tuple[tuple[int, int], PackedData]] = []
        on_disk: list[tuple[int, int, int, Any]] = []  # (index in found, offset, bytes, reservation)
        for inc, i in hits:
            _, off, nbytes, nrows = inc.pieces[i]
            disk = inc.buffer.disk
            view = None
            if disk is None:
                view = inc.buffer.data[off : off + nbytes]
            else:
                foff, fbytes, res = disk[i]
                on_disk.append((len(found), foff, fbytes, res))
            found.append(((inc.input_index, inc.src), PackedData(inc.meta, view, nrows)))
        if on_disk:
            seconds = self._disk.seconds_read
            try:
                views = self._disk.get([(foff, fbytes) for _, foff, fbytes, _ in on_disk])
            except SpillError as e:
                self.fail(e)
                raise
            unspilled = 0
            for (k, _, fbytes, res), view in zip(on_disk, views, strict=True):
                key, piece = found[k]
                found[k] = (key, PackedData(piece.metadata, np.frombuffer(view, dtype=np.uint8), piece.nrows))
                res.release()
                unspilled += fbytes
            with self._lock:
                self.statistics["bytes_unspilled_disk"] += unspilled
                self.statistics["seconds_unspill_disk"] += self._disk.seconds_read - seconds
        return found

    # -- failure and cleanup -------------------------------------------------
    def _wake(self) -> None:
        self._exchanged.set()

    def _free(self) -> None:
        # The spill lock waits for a spill pass in flight, so none moves a freed buffer.
        with self._spill_lock, self._lock:
            self._freed = True
            buffers = [o.buffer for o in self._outbox if o.buffer is not None]
            buffers += [i.buffer for i in self._incoming]
            buffers += [o.buffer for o in self._outputs.values()]
            self._outbox, self._incoming, self._outputs = [], [], {}
        for b in buffers:
            b.release()
        if self.state is not None:  # a turn of a run gone here must not hold up the next
            self.state.drop_turn(self.op_id)
        self._disk.remove()

    def _after_close(self) -> None:
        with self._lock:
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            # It may still be sending its acks; a closed run leaves no thread behind.
            thread.join(timeout=10)
