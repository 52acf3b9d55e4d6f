"""The device run path of a Dask shuffle: device tables moved GPU to GPU over NCCL.

A shuffle graph whose meta is a :class:`~mpshuffle.table.device.DeviceTable`
with CuPy columns runs here instead of in the host
:class:`~mpshuffle.shuffler.Shuffler`; the graph (insert -> barrier ->
extract) and the run's lifecycle in the :class:`~mpshuffle.shuffler.context.WorkerContext`
are the same.

* **insert** (task thread): hash-partition the table on its GPU and pack its
  rows into one device buffer, ordered by owner rank, so that the pieces for
  each destination rank are one contiguous byte range. The buffer stays on
  this rank in the run's *outbox*, accounted as ``DEVICE`` memory; past the
  device budget (``spill_device``) the oldest outbox buffers are copied to
  host memory (and accounted as ``HOST``), and past the host budget
  (``spill_host``) the oldest host buffers are written to the run's spill
  directory (accounted as ``DISK``).
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
  round. An outbox buffer on disk is read back to host for its round. After
  the last round, where nothing was spilled and the budget leaves room, the
  rank *consolidates*: one batched-copy kernel gathers every owned output
  partition's rows into one packed piece (ordered by input partition, then
  source rank) and the received buffers are freed. Each rank acknowledges the
  barrier when its exchange ended (with the error, if any).
* **extract**: waits for the exchange and returns the partition's one
  consolidated piece; without consolidation, its pieces (views into the
  received buffers, on the device or spilled to host, or slices of the
  partition's spill file, read back to host once per extract and deleted
  then), ordered by input partition, which the device adapter concatenates
  on the GPU.

Spill files: one directory per run and rank,
``<spill_dir>/<spill_prefix>-op<op_id>-r<rank>``, made on the first write and
removed with everything in it when the run closes or fails. A received
buffer is written piece by piece into one file per output partition (as the
host path's postbox does), so an extract reads one file; an outbox buffer is
written whole into ``outbox/``, to be read back for its exchange round.

Rounds keep NCCL's rule that both sides post their transfers in the same
order without further messages: every rank knows, from the headers, which
peer sends what in which input slot, and all ranks take the same slots per
round (the smallest any rank announced).

Exchanges of one generation run one at a time on each rank, in the order rank
0 runs them (:meth:`DeviceState.turn`): two device shuffles whose barriers run
concurrently (both sides of a join, say) reach the ranks in different orders,
and ranks that ran them as they came would wait on each other.

Limitations: buffers on disk are read back to host memory, never straight to
the device (no GPUDirect Storage). A peer lost in the middle of an NCCL round
is not detected by NCCL itself; the barrier's and extract's timeouts end the
tasks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from mpshuffle.errors import PartitionGoneError, ShuffleError, ShuffleTimeoutError, SpillError
from mpshuffle.memory import BufferResource, MemoryType, Reservation, SpillDirectory
from mpshuffle.memory.device import batched_copy
from mpshuffle.table import PackedData
from mpshuffle.table.cudf import is_cudf_frame
from mpshuffle.table.device import (
    DeviceAdapter,
    DeviceTable,
    column_blocks,
    pack_sorted,
    partition_order,
    piece_dtypes,
    rank_major_pids,
)

if TYPE_CHECKING:
    from mpshuffle.comm import Communicator, Frames, Tag
    from mpshuffle.comm.nccl import NcclTransport
    from mpshuffle.options import Options

__all__ = ["DEVICE_TAG", "DeviceRun", "DeviceState", "is_device_meta", "setup_device"]

logger = logging.getLogger(__name__)

# Control messages handled on the progress thread: ("mpsd", op_id, kind).
DEVICE_TAG = "mpsd"
# Headers of an exchange, taken with Communicator.recv: ("mpsd-x", op_id, "headers").
_XTAG = "mpsd-x"


def is_device_meta(meta: object) -> bool:
    """Whether a shuffle of frames like ``meta`` takes the device run path.

    True for a :class:`DeviceTable` whose columns are not NumPy arrays (CuPy)
    and for a ``cudf.DataFrame`` (its columns are taken as CuPy arrays, see
    :class:`~mpshuffle.table.cudf.CudfAdapter`); NumPy-backed device tables
    (the host twin) use the host path. Never imports cudf or CuPy.
    """
    if isinstance(meta, DeviceTable):
        return meta.xp is not np
    return is_cudf_frame(meta)


class DeviceState:
    """The GPU of one rank and its NCCL transport (created on first use).

    Attributes
    ----------
    device
        CUDA device id this rank uses.
    budget
        Device bytes the shuffle buffers may hold before spilling (``spill_device``).
    pool_bytes
        Bytes CuPy's memory pool holds after the ``pool_size`` reservation (0 without one).
    """

    def __init__(self, device: int, budget: int, pool_bytes: int) -> None:
        self.device = device
        self.budget = budget
        self.pool_bytes = pool_bytes
        self._transport: NcclTransport | None = None
        # One exchange at a time per rank: NCCL operations of two exchanges
        # on one communicator must not interleave.
        self.exchange_lock = threading.Lock()
        # Exchanges rank 0 started, in its order, that this rank has still to run.
        self._turns: list[int] = []
        self._turns_changed = threading.Condition()

    def add_turn(self, op_id: int) -> None:
        """Record that rank 0 started the exchange of ``op_id`` (progress thread; never blocks)."""
        with self._turns_changed:
            self._turns.append(op_id)
            self._turns_changed.notify_all()

    def drop_turn(self, op_id: int) -> None:
        """Forget ``op_id``'s turn (its exchange ended, or its run closed or failed here)."""
        with self._turns_changed:
            if op_id in self._turns:
                self._turns.remove(op_id)
                self._turns_changed.notify_all()

    @contextlib.contextmanager
    def turn(self, comm: Communicator, op_id: int, timeout: float, check: Callable[[], None]) -> Iterator[None]:
        """Hold this rank's exchange slot for ``op_id``, in the order rank 0 runs exchanges.

        Ranks may learn of two runs' barriers in different orders; were each
        to run its exchanges as they come, rank 0 could wait in run A for a
        peer busy in run B and both would stall. So rank 0 runs exchanges in
        its own order and, on taking the slot, sends ``turn`` to every other
        rank; the others run exchanges strictly in the order of those
        messages.

        Parameters
        ----------
        comm
            The generation's host communicator.
        op_id
            The run whose exchange is about to start.
        timeout
            Seconds a rank other than 0 waits with no exchange ahead of it
            ending before it gives up.
        check
            Called while waiting; raises if the run failed meanwhile.

        Raises
        ------
        ShuffleTimeoutError
            If rank 0 did not start ``op_id``'s exchange in time, naming the
            exchanges queued ahead of it.
        """
        if comm.nranks == 1:
            with self.exchange_lock:
                yield
            return
        if comm.rank == 0:
            with self.exchange_lock:
                for dest in range(1, comm.nranks):
                    comm.send_nowait(dest, (DEVICE_TAG, op_id, "turn"), [])
                yield
            return
        try:
            with self._turns_changed:
                deadline, ahead = time.monotonic() + timeout, list(self._turns)
                while not self._turns or self._turns[0] != op_id:
                    check()
                    if self._turns != ahead:  # an exchange ahead ended or a turn came: progress
                        deadline, ahead = time.monotonic() + timeout, list(self._turns)
                    if time.monotonic() > deadline:
                        raise ShuffleTimeoutError(
                            f"device shuffle op {op_id} on rank {comm.rank}: rank 0 did not start its "
                            f"exchange within {timeout:g} s (exchanges queued here: {self._turns})"
                        )
                    self._turns_changed.wait(0.1)
            with self.exchange_lock:
                yield
        finally:
            self.drop_turn(op_id)

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Make this rank's GPU current in the calling thread (CUDA's current device is per thread)."""
        import cupy

        with cupy.cuda.Device(self.device):
            yield

    def transport(self, comm: Communicator, key: str, timeout: float) -> NcclTransport:
        """The NCCL transport over ``comm``'s ranks; the first call is collective.

        Called under :attr:`exchange_lock` from an exchange thread, which is
        where NCCL's blocking join happens.
        """
        if self._transport is None:
            from mpshuffle.comm.nccl import NcclTransport

            self._transport = NcclTransport.create(comm, key=key, device=self.device, timeout=timeout)
        return self._transport

    def close(self) -> None:
        """Destroy the NCCL communicator, if one was created. Idempotent."""
        t, self._transport = self._transport, None
        if t is not None:
            t.close()


def setup_device(options: Options, rank: int) -> DeviceState | None:
    """Pick this rank's GPU, reserve the pool and size the device budget.

    Where ``CUDA_VISIBLE_DEVICES`` is set, the device is the first one it
    lists (dask-cuda's LocalCUDACluster gives worker ``i`` the list rotated to
    start at GPU ``i``; a worker pinned to one GPU sees only that one);
    otherwise ``rank % ndevices`` among the visible ones. Registers the device
    frame adapter.

    Parameters
    ----------
    options
        ``pool_size`` (fraction of the device CuPy's pool takes now, or
        ``None``) and ``spill_device`` (fraction of the device at which the
        shuffle's device buffers spill to host).
    rank
        This worker's rank.

    Returns
    -------
    DeviceState or None
        ``None`` where CuPy does not import or no GPU is visible.

    Raises
    ------
    MemoryError
        If the pool reservation does not fit on the device.
    """
    try:
        import cupy

        ndev = int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001 - no CuPy, no driver or no device: no device path
        return None
    if ndev < 1:
        return None
    from mpshuffle.memory.device import device_budget, reserve_device_pool
    from mpshuffle.table.gpu import register_device_adapter

    register_device_adapter()
    # A worker given its GPUs in CUDA_VISIBLE_DEVICES uses the first one listed
    # (dask-cuda lists the worker's own GPU first, then the others); a worker
    # that sees every GPU of the machine takes one by rank.
    device = 0 if os.environ.get("CUDA_VISIBLE_DEVICES", "").strip() else rank % ndev
    with cupy.cuda.Device(device):
        pool = reserve_device_pool(options.pool_size) if options.pool_size else 0
        budget = device_budget(options.spill_device)
    logger.info(
        "mpshuffle: rank %d uses GPU %d (CUDA_VISIBLE_DEVICES=%s), pool %d bytes, device budget %d bytes",
        rank, device, os.environ.get("CUDA_VISIBLE_DEVICES"), pool, budget,
    )
    return DeviceState(device, budget, pool)


@dataclasses.dataclass
class _Buffer:
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


# Slots per round a rank without a device budget announces (all ranks take the smallest).
_UNBOUNDED_SLOTS = 2**31

# (pid, offset in the range, data bytes, rows)
_Piece = tuple[int, int, int, int]


@dataclasses.dataclass
class _Outgoing:
    """One inserted table, packed: per destination rank a byte range and its pieces."""

    input_index: int
    buffer: _Buffer | None
    ranges: dict[int, tuple[int, int, list[_Piece]]]
    meta: bytes  # the pieces' metadata (one for all of them, see piece_metadata)
    attempt: str = ""  # the insert execution that made it (see barrier's ``accepted``)


@dataclasses.dataclass
class _Incoming:
    """The bytes one source rank sent of one input partition."""

    input_index: int
    src: int
    buffer: _Buffer
    pieces: list[_Piece]
    meta: bytes


@dataclasses.dataclass
class _Output:
    """One output partition, consolidated: its rows from every input in one packed piece."""

    buffer: _Buffer
    nrows: int
    meta: bytes


class DeviceRun:
    """One rank's state of one device shuffle run (see the module docstring).

    Has the interface the worker context expects of a run (``insert``,
    ``barrier``, ``extract``, ``receive``, ``fail``, ``close``,
    ``statistics``, ``inputs_done``, ``closed``).

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
        Seconds to wait for peers' headers and for the NCCL transport's unique id.
    on_done
        Called once with ``op_id`` when the run's state is freed.

    Attributes
    ----------
    statistics
        ``bytes_inserted``, ``bytes_sent`` (to other ranks), ``bytes_received``
        (from other ranks and itself), ``bytes_spilled`` (device to host),
        ``bytes_spilled_disk`` (host to disk), ``bytes_unspilled_disk`` (read
        back from disk), ``bytes_consolidated`` (output partitions gathered
        into one piece each), ``rounds``, ``seconds_insert``,
        ``seconds_headers``, ``seconds_exchange`` (NCCL rounds),
        ``seconds_consolidate``, ``seconds_spill`` (device to
        host), ``seconds_spill_disk``, ``seconds_unspill_disk``,
        ``seconds_wait``, ``seconds_extract``; bytes are buffer sizes,
        seconds wall time summed over calls.
    """

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
    ) -> None:
        self.comm = comm
        self.op_id = op_id
        self.resource = resource
        self.state = state
        self.key = key
        self.timeout = timeout
        self._on_done = on_done
        self.npartitions: int | None = None
        self.statistics: dict[str, float] = {
            "bytes_inserted": 0, "bytes_sent": 0, "bytes_received": 0, "bytes_spilled": 0,
            "rounds": 0, "seconds_insert": 0.0, "seconds_headers": 0.0,
            "seconds_exchange": 0.0, "seconds_spill": 0.0, "seconds_wait": 0.0,
            "seconds_extract": 0.0, "bytes_spilled_disk": 0, "bytes_unspilled_disk": 0,
            "seconds_spill_disk": 0.0, "seconds_unspill_disk": 0.0,
            "bytes_consolidated": 0, "seconds_consolidate": 0.0,
        }
        self._lock = threading.Lock()
        self._outbox: list[_Outgoing] = []
        self._incoming: list[_Incoming] = []
        self._outputs: dict[int, _Output] = {}
        self._owned: set[int] = set()
        self._extracted: set[int] = set()
        self._inputs_done = False
        self._accepted: list[str] | None = None
        self._thread: threading.Thread | None = None
        self._reply_to: list[int] = []
        self._exchanged = threading.Event()
        self._acks: dict[int, str] = {}
        self._acks_event = threading.Event()
        self._error: BaseException | None = None
        self._closed = False
        self._adapter = DeviceAdapter()
        # Received pieces go to disk into one file per output partition (an
        # extract reads one file); outbox buffers whole, one file each, below it.
        path = resource.spill_path(f"op{op_id}-r{comm.rank}")  # named as the host path's postbox
        self._spill_in = SpillDirectory(path, owner=resource.owner)
        self._spill_out = SpillDirectory(os.path.join(path, "outbox"), owner=resource.owner)
        self._outbox_keys = itertools.count()
        # Held by a spill pass and by _free, so a pass never moves a freed buffer.
        self._spill_lock = threading.Lock()
        self._freed = False

    def _scope(self) -> Any:
        return self.state.scope() if self.state is not None else contextlib.nullcontext()

    # -- insert (task thread) ------------------------------------------------
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
        self._check_device(frame, input_index)
        t0 = time.perf_counter()
        with self._scope():
            if ids is None:
                ids = self._adapter.partition_ids(frame, list(on), npartitions)
            order, counts = partition_order(ids, npartitions, nranks)
            del ids
            pieces = pack_sorted(frame, order, counts, rank_major_pids(npartitions, nranks))
            del order
        ranges: dict[int, tuple[int, int, list[_Piece]]] = {}
        buffer = None
        meta = b""
        if pieces:
            meta = bytes(next(iter(pieces.values())).metadata)
            base = next(iter(pieces.values())).data.base
            if base is None:
                base = next(iter(pieces.values())).data
            base_ptr = _ptr(base)
            for dest in range(nranks):
                mine = [(p, pieces[p]) for p in range(dest, npartitions, nranks) if p in pieces]
                if not mine:
                    continue
                start = _ptr(mine[0][1].data) - base_ptr
                end = _ptr(mine[-1][1].data) - base_ptr + int(mine[-1][1].data.nbytes)
                ranges[dest] = (start, end, [
                    (p, _ptr(pk.data) - base_ptr - start, int(pk.data.nbytes), pk.nrows) for p, pk in mine
                ])
            buffer = _Buffer(base, self.resource.reserve(MemoryType.DEVICE, int(base.nbytes)))
        with self._lock:
            self._outbox.append(_Outgoing(input_index, buffer, ranges, meta, attempt))
            self.statistics["bytes_inserted"] += frame.nbytes
            self.statistics["seconds_insert"] += time.perf_counter() - t0
        self._spill_over_budget()

    def _check_device(self, frame: DeviceTable, input_index: int) -> None:
        if self.state is None or frame.xp is np:
            return
        for name, col in frame.columns.items():
            dev = getattr(getattr(col, "device", None), "id", self.state.device)
            if int(dev) != self.state.device:
                raise ShuffleError(
                    f"input partition {input_index}: column {name!r} is on GPU {dev}, but rank "
                    f"{self.comm.rank} uses GPU {self.state.device}; run one worker per GPU "
                    "(CUDA_VISIBLE_DEVICES per worker, as dask-cuda's LocalCUDACluster does) or "
                    "build each partition on its worker's GPU"
                )

    def _over(self, memory_type: MemoryType) -> bool:
        available = self.resource.available(memory_type)
        return available is not None and available < 0

    def _spill_over_budget(self) -> None:
        """Move the oldest buffers down a tier while a tier is over its budget.

        Device buffers are copied to host while the ``DEVICE`` use is past its
        budget; then host buffers are written to disk while the ``HOST`` use
        is past its budget (the worker's, shared with its host shuffles).

        Raises
        ------
        SpillError
            If writing to disk failed (e.g. the disk is full); the run is
            failed first, which frees its buffers and spill files.
        """
        if not (self._over(MemoryType.DEVICE) or self._over(MemoryType.HOST)):
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
            entries: list[tuple[_Buffer, list[_Piece] | None]] = [
                (o.buffer, None) for o in self._outbox if o.buffer is not None
            ]
            entries += [(i.buffer, i.pieces) for i in self._incoming]
        if self._over(MemoryType.DEVICE):
            t0 = time.perf_counter()
            moved = 0
            with self._scope():
                for b, _ in entries:
                    if not self._over(MemoryType.DEVICE):
                        break
                    moved += b.spill(self.resource)
            with self._lock:
                self.statistics["bytes_spilled"] += moved
                self.statistics["seconds_spill"] += time.perf_counter() - t0
        if not self._over(MemoryType.HOST):
            return
        t0 = time.perf_counter()
        written = 0
        try:
            for b, pieces in entries:
                if not self._over(MemoryType.HOST):
                    break
                if b.on_device or b.disk is not None:
                    continue
                if pieces is None:
                    written += b.spill_to_disk(
                        self.resource, self._spill_out, [(next(self._outbox_keys), 0, int(b.data.nbytes))]
                    )
                else:
                    segments = [(pid, off, off + nbytes) for pid, off, nbytes, _ in pieces]
                    written += b.spill_to_disk(self.resource, self._spill_in, segments)
        finally:
            with self._lock:
                self.statistics["bytes_spilled_disk"] += written
                self.statistics["seconds_spill_disk"] += time.perf_counter() - t0

    def _load(self, buffer: _Buffer) -> None:
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
                nbytes = buffer.load(self.resource, self._spill_out)
        except SpillError as e:
            self.fail(e)
            raise
        with self._lock:
            self.statistics["bytes_unspilled_disk"] += nbytes
            self.statistics["seconds_unspill_disk"] += time.perf_counter() - t0

    # -- barrier -------------------------------------------------------------
    def barrier(self, npartitions: int, timeout: float, accepted: list[str] | None = None) -> None:
        """Start the exchange on every rank and wait until all finished it.

        Parameters
        ----------
        npartitions
            Number of output partitions.
        timeout
            Seconds to wait for every rank's exchange.
        accepted
            Per input partition, the insert ``attempt`` whose result Dask
            kept; every rank leaves other attempts' tables out of its
            exchange. ``None`` keeps every table.

        Raises
        ------
        ShuffleError
            With a rank's exchange error, or naming the ranks that did not
            finish within ``timeout`` seconds.
        """
        # A run that already failed here starts no exchange anywhere: peers
        # would otherwise wait in NCCL for this rank.
        self._raise_if_failed()
        info = msgpack.packb({"npartitions": npartitions, "accepted": accepted})
        for dest in range(self.comm.nranks):
            self.comm.send_nowait(dest, (DEVICE_TAG, self.op_id, "inputs-done"), [info])
        deadline = time.monotonic() + timeout
        while not self._acks_event.wait(0.1):
            self._raise_if_failed()
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.comm.nranks)) - set(self._acks))
                who = ", ".join(f"rank {r} ({self.comm.addresses[r]})" for r in missing)
                raise ShuffleTimeoutError(
                    f"device shuffle op {self.op_id}: {who} did not finish the exchange within {timeout:g} s"
                )
        self._raise_if_failed()
        errors = {r: e for r, e in self._acks.items() if e}
        if errors:
            raise ShuffleError(
                f"device shuffle op {self.op_id}: exchange failed on "
                + "; ".join(f"rank {r}: {e}" for r, e in sorted(errors.items()))
            )

    # -- messages (progress thread) -----------------------------------------
    def receive(self, src: int, tag: Tag, frames: Frames) -> None:
        """Handle a control message of this run (on the progress thread; never blocks)."""
        kind = tag[2]
        if kind == "inputs-done":
            info = msgpack.unpackb(frames[0])
            with self._lock:
                self._reply_to.append(src)
                if self._thread is None and not self._closed:
                    self._inputs_done = True
                    self.npartitions = int(info["npartitions"])
                    self._accepted = info.get("accepted")
                    r, n = self.comm.rank, self.comm.nranks
                    self._owned = set(range(r, self.npartitions, n))
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
            with self._lock:
                self._acks[src] = bytes(frames[0]).decode() if frames else ""
                if len(self._acks) == self.comm.nranks:
                    self._acks_event.set()
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

    def _slots_per_round(self, outbox: list[_Outgoing]) -> int:
        """How many input slots this rank can take per round under the device budget.

        A round holds, for a moment, the slots' outbox ranges and what they
        bring in; with about as much coming in as going out, a slot costs
        twice the largest outbox buffer. At least 1; without a budget, no
        limit (:data:`_UNBOUNDED_SLOTS`).
        """
        available = self.resource.available(MemoryType.DEVICE)
        if available is None:  # no budget here: let the ranks that have one decide
            return _UNBOUNDED_SLOTS
        biggest = max((end for o in outbox for _, end, _ in o.ranges.values()), default=0)
        return max(1, int(available // max(1, 2 * biggest)))

    def _exchange(self, state: DeviceState | None) -> None:
        comm, rank, nranks = self.comm, self.comm.rank, self.comm.nranks
        t0 = time.perf_counter()
        with self._lock:
            outbox = sorted(self._outbox, key=lambda o: o.input_index)
            accepted = self._accepted
        if accepted is not None:
            # An insert execution that Dask abandoned (its run restarted while
            # it ran) may have packed its table here too; only the attempt
            # whose result Dask kept counts, or its rows would come out twice.
            def kept_attempt(o: _Outgoing) -> bool:
                return 0 <= o.input_index < len(accepted) and accepted[o.input_index] == o.attempt

            for o in outbox:
                if not kept_attempt(o) and o.buffer is not None:
                    o.buffer.release()
                    o.buffer = None
            outbox = [o for o in outbox if kept_attempt(o)]
        per_round = self._slots_per_round(outbox)
        tag = (_XTAG, self.op_id, "headers")
        for dest in range(nranks):
            if dest != rank:
                entries = [[o.input_index, *o.ranges.get(dest, (0, 0, [])), o.meta] for o in outbox]
                comm.send_nowait(dest, tag, [msgpack.packb({"per_round": per_round, "entries": entries})])
        headers: dict[int, list[Any]] = {}
        for src in range(nranks):
            if src != rank:
                try:
                    header = msgpack.unpackb(bytes(comm.recv(src, tag, self.timeout)[0]))
                except Exception as e:
                    raise ShuffleError(f"piece headers from rank {src} failed: {e}") from e
                headers[src] = header["entries"]
                # Every rank takes the smallest count of any rank: all post the same slots per round.
                per_round = min(per_round, int(header["per_round"]))
        transport = state.transport(comm, self.key, self.timeout) if state and nranks > 1 else None
        t1 = time.perf_counter()
        self.statistics["seconds_headers"] += t1 - t0
        nslots = max([len(outbox)] + [len(h) for h in headers.values()])
        for first in range(0, nslots, per_round):
            self._raise_if_failed()
            tr = time.perf_counter()
            sends: dict[int, list[Any]] = {}
            recvs: dict[int, list[Any]] = {}
            got: list[_Incoming] = []
            outs = [o for o in outbox[first : first + per_round] if o.buffer is not None]
            kept: set[int] = set()
            # In slot order on both sides: NCCL matches a peer's sends and receives by order.
            for k in range(first, min(first + per_round, nslots)):
                out = outbox[k] if k < len(outbox) else None
                if out is not None and out.buffer is not None:
                    self._load(out.buffer)
                    data = out.buffer.data
                    for dest, (start, end, pieces) in out.ranges.items():
                        part = data[start:end]
                        if dest == rank:
                            # This rank's range stays where it is: the outbox buffer
                            # (and its accounting) becomes a received buffer, its
                            # pieces' offsets made relative to the whole buffer.
                            kept.add(id(out))
                            own = [(pid, off + start, nbytes, rows) for pid, off, nbytes, rows in pieces]
                            got.append(_Incoming(out.input_index, rank, out.buffer, own, out.meta))
                        else:
                            sends.setdefault(dest, []).append(part if out.buffer.on_device else _to_device(part))
                            self.statistics["bytes_sent"] += end - start
                for src, header in headers.items():
                    if k < len(header) and header[k][2] > header[k][1]:
                        input_index, start, end, pieces, meta = header[k]
                        buf = _empty_device(end - start)
                        recvs.setdefault(src, []).append(buf)
                        res = self.resource.reserve(MemoryType.DEVICE, end - start)
                        got.append(_Incoming(input_index, src, _Buffer(buf, res), [tuple(p) for p in pieces], meta))
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
        items = np.array([d.itemsize for d in piece_dtypes(meta)], dtype=np.int64)
        # One row per received piece: (piece's buffer, byte offset there, pid, rows).
        table = np.array(
            [(k, off, pid, rows) for k, inc in enumerate(incoming) for pid, off, _, rows in inc.pieces],
            dtype=np.int64,
        ).reshape(-1, 4)
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
        sizes = blocks_out.sum(axis=1)
        available = self.resource.available(MemoryType.DEVICE)
        if available is not None and available < int(sizes.sum()):
            return
        xp = np if isinstance(incoming[0].buffer.data, np.ndarray) else _cupy()
        try:
            outputs = _allocate(xp, sizes.tolist())
        except MemoryError:  # the budget had room, the device not (Dask's data shares it)
            logger.info("mpshuffle: op %d: no device memory to consolidate; extracts take the pieces", self.op_id)
            return
        part_of_piece = np.repeat(np.arange(len(pids)), counts)
        ncols = len(items)
        segments = np.empty((len(table), ncols, 5), dtype=np.int64)
        segments[:, :, 0] = table[:, 0:1]
        segments[:, :, 1] = table[:, 1:2] + (np.cumsum(blocks_in, axis=1) - blocks_in)
        segments[:, :, 2] = part_of_piece[:, None]
        out_offs = (np.cumsum(blocks_out, axis=1) - blocks_out)[part_of_piece]
        segments[:, :, 3] = out_offs + row_in_part[:, None] * items[None, :]
        segments[:, :, 4] = rows[:, None] * items[None, :]
        with self._scope():
            batched_copy([i.buffer.data for i in incoming], outputs, segments.reshape(-1, 5))
            if xp is not np:
                xp.cuda.get_current_stream().synchronize()
        with self._lock:
            if self._freed:
                return
            for pid, n, out, size in zip(pids.tolist(), totals.tolist(), outputs, sizes.tolist(), strict=True):
                res = self.resource.reserve(MemoryType.DEVICE, size)
                self._outputs[pid] = _Output(_Buffer(out, res), n, meta)
            for inc in self._incoming:
                inc.buffer.release()
            self._incoming = []
            self.statistics["bytes_consolidated"] += int(sizes.sum())
            self.statistics["seconds_consolidate"] += time.perf_counter() - t0

    # -- extract (task thread) ----------------------------------------------
    def extract(self, partition_id: int, timeout: float) -> list[PackedData]:
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
            If the run failed, the exchange did not end within ``timeout``
            seconds, or the partition is not owned here; a
            :class:`SpillError` if its spill file cannot be read (the run is
            failed then).
        """
        t0 = time.perf_counter()
        if not self._exchanged.wait(timeout):
            raise ShuffleTimeoutError(
                f"device shuffle op {self.op_id} on rank {self.comm.rank}: the exchange did not "
                f"finish within {timeout:g} s"
            )
        self._raise_if_failed()
        t1 = time.perf_counter()
        with self._lock:
            if partition_id not in self._owned:
                raise ShuffleError(
                    f"output partition {partition_id} of device shuffle op {self.op_id} is not "
                    f"owned by rank {self.comm.rank}"
                )
            if partition_id in self._extracted:
                raise PartitionGoneError(
                    f"output partition {partition_id} of device shuffle op {self.op_id} was already extracted"
                )
            self._extracted.add(partition_id)
            last = self._extracted == self._owned
            output = self._outputs.pop(partition_id, None)
            hits = [
                (inc, i) for inc in self._incoming
                for i, piece in enumerate(inc.pieces) if piece[0] == partition_id
            ]
        if output is not None:  # consolidated: one piece, handed over to the caller
            output.buffer.release()
            found = [((0, 0), PackedData(output.meta, output.buffer.data, output.nrows))]
        else:
            found = self._pieces_of(partition_id, hits)
            found.sort(key=lambda x: x[0])
        with self._lock:
            self.statistics["seconds_wait"] += t1 - t0
            self.statistics["seconds_extract"] += time.perf_counter() - t1
        if last:
            self.close()
        return [p for _, p in found]

    def _pieces_of(
        self, partition_id: int, hits: list[tuple[_Incoming, int]]
    ) -> list[tuple[tuple[int, int], PackedData]]:
        """The pieces ``(input partition, source rank), PackedData`` of ``hits`` (received, piece index).

        Pieces on disk are all in the partition's one spill file: it is read
        (and deleted) once, at the first of them, and their ``DISK``
        reservations are released.
        """
        file: Any = None
        found = []
        unspilled = 0
        for inc, i in hits:
            _, off, nbytes, nrows = inc.pieces[i]
            disk = inc.buffer.disk
            if disk is None:
                view = inc.buffer.data[off : off + nbytes]
            else:
                if file is None:
                    file = self._read_partition(partition_id)
                _, foff, fbytes, res = disk[i]
                if len(file) < foff + fbytes:
                    self._raise_if_failed()
                    raise SpillError(
                        f"spill file of output partition {partition_id} in {self._spill_in.path} "
                        f"is missing or short ({len(file)} bytes, the piece ends at {foff + fbytes})"
                    )
                view = file[foff : foff + fbytes]
                res.release()
                unspilled += fbytes
            found.append(((inc.input_index, inc.src), PackedData(inc.meta, view, nrows)))
        if unspilled:
            with self._lock:
                self.statistics["bytes_unspilled_disk"] += unspilled
        return found

    def _read_partition(self, partition_id: int) -> Any:
        t0 = time.perf_counter()
        try:
            view = self._spill_in.read(partition_id)
        except SpillError as e:
            self.fail(e)
            raise
        file = np.frombuffer(view, dtype=np.uint8) if len(view) else np.empty(0, dtype=np.uint8)
        with self._lock:
            self.statistics["seconds_unspill_disk"] += time.perf_counter() - t0
        return file

    # -- failure and cleanup -------------------------------------------------
    def fail(self, error: BaseException) -> None:
        """Fail the run on this rank: waits raise ``error``; buffers are freed."""
        with self._lock:
            if self._error is None:
                self._error = error
        self._acks_event.set()
        self._exchanged.set()
        self._free()

    def _raise_if_failed(self) -> None:
        err = self._error
        if err is not None:
            if isinstance(err, ShuffleError):
                raise err
            raise ShuffleError(f"device shuffle op {self.op_id} failed on rank {self.comm.rank}: {err}") from err

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
        self._spill_out.remove()
        self._spill_in.remove()

    @property
    def inputs_done(self) -> bool:
        """Whether the barrier's ``inputs-done`` reached this rank."""
        return self._inputs_done

    @property
    def closed(self) -> bool:
        """Whether the run's state on this rank was freed."""
        return self._closed

    def close(self) -> None:
        """Free every buffer of the run on this rank (extracted views stay valid). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        self._free()
        if thread is not None and thread is not threading.current_thread():
            # It may still be sending its acks; a closed run leaves no thread behind.
            thread.join(timeout=10)
        if self._on_done is not None:
            self._on_done(self.op_id)


def _ptr(a: Any) -> int:
    data = getattr(a, "data", None)
    ptr = getattr(data, "ptr", None)
    if ptr is not None:  # CuPy
        return int(ptr)
    return int(a.__array_interface__["data"][0])


def _allocate(xp: Any, sizes: list[int]) -> list[Any]:
    """One ``uint8`` array of each size (``MemoryError`` where the device is full)."""
    return [xp.empty(n, dtype=np.uint8) for n in sizes]


def _cupy() -> Any:
    import cupy

    return cupy


def _empty_device(nbytes: int) -> Any:
    import cupy

    return cupy.empty(nbytes, dtype=np.uint8)


def _to_device(host: Any) -> Any:
    import cupy

    return cupy.asarray(host)
