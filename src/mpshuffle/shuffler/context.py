"""Per-process shuffle state: the worker context and the single-process runtime."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
from typing import TYPE_CHECKING

from mpshuffle.comm.local import LocalCommunicator
from mpshuffle.errors import PartitionGoneError, ShuffleError
from mpshuffle.memory import BufferResource, MemoryType
from mpshuffle.memory.allocator import use_system_allocator
from mpshuffle.memory.pool import HostPool
from mpshuffle.shuffler.device import DEVICE_TAG, DeviceRun, setup_device
from mpshuffle.shuffler.host import TAG, Shuffler
from mpshuffle.shuffler.run import Run

if TYPE_CHECKING:
    from collections.abc import Callable

    from mpshuffle.comm import Communicator, Frames, Tag
    from mpshuffle.options import Options

__all__ = ["LocalRuntime", "RunInfo", "WorkerContext"]

logger = logging.getLogger(__name__)

# How many finished runs' statistics a context keeps for gather_statistics.
_HISTORY = 64
# Free pooled host memory a context may keep without a host budget (bytes);
# with one, a quarter of it.
_POOL_DEFAULT = 2**30


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """One execution of a shuffle graph, bound to a generation when it starts.

    Attributes
    ----------
    token
        Token of the shuffle graph (the same for every computation of it).
    op_id
        Id of this run, unique within the scheduler (or process).
    generation
        Id of the generation the run uses.
    workers
        Worker address of every rank of that generation, in rank order.
    npartitions
        Number of output partitions.
    """

    token: str
    op_id: int
    generation: str
    workers: tuple[str, ...]
    npartitions: int


class WorkerContext:
    """What one rank of a generation holds: its communicator and shufflers.

    Returned on a worker by :func:`mpshuffle.dask.get_worker_context`.

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
    shufflers
        Running shuffles on this rank, by ``op_id``.
    history
        Statistics of the last finished runs, as ``(op_id, statistics)``.
    device
        This rank's GPU (:class:`~mpshuffle.shuffler.device.DeviceState`: device
        id, ``spill_device`` budget, ``pool_size`` pool), or ``None`` where
        CuPy or a GPU is missing.
    """

    def __init__(
        self,
        comm: Communicator,
        generation: str,
        options: Options,
        *,
        memory_limit: int | None = None,
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
        self.device = setup_device(options, comm.rank)
        limits: dict[MemoryType, int | None] = {MemoryType.HOST: options.host_budget(memory_limit)}
        if self.device is not None:
            limits[MemoryType.DEVICE] = self.device.budget
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
        # Chunks from a socket land in pooled memory too (the tcp backend's
        # hook; other backends hand over the sender's own buffers).
        set_allocator = getattr(comm, "set_receive_allocator", None)
        if set_allocator is not None:
            set_allocator(self.pool.allocate)
        self.shufflers: dict[int, Run] = {}
        self.history: collections.deque[tuple[int, dict[str, float]]] = collections.deque(maxlen=_HISTORY)
        self._finished: collections.deque[int] = collections.deque(maxlen=4096)
        self._failed: dict[int, BaseException] = {}
        self._lock = threading.RLock()
        self._closed = False
        comm.register_handler(TAG, self._on_message)
        comm.register_handler(DEVICE_TAG, self._on_message)
        comm.on_peer_lost(self._on_peer_lost)

    def shuffler(self, op_id: int, *, device: bool = False) -> Run:
        """The run ``op_id`` on this rank, created on first use.

        A :class:`~mpshuffle.shuffler.Shuffler`, or with ``device=True`` a
        :class:`~mpshuffle.shuffler.device.DeviceRun` (device tables over NCCL).

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
            if device:
                s = DeviceRun(
                    self.comm, op_id, resource=self.resource, state=self.device,
                    key=self.generation, timeout=self.options.timeout, on_done=self._on_done,
                )
            else:
                s = Shuffler(
                    self.comm, op_id, resource=self.resource, timeout=self.options.timeout,
                    batch_bytes=self.options.batch_bytes, pool=self.pool, on_done=self._on_done,
                )
            self.shufflers[op_id] = s
            self.pool.retain = True
            return s

    def _on_done(self, op_id: int) -> None:
        with self._lock:
            s = self.shufflers.pop(op_id, None)
            self._finished.append(op_id)
            if s is not None:
                self.history.append((op_id, dict(s.statistics)))
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
        address = self.workers[rank] if rank < len(self.workers) else self.comm.addresses[rank]
        err = ShuffleError(f"rank {rank} (worker {address}) was lost: {reason}")
        with self._lock:
            shufflers = list(self.shufflers.values())
        for s in shufflers:
            s.fail(err)

    def fail_run(self, op_id: int, reason: str) -> None:
        """Fail run ``op_id`` on this rank and free its buffers; later messages are dropped."""
        err = ShuffleError(reason)
        with self._lock:
            self._failed[op_id] = err
            s = self.shufflers.pop(op_id, None)
        if s is not None:
            s.fail(err)
            s.close()

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
        if self.device is not None:
            self.device.close()
        self.pool.close()
        self.comm.close()


class LocalRuntime:
    """Shuffle state of one process when Dask runs without a distributed Client.

    With Dask's synchronous or threaded scheduler, every task runs in this
    process: the runtime holds one :class:`WorkerContext` on the ``local``
    communicator, created on first use, and binds runs to it.

    Parameters
    ----------
    resolve
        Returns the options of the context when it is first created (the Dask
        integration passes :func:`mpshuffle.config.resolve_options`, which
        reads ``dask.config``; the engine itself never reads it).
    """

    def __init__(self, resolve: Callable[[], Options]) -> None:
        self._resolve = resolve
        self._context: WorkerContext | None = None
        self._runs: dict[str, RunInfo] = {}
        self._ops = itertools.count(1)
        self._lock = threading.Lock()

    @property
    def context(self) -> WorkerContext:
        """The process's context (created with the options ``resolve`` returns)."""
        with self._lock:
            if self._context is None:
                options = self._resolve()
                self._context = WorkerContext(LocalCommunicator(), "local", options, workers=("local",))
            return self._context

    def get_run(self, token: str, npartitions: int, inserting: bool = False) -> RunInfo:
        """The active run of graph ``token``, or a new one.

        An insert into a run whose inputs are already done starts a new
        computation of the graph (an earlier one extracted only some
        partitions): the old run is freed and a new one begins.
        """
        ctx = self.context
        with self._lock:
            run = self._runs.get(token)
            if run is not None and not _ended(ctx, run.op_id):
                old = ctx.shufflers.get(run.op_id)
                if not (inserting and old is not None and old.inputs_done):
                    return run
                ctx.end_run(run.op_id)
            run = RunInfo(token, next(self._ops), "local", ("local",), npartitions)
            self._runs[token] = run
            return run

    def end_run(self, token: str) -> None:
        """Forget the run of ``token`` (after its last partition was extracted)."""
        with self._lock:
            self._runs.pop(token, None)


def _ended(ctx: WorkerContext, op_id: int) -> bool:
    return op_id in ctx._finished or op_id in ctx._failed
