"""The scheduler plugin: generations, runs, pinning, restarts and cleanup.

It is the one owner of the cluster-wide state of mpshuffle:

* the *generations*: the current one (worker set, ids, the root's address),
  which it bootstraps by one call to every worker's ``mpshuffle_bootstrap``
  handler (rank 0 publishes its address through this plugin's
  ``mpshuffle_publish_root`` handler, the others wait for it through
  ``mpshuffle_get_root``), and older ones that still carry running shuffles.
  A generation is replaced when the workers change; the old one is closed
  on its workers (threads, sockets, buffers) once its last run ended, so a
  worker that joins during a shuffle never disturbs it;
* the *runs*: the first task of a shuffle graph to execute asks
  ``mpshuffle_get_run`` with the graph's options (resolved on the client
  where the graph was built; this plugin never reads the scheduler's own
  ``dask.config`` for them), which binds the graph's token to the current
  generation under a fresh ``op_id`` (a new generation if the graph's
  generation options differ from the current one's), restricts the graph's insert and
  barrier tasks to the generation's workers and pins every extract task to
  the worker of the rank owning its output partition, with
  :meth:`distributed.Scheduler.set_restrictions` (Dask's DataFrame
  collections ignore annotations, so restrictions are set here, as Dask's
  own P2P shuffle does); the run's extract tasks get Dask's priorities
  among them again in partition order, so each rank extracts in that order
  and frees its received chunks (ranges of partitions) as it goes;
* restarts: when a worker of a run's generation leaves, the run is failed on
  the other ranks and its tasks are released, so that Dask computes the
  shuffle again on a new generation of the remaining workers (as Dask's P2P
  shuffle restarts). A task that saw the peer go asks
  ``mpshuffle_run_lost`` and is rescheduled once the restart happened, or
  fails with an error naming the phase and the lost worker if the scheduler
  still counts that worker as alive after the run's ``timeout``;
* cleanup: when the graph's barrier task is released, forgotten or errs,
  every rank frees the run;
* placement of a cluster's first shuffle: as it starts, the plugin gives the
  scheduler an estimate of an insert's and an extract's duration
  (:data:`TASK_DURATIONS`) until the scheduler has timed one, so the first
  graph's inserts run where their inputs are, as later graphs' do.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import secrets
import time
import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from distributed.diagnostics.plugin import SchedulerPlugin

from mpshuffle.dask.messages import (
    BootstrapSpec,
    Generation,
    Joined,
    Restarted,
    RunBinding,
    Verdict,
)
from mpshuffle.dask.watchdog import RankWatch
from mpshuffle.errors import BootstrapError, OptionError
from mpshuffle.options import Options
from mpshuffle.table import partition_owner

if TYPE_CHECKING:
    from collections.abc import Collection

    from dask.typing import Key
    from distributed import Scheduler
    from distributed.scheduler import TaskStateState

__all__ = ["ShuffleSchedulerPlugin"]

logger = logging.getLogger(__name__)

# Seconds the scheduler waits for a worker's bootstrap answer past the
# generation's own bootstrap_timeout, so that the workers' errors (which name
# the missing ranks) arrive before the scheduler gives up on them.
_BOOTSTRAP_GRACE = 5.0

# Seconds between looks at the workers' heartbeats while a task waits for
# the verdict on a lost peer.
_VERDICT_POLL = 0.25

# How many ended runs the plugin remembers for late questions of their tasks.
_ENDED_RUNS = 1024

#: Seconds the scheduler assumes a task of each of mpshuffle's key prefixes
#: takes until it has timed one (its ``default-task-durations``; a user's
#: entry for the same prefix wins). Without an entry the scheduler assumes
#: ``unknown-task-duration`` (500 ms), so at a cluster's first shuffle, when
#: it places every insert at once, each insert looked five times longer than
#: it is (~0.1 s for 60 MB), the worker holding more inputs looked busy, and
#: inserts went to the other worker with their input partition. Lineitem SF 1
#: on 2 workers, persisted, a fresh cluster's first config-line shuffle: 4 of
#: 8 moved 1-2 of the 16 partitions (0.18 s of transfer each), none of 7 with
#: these estimates (session 20, ``benchmarks/results/README.md``).
TASK_DURATIONS = {
    "mpshuffle-insert": 0.1,
    "mpshuffle-extract": 0.1,
    "mpshuffle-rechunk-insert": 0.1,
    "mpshuffle-rechunk-extract": 0.1,
}


def _estimate_task_durations(scheduler: Scheduler) -> None:
    """Give the scheduler :data:`TASK_DURATIONS` for prefixes it has not timed and the user did not set."""
    import dask
    from distributed.scheduler import TaskPrefix

    configured = dask.config.get("distributed.scheduler.default-task-durations", None) or {}
    for name, seconds in TASK_DURATIONS.items():
        if name in configured:
            continue  # TaskPrefix reads the user's own estimate
        prefix = scheduler.task_prefixes.get(name)
        if prefix is None:
            scheduler.task_prefixes[name] = prefix = TaskPrefix(name)
        if prefix.duration_average < 0 and prefix.max_exec_time < 0:  # nothing timed yet
            prefix.duration_average = seconds


@dataclasses.dataclass(eq=False)
class _Generation:
    id: str
    workers: tuple[str, ...]
    token: str
    options: Options
    stale: bool = False
    runs: set[int] = dataclasses.field(default_factory=set)

    def describe(self, bootstrapped: bool) -> dict[str, Any]:
        """The :class:`Generation` message of this generation."""
        ranks = {w: r for r, w in enumerate(self.workers)}
        return Generation(self.id, len(self.workers), ranks, bootstrapped).to_msg()


@dataclasses.dataclass(eq=False)
class _Run:
    token: str
    op_id: int
    generation: _Generation
    npartitions: int
    insert_keys: list[Any]
    extract_keys: list[Any]
    barrier_key: str
    timeout: float = Options.timeout
    error: str | None = None
    restarted: bool = False
    ended: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    # Since when (scheduler clock) the scheduler has not held the run's barrier task, or None.
    orphaned_since: float | None = None


def _failure(task: asyncio.Future[Any]) -> str | None:
    """The error of a finished ``mpshuffle_bootstrap`` call: its exception, or the error its answer names; else ``None``."""
    if task.cancelled():
        return "cancelled"
    e = task.exception()
    if e is not None:
        return f"{type(e).__name__}: {e}"
    error: str | None = task.result().error
    return error


class ShuffleSchedulerPlugin(SchedulerPlugin):
    """mpshuffle's state on the scheduler (see the module docstring).

    Registered by :func:`mpshuffle.dask.bootstrap_dask_cluster`; idempotent,
    so registering it again keeps the running instance.

    Attributes
    ----------
    generation
        The current generation, or ``None`` before the first bootstrap and
        after a worker of it left.
    generations
        Every generation that is open on its workers, by id (the current one
        and older ones that still carry runs).
    runs
        Active runs by graph token.
    bootstraps
        Number of generations bootstrapped by this plugin.
    """

    idempotent = True
    name = "mpshuffle"

    def __init__(self) -> None:
        self.scheduler: Scheduler | None = None
        self.generation: _Generation | None = None
        self.generations: dict[str, _Generation] = {}
        self.runs: dict[str, _Run] = {}
        self._by_op: collections.OrderedDict[int, _Run] = collections.OrderedDict()
        self._barrier_keys: dict[str, str] = {}
        self._ops = itertools.count(1)
        self._roots: dict[str, str] = {}
        self._root_events: dict[str, asyncio.Event] = {}
        # A bootstrap's first failure, by generation, while it runs: waiters
        # for its root hear of it at once (see _call_each).
        self._failures: dict[str, str] = {}
        self._lock: asyncio.Lock | None = None
        self.bootstraps = 0

    async def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._lock = asyncio.Lock()
        _estimate_task_durations(scheduler)
        # A rank that stops answering fails its runs within their timeout.
        self._watch = RankWatch(self)
        self._watch.start()
        scheduler.handlers["mpshuffle_publish_root"] = self.publish_root
        scheduler.handlers["mpshuffle_get_root"] = self.get_root
        scheduler.handlers["mpshuffle_get_run"] = self.get_run
        scheduler.handlers["mpshuffle_run_lost"] = self.run_lost
        scheduler.handlers["mpshuffle_link_lost"] = self.link_lost
        scheduler.handlers["mpshuffle_restart_run"] = self.restart_run

    async def close(self) -> None:
        watch = getattr(self, "_watch", None)
        if watch is not None:
            watch.stop()
        if self.scheduler is not None:
            for name in (
                "mpshuffle_publish_root", "mpshuffle_get_root", "mpshuffle_get_run",
                "mpshuffle_restart_run", "mpshuffle_run_lost", "mpshuffle_link_lost",
            ):
                self.scheduler.handlers.pop(name, None)

    # -- generations -----------------------------------------------------
    async def ensure_generation(self, options: dict[str, Any]) -> dict[str, Any]:
        """Bootstrap a generation on the current workers unless the current one matches.

        Calls are serialized (an :class:`asyncio.Lock`), so clients that
        bootstrap at the same moment end with one generation.

        Parameters
        ----------
        options
            :class:`~mpshuffle.options.Options` as a dict, resolved on the
            client. The current generation matches if it has the same
            workers and the same generation options
            (:meth:`~mpshuffle.options.Options.generation_options`).

        Returns
        -------
        dict
            A :class:`Generation` message (id, nranks, ranks by worker, bootstrapped).

        Raises
        ------
        BootstrapError
            If there are no workers, or some worker failed or did not answer
            within the bootstrap timeout; names those ranks and workers.
        """
        assert self.scheduler is not None and self._lock is not None
        async with self._lock:
            return await self._ensure_generation(options)

    async def _ensure_generation(self, options: dict[str, Any]) -> dict[str, Any]:
        assert self.scheduler is not None
        workers = tuple(sorted(self.scheduler.workers))
        if not workers:
            raise BootstrapError("cannot bootstrap mpshuffle: the cluster has no workers")
        gen = self.generation
        try:
            opts = Options(**options)  # checked on the client already; a message may be anything
        except (OptionError, TypeError) as e:
            raise BootstrapError(f"options of the graph: {e}") from None
        if (
            gen is not None and not gen.stale and gen.workers == workers
            and gen.options.generation_options() == opts.generation_options()
        ):
            return gen.describe(bootstrapped=False)
        new = _Generation(id=uuid.uuid4().hex[:12], workers=workers, token=secrets.token_hex(16), options=opts)
        self._root_events[new.id] = asyncio.Event()
        spec = BootstrapSpec(new.id, workers, new.token, dataclasses.asdict(opts))
        # Registered before the workers hear of it: a failed bootstrap is
        # closed on them like any other generation.
        self.generations[new.id] = new
        try:
            results = await self._call_each(workers, spec, opts.bootstrap_timeout)
        finally:
            self._root_events.pop(new.id, None)
            self._roots.pop(new.id, None)
            self._failures.pop(new.id, None)
        failed = {w: r for w, r in results.items() if isinstance(r, str)}
        if failed:
            new.stale = True
            self._maybe_close(new)
            detail = "; ".join(f"rank {workers.index(w)} (worker {w}): {e}" for w, e in sorted(failed.items()))
            raise BootstrapError(f"bootstrap of generation {new.id} on {len(workers)} workers failed: {detail}")
        old, self.generation = self.generation, new
        if old is not None:
            old.stale = True
            self._maybe_close(old)
        self.bootstraps += 1
        logger.info("mpshuffle: generation %s bootstrapped on %d workers", new.id, len(workers))
        return new.describe(bootstrapped=True)

    async def _call_each(
        self, workers: tuple[str, ...], spec: BootstrapSpec, bootstrap_timeout: float
    ) -> dict[str, Joined | str]:
        """Call ``mpshuffle_bootstrap`` on every worker: per worker its answer, or an error text.

        A worker that answers ``None`` has no ``mpshuffle_bootstrap`` handler
        (Dask answers ``None`` for an unknown operation): its worker plugin is
        not set up yet. That happens when two registrations cross: the
        scheduler takes an idempotent plugin it already holds as done at once,
        while the first registration's broadcast is still setting it up on the
        workers (a client's preload registers the plugins as it starts, and the
        first shuffle registers them again). Such a worker is asked again until
        ``bootstrap_timeout``; then its error names the missing plugin.
        """
        assert self.scheduler is not None
        scheduler = self.scheduler
        loop = asyncio.get_running_loop()
        deadline = loop.time() + bootstrap_timeout

        async def one(address: str) -> Joined:
            delay = 0.01
            while True:
                msg = await scheduler.rpc(address).mpshuffle_bootstrap(spec=spec.to_msg())
                if msg is not None:
                    return Joined.from_msg(msg)
                if loop.time() + delay > deadline:
                    raise BootstrapError(
                        f"the worker has no mpshuffle_bootstrap handler after {bootstrap_timeout:g} s: mpshuffle's "
                        "worker plugin is not set up there (is mpshuffle installed in the worker's environment?)"
                    )
                await asyncio.sleep(delay)
                delay = min(2 * delay, 0.25)

        tasks = {w: asyncio.ensure_future(one(w)) for w in workers}
        timeout = bootstrap_timeout + _BOOTSTRAP_GRACE
        end = loop.time() + timeout
        pending = set(tasks.values())
        while pending and loop.time() < end:
            done, pending = await asyncio.wait(pending, timeout=end - loop.time(), return_when=asyncio.FIRST_COMPLETED)
            failed = [(w, e) for w, t in tasks.items() if t in done and (e := _failure(t)) is not None]
            if failed and spec.generation not in self._failures:
                # The others would wait for this rank until their timeout: a
                # rank 0 that could not listen made rank 1 wait 30 s for its
                # address, and the next bootstrap waited behind that one.
                w, error = failed[0]
                reason = f"rank {workers.index(w)} (worker {w}) failed: {error}"
                self._failures[spec.generation] = reason
                event = self._root_events.get(spec.generation)
                if event is not None:
                    event.set()
                for other, t in tasks.items():
                    if not t.done():
                        asyncio.ensure_future(self._abort(other, spec.generation, reason))
        results: dict[str, Joined | str] = {}
        for w, t in tasks.items():
            if not t.done():
                t.cancel()
                results[w] = f"TimeoutError: did not finish bootstrapping within {timeout:g} s"
            else:  # the call's own failure (the worker went away), the error it answered, or its answer
                failure = _failure(t)
                results[w] = failure if failure is not None else t.result()
        return results

    async def _abort(self, address: str, generation: str, reason: str) -> None:
        """Tell a worker still joining ``generation`` to give up (``mpshuffle_abort_bootstrap``); best effort."""
        assert self.scheduler is not None
        try:
            await self.scheduler.rpc(address).mpshuffle_abort_bootstrap(generation=generation, reason=reason)
        except Exception as e:  # noqa: BLE001 -- the worker's own timeout still ends its join
            logger.debug("mpshuffle: could not abort the bootstrap on %s: %r", address, e)

    def _maybe_close(self, gen: _Generation) -> None:
        """Close a replaced or failed generation on its workers once no run uses it."""
        if gen is self.generation or gen.runs or gen.id not in self.generations:
            return
        del self.generations[gen.id]
        self._broadcast(gen, {"op": "mpshuffle_close_generation", "generation": gen.id})

    def end_orphans(self, now: float) -> list[int]:
        """End the runs whose graph the scheduler has not held for longer than their ``timeout``; returns their ids.

        A run is made by the first task of its graph that asks. A task that
        still started after its client released the graph (Dask cannot stop a
        task already handed to a worker; e.g. an insert queued on a worker
        when the computation failed) makes a run whose barrier task the
        scheduler no longer holds, so no transition of it will ever end the
        run: its pieces would stay on every rank. Such a run is kept for a
        ``timeout`` (the graph may be submitted again, as after a cancelled
        computation, and then adopts it: see :meth:`update_graph`), then
        ended on every rank. Called by the :class:`RankWatch` twice a second.

        Parameters
        ----------
        now
            The scheduler's clock (``distributed.metrics.time``).
        """
        assert self.scheduler is not None
        ended = []
        for run in list(self.runs.values()):
            if run.barrier_key in self.scheduler.tasks:
                run.orphaned_since = None
                continue
            if run.orphaned_since is None:
                run.orphaned_since = now
            elif now - run.orphaned_since > run.timeout:
                logger.info(
                    "mpshuffle: ending shuffle op %d: its graph was released %.1f s ago", run.op_id,
                    now - run.orphaned_since,
                )
                self._end_run(run)
                ended.append(run.op_id)
        return ended

    async def publish_root(self, generation: str, address: str) -> None:
        """Handler: rank 0 of ``generation`` publishes its address."""
        self._roots[generation] = address
        event = self._root_events.get(generation)
        if event is not None:
            event.set()

    async def get_root(self, generation: str, timeout: float) -> str:
        """Handler: wait (up to ``timeout`` s) for the root address of ``generation``."""
        event = self._root_events.get(generation)
        gen = self.generations.get(generation)
        if event is None or gen is None:
            raise BootstrapError(f"generation {generation} is not being bootstrapped")
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            raise BootstrapError(
                f"rank 0 (worker {gen.workers[0]}) of generation {generation} did not publish "
                f"its address within {timeout:g} s"
            ) from None
        if generation not in self._roots:
            raise BootstrapError(f"bootstrap of generation {generation} stopped: {self._failures.get(generation)}")
        return self._roots[generation]

    # -- runs ------------------------------------------------------------
    async def get_run(
        self, token: str, npartitions: int, extract_name: str, barrier_name: str, options: dict[str, Any]
    ) -> dict[str, Any]:
        """Handler: the run of graph ``token`` (a :class:`RunBinding` message), created (and pinned) on first call.

        ``options`` are the graph's (:class:`~mpshuffle.options.Options` as a
        dict, resolved on the client where the graph was built). Binds the
        graph to the current generation (bootstrapping a new one if the
        workers changed or the graph's generation options differ) under a
        fresh ``op_id``, with the graph's ``timeout``; restricts the graph's
        pending insert and barrier tasks to the generation's workers and pins
        each extract task to the worker owning its output partition.
        """
        assert self.scheduler is not None and self._lock is not None
        async with self._lock:
            run = self.runs.get(token)
            if run is not None:
                if run.error:
                    return RunBinding(-1, "", (), error=run.error).to_msg()
                return self._describe(run)
            try:
                await self._ensure_generation(options)
            except BootstrapError as e:
                return RunBinding(-1, "", (), error=f"bootstrap phase: {e}").to_msg()
            gen = self.generation
            assert gen is not None
            tasks = self.scheduler.tasks
            barrier_ts = tasks.get(barrier_name)
            insert_keys = [dts.key for dts in barrier_ts.dependencies] if barrier_ts is not None else []
            keys = [(_extract_name(barrier_ts, extract_name), j) for j in range(npartitions)]
            run = _Run(
                token, next(self._ops), gen, npartitions, insert_keys, keys, barrier_name,
                timeout=Options(**options).timeout,
            )
            self.runs[token] = run
            self._by_op[run.op_id] = run
            while len(self._by_op) > _ENDED_RUNS:
                self._by_op.popitem(last=False)
            gen.runs.add(run.op_id)
            self._barrier_keys[barrier_name] = token
            # Tasks that have not started yet run only on ranks of the generation;
            # one that already started on another worker is rescheduled by the task itself.
            self.scheduler.set_restrictions(_pins(
                run, tasks.__contains__,
                lambda key: key in tasks and tasks[key].state in ("released", "waiting", "no-worker"),
            ))
            _order_extracts(run, tasks)
            return self._describe(run)

    @staticmethod
    def _describe(run: _Run) -> dict[str, Any]:
        return RunBinding(run.op_id, run.generation.id, run.generation.workers).to_msg()

    async def run_lost(
        self, op_id: int, timeout: float, rank: int = -1, lost: list[Any] | None = None
    ) -> dict[str, Any]:
        """Handler: a task of run ``op_id`` saw a peer go; wait for the scheduler's verdict.

        Returns a :class:`Verdict` message: ``restart`` once the run was
        restarted (the task should be rescheduled), or not, with the run's
        workers still ``alive``, if the run was not restarted within ``timeout`` seconds (the lost ranks'
        workers are still in the cluster, so only their communicators broke).
        Then the run fails on every rank and its generation is retired, so
        that the next shuffle bootstraps a new one. ``rank`` is the asking
        rank and ``lost`` the ``[peer, reason]`` pairs its communicator
        lost, which the error names.
        """
        run = self._by_op.get(op_id)
        if run is None:
            return Verdict(restart=False).to_msg()
        await self._await_verdict(run, timeout)
        assert self.scheduler is not None
        alive = [w for w in run.generation.workers if w in self.scheduler.workers]
        if not run.restarted:
            gen = run.generation
            gen.stale = True
            if self.generation is gen:
                self.generation = None
            if run.error is None:
                if lost and 0 <= rank < len(gen.workers):
                    run.error = f"shuffle op {run.op_id}: " + _link_error(gen, rank, int(lost[0][0]), str(lost[0][1]))
                else:
                    run.error = f"shuffle op {run.op_id}: a rank of generation {gen.id} lost its communicator"
                # No restart will come: later questions get the verdict at once.
                run.ended.set()
                self._broadcast(
                    gen, {"op": "mpshuffle_fail_run", "op_id": run.op_id, "token": run.token, "reason": run.error}
                )
        return Verdict(run.restarted, tuple(alive)).to_msg()

    async def link_lost(self, generation: str, rank: int, peer: int, reason: str, op_ids: list[int]) -> None:
        """Handler: rank ``rank`` of ``generation`` gave up its link to rank ``peer`` (a connection broke).

        The reporting rank has failed the runs ``op_ids`` that were active on
        it (it can no longer exchange with ``peer``); the other ranks may be
        waiting for it and would hear only after ``timeout``. The generation
        is retired at once (the next shuffle bootstraps a new one, whose
        connections are new). Each of those runs is failed on every rank with
        an error naming both ranks and their workers, once every worker of
        the generation has heartbeated since the report (so both workers
        stay and only the link broke); if instead a worker left, its
        departure restarts the run as before, and nothing more is done.
        """
        gen = self.generations.get(generation)
        if gen is None or not (0 <= rank < len(gen.workers) and 0 <= peer < len(gen.workers)):
            return  # closed already, or not a report of ours
        error = _link_error(gen, rank, peer, reason)
        logger.warning("mpshuffle: %s", error)
        gen.stale = True
        if self.generation is gen:
            self.generation = None
        runs = [r for op in op_ids if (r := self._by_op.get(op)) is not None and r.generation is gen]
        await asyncio.gather(*(self._fail_for_link(run, error) for run in runs))
        self._maybe_close(gen)

    async def _fail_for_link(self, run: _Run, error: str) -> None:
        await self._await_verdict(run, run.timeout)
        if run.restarted or run.error is not None or self.runs.get(run.token) is not run:
            return  # restarted, failed already, or ended
        run.error = f"shuffle op {run.op_id}: {error}"
        run.ended.set()  # no restart will come: tasks asking for a verdict get it now
        self._broadcast(
            run.generation, {"op": "mpshuffle_fail_run", "op_id": run.op_id, "token": run.token, "reason": run.error}
        )

    async def _await_verdict(self, run: _Run, timeout: float) -> None:
        """Wait until ``run`` was restarted or ended, or no restart can come, at most ``timeout`` s.

        A restart comes when a worker of the run's generation leaves (a dead
        process closes its connection to the scheduler at once). Once every
        worker of the generation has heartbeated since the question was
        asked, all are alive: the lost peer is a broken link, not a dead
        worker, and waiting longer only delays the error.
        """
        from distributed.metrics import time as scheduler_time

        assert self.scheduler is not None
        asked, loop = scheduler_time(), asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not run.ended.is_set():
            states = [self.scheduler.workers.get(w) for w in run.generation.workers]
            if all(ws is not None and ws.last_seen > asked for ws in states):
                return
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            try:
                await asyncio.wait_for(run.ended.wait(), min(remaining, _VERDICT_POLL))
            except TimeoutError:
                pass

    async def restart_run(self, op_id: int, reason: str) -> dict[str, Any]:
        """Handler: a task of run ``op_id`` cannot go on with that run; compute it again.

        The barrier found inserts of an older run: an insert task that was
        executing when its run restarted can finish with the old run's result
        and be taken as the result of its new execution (Dask resumes a
        released task that is still running), and its data went to the old
        run. Or an extract found its partition handed out already: its output
        was released or lost while the barrier's result stayed in memory.
        Either way the whole run is restarted.

        Returns a :class:`Restarted` message.
        """
        run = self._by_op.get(op_id)
        if run is None or run.error is not None or self.runs.get(run.token) is not run:
            return Restarted(False).to_msg()
        self._restart(run, f"shuffle op {op_id}: {reason}", f"mpshuffle-restart-{op_id}-{time.time()}")
        return Restarted(run.restarted).to_msg()

    def update_graph(self, scheduler: Scheduler, *, tasks: Any = (), **kwargs: Any) -> None:
        """Pin the tasks of live runs that entered the scheduler after their run was made.

        A run is created by its first task (``get_run``), which pins the
        graph's tasks present at that moment. An insert that kept running
        after its computation was cancelled can create the run before the
        same graph is submitted again; the new extract tasks would then run
        anywhere and reschedule themselves in a loop. Called by the scheduler
        before it places new tasks.
        """
        if not self.runs or not tasks:
            return
        touched = set(tasks)
        restrictions: dict[Any, Any] = {}
        for run in self.runs.values():
            if run.error is None:
                restrictions.update(_pins(run, touched.__contains__, touched.__contains__))
                if any(key in touched for key in run.extract_keys):
                    _order_extracts(run, scheduler.tasks)
        if restrictions:
            scheduler.set_restrictions(restrictions)

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        if finish not in ("released", "forgotten", "erred") or not isinstance(key, str):
            return
        token = self._barrier_keys.get(key)
        if token is None:
            return
        run = self.runs.get(token)
        if run is None or run.barrier_key != key:
            return
        self._end_run(run)

    def _forget(self, run: _Run) -> None:
        self.runs.pop(run.token, None)
        self._barrier_keys.pop(run.barrier_key, None)
        run.generation.runs.discard(run.op_id)
        run.ended.set()

    def _end_run(self, run: _Run) -> None:
        self._forget(run)
        self._unpin(run)
        self._broadcast(run.generation, {"op": "mpshuffle_end_run", "op_id": run.op_id, "token": run.token})
        self._maybe_close(run.generation)

    def _unpin(self, run: _Run) -> None:
        assert self.scheduler is not None
        tasks = self.scheduler.tasks
        present: dict[Key, Collection[str] | str | None] = {k: None for k in [*run.insert_keys, run.barrier_key, *run.extract_keys] if k in tasks}
        if present:
            self.scheduler.set_restrictions(present)

    def _restart(self, run: _Run, reason: str, stimulus_id: str) -> None:
        """Fail ``run`` on its ranks and release its tasks so that Dask computes it again."""
        assert self.scheduler is not None
        tasks = self.scheduler.tasks
        recs: dict[Key, TaskStateState] = {}
        barrier_ts = tasks.get(run.barrier_key)
        restartable = barrier_ts is not None and barrier_ts.state != "erred"
        if restartable:
            assert barrier_ts is not None
            for dts in barrier_ts.dependents:
                if dts.state == "erred":
                    restartable = False
                recs[dts.key] = "released"
            recs[barrier_ts.key] = "released"
            for dts in barrier_ts.dependencies:
                if dts.state == "erred":
                    restartable = False
                recs[dts.key] = "released"
        run.error = reason
        run.restarted = restartable
        self._forget(run)
        self._unpin(run)
        self._broadcast(
            run.generation, {"op": "mpshuffle_fail_run", "op_id": run.op_id, "token": run.token, "reason": reason}
        )
        if restartable:
            logger.warning("mpshuffle: restarting shuffle op %d: %s", run.op_id, reason)
            self.scheduler.transitions(recs, stimulus_id=stimulus_id)
            self.scheduler.stimulus_queue_slots_maybe_opened(stimulus_id=stimulus_id)
        self._maybe_close(run.generation)

    def _broadcast(self, gen: _Generation, msg: dict[str, Any]) -> None:
        assert self.scheduler is not None
        if self.scheduler.status.name in ("closing", "closed", "closing_gracefully", "failed"):
            return  # the workers are going away with their contexts
        workers = [w for w in gen.workers if w in self.scheduler.workers]
        for address in workers:
            asyncio.ensure_future(self._tell(address, msg))

    async def _tell(self, address: str, msg: dict[str, Any]) -> None:
        # Fire and forget: a worker that is closing frees its runs itself, so a
        # failed message is not an error (Scheduler.broadcast would log one).
        assert self.scheduler is not None
        msg = dict(msg)
        op = msg.pop("op")
        try:
            await getattr(self.scheduler.rpc(address), op)(**msg)
        except Exception as e:  # noqa: BLE001 - any comm failure means the worker is going away
            logger.debug("mpshuffle: %s to %s not delivered: %s", op, address, e)

    # -- membership ------------------------------------------------------
    def add_worker(self, scheduler: Scheduler, worker: str) -> None:
        # The next run bootstraps a new generation (the worker set no longer
        # matches); running shuffles keep theirs until they end.
        logger.debug("mpshuffle: worker %s joined; the next shuffle bootstraps a new generation", worker)

    def remove_worker(self, scheduler: Scheduler, worker: str, **kwargs: Any) -> None:
        stimulus_id = kwargs.get("stimulus_id") or f"mpshuffle-remove-worker-{time.time()}"
        for gen in list(self.generations.values()):
            if worker not in gen.workers:
                continue
            gen.stale = True
            rank = gen.workers.index(worker)
            reason = f"worker {worker} (rank {rank} of generation {gen.id}) left the cluster"
            for run in [r for r in self.runs.values() if r.generation is gen]:
                self._restart(run, f"shuffle op {run.op_id}: {reason}", stimulus_id)
            if self.generation is gen:
                self.generation = None
            self._maybe_close(gen)


def _link_error(gen: _Generation, rank: int, peer: int, reason: str) -> str:
    """How errors name a broken link: the rank that saw it, the rank it can no longer reach, their workers."""
    return (
        f"rank {rank} (worker {gen.workers[rank]}) of generation {gen.id} can no longer reach "
        f"rank {peer} (worker {gen.workers[peer]}): {reason}"
    )


def _extract_name(barrier_ts: Any, default: str) -> str:
    """The key name of the extract tasks that depend on ``barrier_ts``, else ``default`` (the graph's spec's).

    The graph is the truth: Dask names a shuffle's output partitions (the
    extracts) after the shuffle expression, whose name follows its input's
    (an insert fused into its input's task changes it), while the spec that
    every task carries is built from the inserts alone.
    """
    if barrier_ts is not None:
        for dts in barrier_ts.dependents:
            if isinstance(dts.key, tuple) and len(dts.key) == 2:
                return str(dts.key[0])
    return default


def _order_extracts(run: _Run, tasks: Mapping[Any, Any]) -> None:
    """Give ``run``'s pending extract tasks their priorities again, in partition order.

    Dask's priorities (``dask.order``) for the extract tasks, siblings of one
    barrier, come out in no particular partition order; a rank's postbox
    frees a received chunk once every partition it holds was extracted, and
    the senders cut each destination's chunks into ranges of neighbouring
    partitions (:data:`mpshuffle.shuffler.host.RELEASE_GROUPS`), so extracts
    in partition order give memory back as they go instead of at the end.
    The extracts keep the same priority values between them (so they stand
    where Dask placed them among other tasks); only which extract gets which
    changes. Extracts that already run or ran are left as they are.

    Each pending dependent of a reordered extract (the task that consumes an
    output partition) then comes right after its last extract of the run,
    where Dask's depth-first order had put it: ``dask.order`` places each
    consumer after its own extract, so once the extracts trade priorities a
    consumer could stand behind many extracts, and a worker ran up to ~25
    extracts ahead of their consumers (~1 GB of 40 MiB output partitions held
    on a 1.5 GiB worker, above P2P's peak). A dependent is only moved
    earlier, never later, so a priority Dask or the user made more urgent stays.
    """
    pending = [
        ts for ts in (tasks.get(key) for key in run.extract_keys)
        if ts is not None and ts.priority is not None and ts.state in ("released", "waiting", "no-worker")
    ]
    for ts, priority in zip(pending, sorted(ts.priority for ts in pending), strict=True):
        ts.priority = priority
    after: dict[Any, tuple[Any, tuple[Any, ...]]] = {}
    for ts in pending:
        for dts in ts.dependents:
            if dts.priority is None or dts.state not in ("released", "waiting", "no-worker"):
                continue
            # Just after the extract: Dask's priorities end in an int (dask.order's), and a
            # half places the dependent between this extract and the next task.
            follow = (*ts.priority[:-1], ts.priority[-1] + 0.5)
            key = dts.key
            if key not in after or follow > after[key][1]:
                after[key] = (dts, follow)
    for dts, follow in after.values():
        dts.priority = min(dts.priority, follow)


def _pins(
    run: _Run, extract_wanted: Callable[[Any], bool], other_wanted: Callable[[Any], bool]
) -> dict[Any, Any]:
    """Restrictions of ``run``'s tasks: each wanted extract task to the worker
    owning its output partition (``partition_owner``), wanted insert and
    barrier tasks to the generation's workers."""
    workers = run.generation.workers
    pins: dict[Any, Any] = {
        key: workers[partition_owner(j, len(workers))]
        for j, key in enumerate(run.extract_keys) if extract_wanted(key)
    }
    for key in [*run.insert_keys, run.barrier_key]:
        if other_wanted(key):
            pins[key] = set(workers)
    return pins
