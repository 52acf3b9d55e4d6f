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
from typing import Protocol

from mpshuffle.errors import phase
from mpshuffle.shuffler.context import WorkerContext

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
    """

    token: str
    op_id: int
    generation: str
    workers: tuple[str, ...]
    npartitions: int


class Runtime(Protocol):
    """What a shuffle task asks of the process it runs in.

    Every method is called from a task thread.
    """

    def get_run(
        self, token: str, npartitions: int, *, extract_name: str, barrier_name: str, inserting: bool = False
    ) -> RunInfo:
        """The run of graph ``token`` (its output has ``npartitions`` partitions), made on first call.

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
    communicator, created on first use, and binds runs to it. Implements
    :class:`Runtime`.
    """

    def __init__(self) -> None:
        self._context: WorkerContext | None = None
        self._runs: dict[str, RunInfo] = {}
        self._ops = itertools.count(1)
        self._lock = threading.Lock()

    @property
    def context(self) -> WorkerContext:
        """The process's context (created with the options of ``dask.config``)."""
        with self._lock:
            if self._context is None:
                from mpshuffle.comm.local import LocalCommunicator
                from mpshuffle.config import resolve_options

                options = resolve_options()
                self._context = WorkerContext(LocalCommunicator(), "local", options, workers=("local",))
            return self._context

    def get_run(
        self, token: str, npartitions: int, *, extract_name: str = "", barrier_name: str = "",
        inserting: bool = False,
    ) -> RunInfo:
        """The active run of graph ``token``, or a new one.

        An insert into a run whose inputs are already done starts a new
        computation of the graph (an earlier one extracted only some
        partitions): the old run is freed and a new one begins. The task
        names are not needed: one process runs every task.
        """
        ctx = self.context
        with self._lock:
            run = self._runs.get(token)
            if run is not None and not ctx.has_ended(run.op_id):
                old = ctx.shufflers.get(run.op_id)
                if not (inserting and old is not None and old.inputs_done):
                    return run
                ctx.end_run(run.op_id)
            run = RunInfo(token, next(self._ops), "local", ("local",), npartitions)
            self._runs[token] = run
            return run

    def context_for(self, run: RunInfo) -> WorkerContext:
        """The process's one context."""
        return self.context

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
