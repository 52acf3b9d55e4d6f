"""What one rank of a generation holds: its communicator, budgets, GPU and runs."""

from __future__ import annotations

import collections
import logging
import threading
from typing import TYPE_CHECKING, Any

from mpshuffle.comm.local import LocalCommunicator
from mpshuffle.errors import PartitionGoneError, ShuffleError
from mpshuffle.memory import BufferResource, MemoryType
from mpshuffle.memory.allocator import use_system_allocator
from mpshuffle.memory.device import pinned_empty
from mpshuffle.memory.pool import HostPool, aligned_empty
from mpshuffle.shuffler.device import DEVICE_TAG, DeviceRun, DeviceState, setup_device
from mpshuffle.shuffler.device.buffers import STAGE_BYTES, HostBlocks
from mpshuffle.shuffler.host import TAG, Shuffler
from mpshuffle.shuffler.run import Run

if TYPE_CHECKING:
    from collections.abc import Callable

    from mpshuffle.comm import Communicator, Frames, Tag
    from mpshuffle.options import Options

__all__ = ["WorkerContext"]

logger = logging.getLogger(__name__)

# How many finished runs' statistics a context keeps for gather_statistics.
_HISTORY = 64
# Free pooled host memory a context may keep without a host budget (bytes);
# with one, a quarter of it.
_POOL_DEFAULT = 2**30


class WorkerContext:
    """What one rank of a generation holds: its communicator and shufflers.

    Made by whoever drives the engine: the Dask worker plugin per
    generation (returned on a worker by :func:`mpshuffle.dask.get_worker_context`),
    the single-process runtime, a test. It creates each run on first use
    (:meth:`shuffler`) and routes the communicator's messages to it.

    The host budget is :meth:`~mpshuffle.options.Options.host_budget` of
    ``memory_limit``, ``memory_ceiling`` (the fraction of it the worker's
    memory manager acts at, or ``None``) and ``memory_in_use`` (the
    process's bytes before the first run).

    Attributes
    ----------
    rank, nranks
        This worker's rank and the generation's size.
    generation
        Id of the generation.
    comm
        The communicator.
    options
        The generation's options.
    resource
        Budgets and use of the memory types on this worker.
    pool
        Host memory reused by the runs' buffers (:class:`~mpshuffle.memory.pool.HostPool`):
        free blocks (at most 4 per size class, a quarter of the host budget in
        all) kept only while a run is active, reserved against the budget.
    blocks
        The device runs' host memory (:class:`~mpshuffle.shuffler.device.buffers.HostBlocks`),
        page-locked where there is a GPU and reused across spills and runs:
        ``blocks.spill`` holds buffers moved device -> host; its free blocks
        are kept across runs, at most the host budget of them (1 GiB without
        one), reserved against it, and given back when the host tier needs
        room (:meth:`~mpshuffle.memory.BufferResource.reclaim`), when Dask
        pauses the worker (:meth:`move_to_disk`) and when the context
        closes. ``blocks.stage`` holds transfer blocks (between disk and the
        device): at most two free blocks of
        :data:`~mpshuffle.shuffler.device.buffers.STAGE_BYTES`, kept across
        runs outside the budget (as a socket's buffers are).
    shufflers
        Running shuffles on this rank, by ``op_id``.
    history
        Statistics of the last finished runs, as ``(op_id, statistics)``.
    used
        The options each of those runs used on this rank, by ``op_id``: the
        generation's (as this worker resolved them), the run's own
        (``timeout``, ``batch_bytes``) and ``host_budget`` (bytes, or
        ``None`` for unbounded).
    on_link_lost
        ``None``, or called as ``on_link_lost(peer, reason, op_ids)`` (on the
        progress thread, or a task's; must not block) when this rank's
        communicator gave up rank ``peer`` because a connection broke (not
        by a goodbye), with the runs that can no longer exchange with it:
        those active on this rank at the loss (failed here at once), then
        each run made afterwards (failed at once too) and each run whose
        message to ``peer`` could not be sent (its last finish counts or
        barrier acknowledgement, after it ended here). The other ranks may
        be waiting for those runs; the owner tells them (the Dask worker
        plugin tells the scheduler, which fails the runs everywhere).
    device
        This rank's GPU (:class:`~mpshuffle.shuffler.device.DeviceState`: device
        id, ``spill_device`` budget, ``pool_size`` pool), or ``None`` where
        CuPy or a GPU is missing. Set up on first use (the first device run,
        or reading this attribute), not with the context (unless ``pool_size``
        is set: that pool is reserved up front): setting it up
        imports CuPy and makes a CUDA context (with ``pool_size``, reserves
        the pool), which took ~2 s per worker on the lent 16-core GPU host,
        where 16 CPU workers sharing its one GPU each made a context on it at
        every fresh cluster's first graph. A CPU shuffle never pays that.
    """

    def __init__(
        self,
        comm: Communicator,
        generation: str,
        options: Options,
        *,
        memory_limit: int | None = None,
        memory_ceiling: float | None = None,
        memory_in_use: int = 0,
        local_directory: str | None = None,
        workers: tuple[str, ...] = (),
    ) -> None:
        self.comm = comm
        self.rank = comm.rank
        self.nranks = comm.nranks
        self.generation = generation
        self.options = options
        self.workers = workers
        worker = workers[comm.rank] if comm.rank < len(workers) else comm.addresses[comm.rank]
        if len(workers) == comm.nranks:
            # Errors name ranks by their workers (what a Dask user knows), not by mpshuffle's own sockets.
            comm.set_peer_names([f"worker {w}" for w in workers])
        self._device: DeviceState | None = None
        self._device_ready = False
        self._device_lock = threading.Lock()
        limits: dict[MemoryType, int | None] = {
            MemoryType.HOST: options.host_budget(memory_limit, ceiling=memory_ceiling, in_use=memory_in_use)
        }
        self.resource = BufferResource(
            limits,
            spill_dir=options.spill_dir or local_directory,
            owner=f"rank {comm.rank} (worker {worker})",
            spill_prefix=f"mpshuffle-{generation}",
        )
        if not isinstance(comm, LocalCommunicator):
            # A worker process of a cluster (not the user's own process, which
            # Dask's single-process schedulers run in): see memory/allocator.py.
            use_system_allocator()
        budget = limits[MemoryType.HOST]
        self.pool = HostPool(_POOL_DEFAULT if budget is None else budget // 4, self.resource)
        self.pool.retain = False  # until a run starts
        # Device runs' spilled buffers and transfers: page-locked where there is
        # a GPU (fresh page-locked memory costs what a copy into it saves, so it
        # pays only where reused: across spills and runs, within the budget).
        # Only device runs take blocks from these pools, so the GPU is known
        # (set up) by the time the first block is made.
        fresh = self._fresh_block
        spill_pool = HostPool(_POOL_DEFAULT if budget is None else budget, self.resource,
                              per_class=2**16, fresh=fresh)
        self.resource.add_reclaimer(MemoryType.HOST, spill_pool.trim)
        stage_pool = HostPool(2 * STAGE_BYTES, None, per_class=2, fresh=fresh)
        self.blocks = HostBlocks(spill_pool, stage_pool)
        # Chunks from a socket land in pooled memory too (the tcp backend's
        # hook; other backends hand over the sender's own buffers).
        set_allocator = getattr(comm, "set_receive_allocator", None)
        if set_allocator is not None:
            set_allocator(self.pool.allocate)
        self.shufflers: dict[int, Run] = {}
        self.history: collections.deque[tuple[int, dict[str, float]]] = collections.deque(maxlen=_HISTORY)
        self.used: collections.OrderedDict[int, dict[str, Any]] = collections.OrderedDict()
        self._finished: collections.deque[int] = collections.deque(maxlen=4096)
        self._failed: dict[int, BaseException] = {}
        self._lock = threading.RLock()
        self._closed = False
        self.on_link_lost: Callable[[int, str, list[int]], None] | None = None
        self._told: dict[int, set[int]] = {}
        if options.pool_size:
            # Asked for a device pool: reserve it now, up front, as the option says.
            _ = self.device
        comm.register_handler(TAG, self._on_message)
        comm.register_handler(DEVICE_TAG, self._on_message)
        comm.on_peer_lost(self._on_peer_lost)
        comm.on_unsent(self._on_unsent)

    @property
    def device(self) -> DeviceState | None:
        """This rank's GPU, set up on first use (see the class's attributes); ``None`` without one.

        Raises
        ------
        MemoryError
            If the ``pool_size`` reservation does not fit on the device (then
            every later use tries again).
        """
        if not self._device_ready:
            with self._device_lock:
                if not self._device_ready:
                    state = setup_device(self.options, self.rank)
                    if state is not None:
                        # A device budget given to the resource before (a
                        # test's, an owner's) stays.
                        self.resource.limits.setdefault(MemoryType.DEVICE, state.budget)
                    self._device = state
                    self._device_ready = True
        return self._device

    def _fresh_block(self, nbytes: int) -> Any:
        """A new block for the device runs' host pools: page-locked where this rank has a GPU."""
        return pinned_empty(nbytes) if self.device is not None else aligned_empty(nbytes)

    def shuffler(
        self, op_id: int, *, device: bool = False, timeout: float | None = None, batch_bytes: int | None = None
    ) -> Run:
        """The run ``op_id`` on this rank, created on first use.

        A :class:`~mpshuffle.shuffler.Shuffler`, or with ``device=True`` a
        :class:`~mpshuffle.shuffler.device.DeviceRun` (device tables over NCCL).

        ``timeout`` (seconds) and ``batch_bytes`` are the run's own options
        (:data:`~mpshuffle.options.RUN_OPTIONS`), which a task of the run
        passes from its graph; they also apply to a run that a peer's
        message created before any task of it ran here. ``None`` keeps what
        the run has (at creation: this context's options).

        Raises
        ------
        PartitionGoneError
            If the run already finished on this rank.
        ShuffleError
            If the run failed on this rank, or the context is closed.
        """
        with self._lock:
            s = self.shufflers.get(op_id)
            if s is not None:
                s.set_run_options(timeout, batch_bytes)
                return s
            if self._closed:
                raise ShuffleError(f"generation {self.generation} on rank {self.rank} is closed")
            if op_id in self._failed:
                err = self._failed[op_id]
                raise ShuffleError(f"shuffle op {op_id} failed: {err}")
            if op_id in self._finished:
                raise PartitionGoneError(
                    f"shuffle op {op_id} already finished on rank {self.rank} (its data was handed out)"
                )
            timeout = self.options.timeout if timeout is None else timeout
            batch_bytes = self.options.batch_bytes if batch_bytes is None else batch_bytes
            if device:
                s = DeviceRun(
                    self.comm, op_id, resource=self.resource, state=self.device,
                    key=self.generation, timeout=timeout, on_done=self._on_done, blocks=self.blocks,
                )
            else:
                s = Shuffler(
                    self.comm, op_id, resource=self.resource, timeout=timeout,
                    batch_bytes=batch_bytes, pool=self.pool, on_done=self._on_done,
                )
            self.shufflers[op_id] = s
            self.pool.retain = True
            broken = self._broken()
            if broken:
                # A run made after this rank lost a peer can never exchange with
                # it: it fails at once, as the runs active at the loss did.
                peer, reason = min(broken.items())
                s.fail(self._unreachable(peer, reason))
                self._tell_link_lost(peer, reason, [op_id])
            return s

    def _broken(self) -> dict[int, str]:
        """Peers lost because a connection broke (not by a goodbye), with the reason."""
        departed = self.comm.departed
        return {r: why for r, why in self.comm.lost.items() if r not in departed}

    def _unreachable(self, peer: int, reason: str) -> ShuffleError:
        return ShuffleError(f"rank {self.rank} can no longer reach {self.comm.describe(peer)}: {reason}")

    def _tell_link_lost(self, peer: int, reason: str, op_ids: list[int]) -> None:
        # Once per peer and run: a run may have several messages to the peer
        # that cannot leave. The first report about a peer goes even without
        # runs (the owner retires the generation).
        with self._lock:
            first = peer not in self._told
            told = self._told.setdefault(peer, set())
            op_ids = [op for op in op_ids if op not in told]
            told.update(op_ids)
        if self.on_link_lost is not None and (first or op_ids):
            try:
                self.on_link_lost(peer, reason, op_ids)
            except Exception:
                logger.exception("mpshuffle: reporting the lost link to rank %d failed", peer)

    def has_ended(self, op_id: int) -> bool:
        """Whether run ``op_id`` finished, was released or failed on this rank."""
        with self._lock:
            return op_id in self._finished or op_id in self._failed

    def _on_done(self, op_id: int) -> None:
        with self._lock:
            s = self.shufflers.pop(op_id, None)
            self._finished.append(op_id)
            if s is not None:
                self.history.append((op_id, dict(s.statistics)))
                self.used[op_id] = {
                    **self.options.as_dict(), **s.run_options(),
                    "host_budget": self.resource.limit(MemoryType.HOST),
                }
                while len(self.used) > _HISTORY:
                    self.used.popitem(last=False)
            self._release_pool()

    def _release_pool(self) -> None:
        # An idle worker keeps no pooled memory: Dask sees it as unmanaged.
        if not self.shufflers:
            self.pool.retain = False
            self.pool.trim()

    def _on_message(self, src: int, tag: Tag, frames: Frames) -> None:
        # Host runs' messages are tagged TAG, device runs' DEVICE_TAG: the
        # first message of a run on this rank creates it of the right kind.
        op_id = tag[1]
        with self._lock:
            if op_id in self._finished or op_id in self._failed or self._closed:
                logger.debug("mpshuffle: dropped %r from rank %d for a finished run", tag, src)
                return
            s = self.shuffler(op_id, device=tag[0] == DEVICE_TAG)
        s.receive(src, tag, frames)

    def _on_peer_lost(self, rank: int, reason: str) -> None:
        err = self._unreachable(rank, reason)
        with self._lock:
            shufflers = dict(self.shufflers)
        for s in shufflers.values():
            s.fail(err)
        if rank not in self.comm.departed:
            self._tell_link_lost(rank, reason, sorted(shufflers))

    def _on_unsent(self, dest: int, tag: Tag) -> None:
        # A run's message (its finish counts, an acknowledgement) that a
        # broken link kept from its peer: the peer would wait for it.
        if len(tag) < 2 or tag[0] not in (TAG, DEVICE_TAG):
            return
        reason = self._broken().get(dest)
        if reason is not None:
            self._tell_link_lost(dest, reason, [int(tag[1])])

    def fail_run(self, op_id: int, reason: str) -> None:
        """Fail run ``op_id`` on this rank and free its buffers; later messages are dropped."""
        err = ShuffleError(reason)
        with self._lock:
            self._failed[op_id] = err
            s = self.shufflers.pop(op_id, None)
        if s is not None:
            s.fail(err)
            s.close()

    def move_to_disk(self) -> int:
        """Move what this rank's host runs hold in memory to disk, and give the pools' free blocks back.

        What a worker does when its memory manager paused it (see
        :meth:`mpshuffle.memory.postbox.Postbox.move_to_disk`).

        Returns
        -------
        int
            Bytes freed: the chunks moved plus the pools' free blocks given back.
        """
        with self._lock:
            runs = list(self.shufflers.values())
        freed = 0
        for run in runs:
            move = getattr(run, "move_to_disk", None)  # host runs; device runs spill by their own store
            if move is not None:
                freed += move()
        return freed + self.pool.trim() + self._trim_blocks()

    def _trim_blocks(self) -> int:
        return sum(p.trim() for p in (self.blocks.spill, self.blocks.stage) if p is not None)

    def end_run(self, op_id: int) -> None:
        """Free run ``op_id``'s state on this rank (it finished or was released)."""
        with self._lock:
            s = self.shufflers.get(op_id)
        if s is not None:
            # Wakes a task still waiting in this run (its graph was released).
            s.fail(ShuffleError(f"shuffle op {op_id} was released on rank {self.rank}"))
            s.close()
        with self._lock:
            self.shufflers.pop(op_id, None)
            if op_id not in self._finished:
                self._finished.append(op_id)
            self._release_pool()

    def close(self) -> None:
        """Close every run and the communicator. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            shufflers = list(self.shufflers.values())
            self.shufflers.clear()
        for s in shufflers:
            s.fail(ShuffleError(f"generation {self.generation} was closed on rank {self.rank}"))
            s.close()
        if self._device is not None:
            self._device.close()
        self.pool.close()
        for p in (self.blocks.spill, self.blocks.stage):
            if p is not None:
                p.close()
        self.comm.close()
