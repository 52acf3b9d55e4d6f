"""Where a shuffle graph's tasks find their run: the runtime protocol and the single-process runtime.

A task of a shuffle graph (:mod:`mpshuffle.dask.graph`) knows its
:class:`~mpshuffle.dask.graph.ShuffleSpec`, not its run. It asks a
:class:`Runtime` to bind the graph to a run (:class:`RunInfo`) and to give
this process's :class:`~mpshuffle.shuffler.context.WorkerContext` of that
run's generation. Two runtimes implement the protocol:

* :class:`~mpshuffle.dask.worker.ShuffleWorkerPlugin` on a ``distributed``
  worker: the scheduler plugin binds runs, pins tasks and restarts runs;
* :class:`LocalRuntime` without a distributed Client (Dask's synchronous or
  threaded scheduler): one rank in this process, on the ``local``
  communicator.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

from mpshuffle.errors import phase
from mpshuffle.shuffler.context import WorkerContext

if TYPE_CHECKING:
    from mpshuffle.options import Options

__all__ = ["LocalRuntime", "RunInfo", "Runtime"]


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
    timeout
        The run's ``timeout`` option (seconds), from the graph's spec.
    """

    token: str
    op_id: int
    generation: str
    workers: tuple[str, ...]
    npartitions: int
    timeout: float


class Runtime(Protocol):
    """What a shuffle task asks of the process it runs in.

    Every method is called from a task thread.
    """

    def get_run(
        self, token: str, npartitions: int, *, options: Options, extract_name: str, barrier_name: str,
        inserting: bool = False,
    ) -> RunInfo:
        """The run of graph ``token`` (its output has ``npartitions`` partitions), made on first call.

        ``options`` are the graph's (resolved where it was built): the run
        is bound to a generation made with its generation options
        (:meth:`~mpshuffle.options.Options.generation_options`).
        ``extract_name`` and ``barrier_name`` name the graph's tasks (to pin
        them); ``inserting`` says an insert task asks (a finished computation
        of the graph then starts a new run, where the runtime decides so).

        Raises
        ------
        ShuffleError
            If the run failed or could not be bound (bootstrap failed).
        """
        ...

    def context_for(self, run: RunInfo) -> WorkerContext:
        """This process's context of ``run``'s generation.

        Raises
        ------
        ShuffleError
            If this process no longer holds that generation.
        """
        ...

    def guard(self, name: str, run: RunInfo, ctx: WorkerContext) -> AbstractContextManager[None]:
        """Context of phase ``name`` of a task of ``run``: errors are labelled with the phase and rank."""
        ...

    def check_owner(self, run: RunInfo, partition_id: int) -> None:
        """Make sure this process holds the rank owning output partition ``partition_id``.

        Raises
        ------
        distributed.Reschedule
            On a worker that is not the owner's (the scheduler places the task again).
        """
        ...

    def restart_run(self, run: RunInfo, reason: str) -> None:
        """Ask for ``run`` to be computed again (a task found it cannot go on with it).

        Returns where this runtime cannot restart runs; the caller then
        raises its own error.

        Raises
        ------
        distributed.Reschedule
            If the run was restarted.
        ShuffleError
            If the runtime could restart runs but declined this one.
        """
        ...

    def extracted(self, run: RunInfo, ctx: WorkerContext) -> None:
        """An extract task of ``run`` has handed out its partition."""
        ...


class LocalRuntime:
    """Shuffle state of one process when Dask runs without a distributed Client.

    With Dask's synchronous or threaded scheduler, every task runs in this
    process: the runtime holds one :class:`WorkerContext` on the ``local``
    communicator per set of generation options its graphs asked for
    (usually one), created on first use, and binds runs to it. An idle
    context whose options no graph asks for any more is closed when another
    one is made. Implements :class:`Runtime`.
    """

    def __init__(self) -> None:
        self._contexts: dict[str, WorkerContext] = {}
        self._runs: dict[str, RunInfo] = {}
        self._ops = itertools.count(1)
        self._generations = itertools.count()
        self._lock = threading.Lock()

    @property
    def context(self) -> WorkerContext:
        """The newest context (made with the shipped defaults if no graph has run yet)."""
        with self._lock:
            if not self._contexts:
                from mpshuffle.options import Options

                return self._context_locked(Options())
            return next(reversed(self._contexts.values()))

    def _context_locked(self, options: Options) -> WorkerContext:
        key = repr(sorted(options.generation_options().items()))
        ctx = self._contexts.get(key)
        if ctx is None:
            from mpshuffle.comm.local import LocalCommunicator

            for other, old in list(self._contexts.items()):
                if not old.shufflers:  # idle: nothing of it is still needed
                    del self._contexts[other]
                    old.close()
            n = next(self._generations)
            generation = f"local-{n}" if n else "local"
            ctx = WorkerContext(LocalCommunicator(), generation, options, workers=("local",))
            self._contexts[key] = ctx
        return ctx

    @property
    def contexts(self) -> list[WorkerContext]:
        """This process's open contexts, oldest first."""
        with self._lock:
            return list(self._contexts.values())

    def close(self) -> None:
        """Close every context of this process (their runs fail)."""
        with self._lock:
            contexts = list(self._contexts.values())
            self._contexts.clear()
            self._runs.clear()
        for ctx in contexts:
            ctx.close()

    def get_run(
        self, token: str, npartitions: int, *, options: Options, extract_name: str = "",
        barrier_name: str = "", inserting: bool = False,
    ) -> RunInfo:
        """The active run of graph ``token``, or a new one.

        An insert into a run whose inputs are already done starts a new
        computation of the graph (an earlier one extracted only some
        partitions): the old run is freed and a new one begins. The task
        names are not needed: one process runs every task.
        """
        with self._lock:
            ctx = self._context_locked(options)
            run = self._runs.get(token)
            if run is not None and not ctx.has_ended(run.op_id) and run.generation == ctx.generation:
                old = ctx.shufflers.get(run.op_id)
                if not (inserting and old is not None and old.inputs_done):
                    return run
                ctx.end_run(run.op_id)
            run = RunInfo(token, next(self._ops), ctx.generation, ("local",), npartitions, options.timeout)
            self._runs[token] = run
            return run

    def context_for(self, run: RunInfo) -> WorkerContext:
        """The process's context of ``run``'s generation.

        Raises
        ------
        ShuffleError
            If that context was closed (no run of it was active when another was made).
        """
        with self._lock:
            for ctx in self._contexts.values():
                if ctx.generation == run.generation:
                    return ctx
        from mpshuffle.errors import ShuffleError

        raise ShuffleError(f"shuffle op {run.op_id}: its local generation {run.generation} was closed")

    @contextlib.contextmanager
    def guard(self, name: str, run: RunInfo, ctx: WorkerContext) -> Iterator[None]:
        """Label errors with the phase and the one rank; a failed task fails its run.

        Dask's local schedulers end the computation at a task's error, and no
        scheduler plugin is there to free the run afterwards: the run is
        failed here (its buffers and spill files freed) and forgotten, so
        the next computation of the graph starts a fresh one.
        """
        try:
            with phase(name, f"rank {ctx.rank} ({ctx.workers[ctx.rank] if ctx.workers else ''})"):
                yield
        except BaseException as e:
            if not ctx.has_ended(run.op_id):
                # Once: the tasks that fail after it raise the run's error,
                # which nested into a new reason each time made one message
                # of four or more copies of the first.
                ctx.fail_run(run.op_id, f"shuffle op {run.op_id}: a {name} task failed: {e}")
            with self._lock:
                if self._runs.get(run.token) == run:
                    del self._runs[run.token]
            raise

    def check_owner(self, run: RunInfo, partition_id: int) -> None:
        """Nothing to check: the one rank owns every partition."""

    def restart_run(self, run: RunInfo, reason: str) -> None:
        """Returns: a single process cannot restart a run (Dask's local schedulers compute a graph once)."""

    def extracted(self, run: RunInfo, ctx: WorkerContext) -> None:
        """Forget the graph's run once its last partition was handed out (the next computation makes a new one)."""
        if run.op_id not in ctx.shufflers:
            with self._lock:
                if self._runs.get(run.token) == run:
                    del self._runs[run.token]
