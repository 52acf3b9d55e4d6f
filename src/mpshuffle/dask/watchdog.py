"""The scheduler's watch over the ranks of running shuffles: a rank that stops answering.

A rank whose process is stopped (SIGSTOP, a debugger, a swapped-out host)
or whose event loop is stuck stays in the cluster until Dask's
``worker-ttl`` (5 minutes by default) removes it. Meanwhile the tasks it
runs never finish, and a shuffle whose only pending work is on that rank
(its insert, the barrier task, its extracts) would wait as long, past the
shuffle's ``timeout``: no other rank has anything to time out on.

Workers heartbeat to the scheduler every ``heartbeat_interval`` (0.5 s up to
10 workers, more on larger clusters). :class:`RankWatch` looks, twice a
second, at the workers of every generation with a running shuffle: a worker
silent for longer than the generation's ``timeout`` (and at least three
heartbeat intervals, so that a slow heartbeat on a large cluster is not taken
for a stopped rank) has stopped answering. Each of its runs then fails:

* with an error naming the phase (that of the rank's pending task of the
  run, else where the run stands), the rank and the worker, and how long it
  was silent;
* on the healthy ranks at once (``mpshuffle_fail_run``), whose waits end;
* on the scheduler, where the run's tasks still processing on the silent
  worker, and those on healthy workers that wait to fetch a result only the
  silent worker holds (the barrier an insert's, an extract the barrier's),
  are marked erred with that error, so the client gets it within
  ``timeout`` plus about a second;
* and the generation is retired, so the next shuffle bootstraps a new one.

Dask's own ``worker-ttl`` still decides whether the worker is removed; when it
comes back its late results are ignored.

The same look ends runs whose graph the scheduler released before they
ended (:meth:`ShuffleSchedulerPlugin.end_orphans`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from distributed.protocol.pickle import dumps

from mpshuffle.errors import ShuffleTimeoutError

if TYPE_CHECKING:
    from mpshuffle.dask.scheduler import ShuffleSchedulerPlugin, _Run

__all__ = ["RankWatch"]

logger = logging.getLogger(__name__)

# Seconds between looks.
INTERVAL = 0.5

# Heartbeats a worker may miss before it counts as silent, whatever the timeout.
MISSED_HEARTBEATS = 3


class RankWatch:
    """Fails the runs of any rank whose worker stopped heartbeating (see the module docstring).

    Parameters
    ----------
    plugin
        The scheduler plugin whose runs are watched.
    interval
        Seconds between looks.
    """

    def __init__(self, plugin: ShuffleSchedulerPlugin, interval: float = INTERVAL) -> None:
        self.plugin = plugin
        self.interval = interval
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start looking (on the scheduler's event loop)."""
        if self._task is None:
            self._task = asyncio.ensure_future(self._watch())

    def stop(self) -> None:
        """Stop looking. Idempotent."""
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                self.check()
            except Exception:  # the watch must outlive any one bad look
                logger.exception("mpshuffle: checking the ranks of running shuffles failed")
            try:
                if self.plugin.scheduler is not None and self.plugin.runs:
                    from distributed.metrics import time as scheduler_time

                    self.plugin.end_orphans(scheduler_time())
            except Exception:
                logger.exception("mpshuffle: ending the runs of released graphs failed")

    def check(self, now: float | None = None) -> list[str]:
        """Fail every running shuffle that has a silent rank; returns the errors raised.

        Parameters
        ----------
        now
            The scheduler's clock (``distributed.metrics.time``); by default now.
        """
        from distributed.metrics import time as scheduler_time
        from distributed.scheduler import heartbeat_interval

        scheduler = self.plugin.scheduler
        if scheduler is None or not self.plugin.runs:
            return []
        now = scheduler_time() if now is None else now
        beat = heartbeat_interval(len(scheduler.workers))
        errors = []
        for run in list(self.plugin.runs.values()):
            if run.error is not None:
                continue
            gen = run.generation
            limit = max(run.timeout, MISSED_HEARTBEATS * beat)
            for rank, address in enumerate(gen.workers):
                ws = scheduler.workers.get(address)
                if ws is None:
                    continue  # left the cluster: remove_worker restarts the run
                silent = now - ws.last_seen
                if silent > limit:
                    errors.append(self._fail(run, rank, address, silent, run.timeout))
                    break
        return errors

    def _fail(self, run: _Run, rank: int, address: str, silent: float, timeout: float) -> str:
        plugin = self.plugin
        scheduler = plugin.scheduler
        assert scheduler is not None
        tasks = scheduler.tasks
        keys = [*run.insert_keys, run.barrier_key, *run.extract_keys]
        pending = [k for k in keys if k in tasks and _processing_on(tasks[k]) == address]
        # Tasks of the run placed on healthy workers that need a result only
        # the silent worker holds (an insert's, for the barrier; the
        # barrier's, for an extract) wait in Dask's fetch of it, which has no
        # deadline of ours (30 s to connect; none on a pooled connection), and
        # never start: nothing of the run would end them.
        stuck = {k: w for k in keys if k in tasks and (w := _fetching_from(tasks[k], address)) is not None}
        gen = run.generation
        error = (
            f"{_phase(run, pending, tasks)} phase: rank {rank} (worker {address}) of generation {gen.id} "
            f"stopped answering: no heartbeat for {silent:.1f} s, past the shuffle's timeout of "
            f"{timeout:g} s (shuffle op {run.op_id})"
        )
        logger.warning("mpshuffle: %s", error)
        run.error = error
        run.ended.set()  # no restart will come: tasks asking for a verdict get it now
        gen.stale = True
        if plugin.generation is gen:
            plugin.generation = None
        plugin._broadcast(gen, {"op": "mpshuffle_fail_run", "op_id": run.op_id, "token": run.token, "reason": error})
        exception = dumps(ShuffleTimeoutError(error, missing=(rank,)))
        stimulus_id = f"mpshuffle-silent-rank-{run.op_id}-{time.time()}"
        erring = {**dict.fromkeys(pending, address), **stuck}
        by_worker: dict[str, list[Any]] = {}
        for key, worker in erring.items():
            by_worker.setdefault(worker, []).append(key)
        if by_worker:
            # The workers still hold these tasks: tell them to drop them first
            # (as the scheduler does when it releases a processing task), so
            # that the silent one, once it answers again, cancels them before
            # it hears that their inputs were released; otherwise its state
            # machine refuses to drop the inputs of a task it is executing.
            scheduler.send_all({}, {
                worker: [{"op": "free-keys", "keys": ks, "stimulus_id": stimulus_id}]
                for worker, ks in by_worker.items()
            })
        for key, worker in erring.items():
            ts = tasks.get(key)
            if ts is None or ts.state != "processing":
                continue
            scheduler.handle_task_erred(
                key=key, worker=worker, run_id=ts.run_id, stimulus_id=stimulus_id,
                exception=exception, traceback=None, exception_text=error, traceback_text="",
            )
        return error


def _processing_on(ts: Any) -> str | None:
    """The address of the worker running task ``ts``, or ``None`` if it is not running."""
    ws = ts.processing_on if ts.state == "processing" else None
    return None if ws is None else str(ws.address)


def _fetching_from(ts: Any, address: str) -> str | None:
    """The worker running ``ts`` if it is another than ``address`` and needs a result only ``address`` holds."""
    where = _processing_on(ts)
    if where is None or where == address:
        return None
    for dts in ts.dependencies:
        holders = dts.who_has or ()
        if holders and all(str(ws.address) == address for ws in holders):
            return where
    return None


def _phase(run: _Run, pending: list[Any], tasks: Any) -> str:
    """The phase the silent rank holds up: that of its own pending task, else where the run stands."""
    if pending:
        key = pending[0]
        if key == run.barrier_key:
            return "barrier"
        return "extract" if key in run.extract_keys else "insert"
    barrier = tasks.get(run.barrier_key)
    if barrier is None or barrier.state in ("released", "waiting", "queued", "no-worker"):
        return "insert"
    return "barrier" if barrier.state == "processing" else "extract"
