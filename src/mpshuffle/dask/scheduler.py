"""The scheduler plugin: generations, runs, pinning and cleanup.

It is the one owner of the cluster-wide state of mpshuffle:

* the current *generation* (worker set, ids, the root's address), which it
  bootstraps by one broadcast to every worker's ``mpshuffle_bootstrap``
  handler; rank 0 publishes its address through this plugin's
  ``mpshuffle_publish_root`` handler and the others wait for it through
  ``mpshuffle_get_root``;
* the *runs*: the first task of a shuffle graph to execute asks
  ``mpshuffle_get_run``, which binds the graph's token to the current
  generation under a fresh ``op_id`` and pins every extract task to the
  worker of the rank owning its output partition with
  :meth:`distributed.Scheduler.set_restrictions` (Dask's DataFrame
  collections ignore annotations, so restrictions are set here, as Dask's
  own P2P shuffle does);
* cleanup: when the graph's barrier task is released, forgotten or errs,
  every rank frees the run; when a worker of the generation leaves, its
  runs fail on every rank and their pinned tasks are unpinned, so nothing
  waits for a worker that is gone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import secrets
import uuid
from typing import TYPE_CHECKING, Any

from distributed.diagnostics.plugin import SchedulerPlugin

from mpshuffle.config import Options, resolve_options
from mpshuffle.errors import BootstrapError
from mpshuffle.table import partition_owner

if TYPE_CHECKING:
    from distributed import Scheduler

__all__ = ["ShuffleSchedulerPlugin"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Generation:
    id: str
    workers: tuple[str, ...]
    token: str
    options: Options
    stale: bool = False

    def describe(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "nranks": len(self.workers),
            "ranks": {w: r for r, w in enumerate(self.workers)},
        }


@dataclasses.dataclass
class _Run:
    token: str
    op_id: int
    generation: _Generation
    npartitions: int
    extract_keys: list[Any]
    barrier_key: str
    error: str | None = None


class ShuffleSchedulerPlugin(SchedulerPlugin):
    """mpshuffle's state on the scheduler (see the module docstring).

    Registered by :func:`mpshuffle.dask.bootstrap_dask_cluster`; idempotent,
    so registering it again keeps the running instance.
    """

    idempotent = True
    name = "mpshuffle"

    def __init__(self) -> None:
        self.scheduler: Scheduler | None = None
        self.generation: _Generation | None = None
        self.runs: dict[str, _Run] = {}
        self._barrier_keys: dict[str, str] = {}
        self._ops = itertools.count(1)
        self._roots: dict[str, str] = {}
        self._root_events: dict[str, asyncio.Event] = {}
        self._lock: asyncio.Lock | None = None
        self.bootstraps = 0

    async def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._lock = asyncio.Lock()
        scheduler.handlers["mpshuffle_publish_root"] = self.publish_root
        scheduler.handlers["mpshuffle_get_root"] = self.get_root
        scheduler.handlers["mpshuffle_get_run"] = self.get_run

    async def close(self) -> None:
        if self.scheduler is not None:
            for name in ("mpshuffle_publish_root", "mpshuffle_get_root", "mpshuffle_get_run"):
                self.scheduler.handlers.pop(name, None)

    # -- generations -----------------------------------------------------
    async def ensure_generation(self, options: dict[str, Any] | None = None) -> dict[str, Any]:
        """Bootstrap a generation on the current workers unless the current one matches.

        Parameters
        ----------
        options
            Resolved :class:`~mpshuffle.config.Options` as a dict, or ``None``
            to keep the current generation's (or the scheduler's defaults).

        Returns
        -------
        dict
            ``{"id", "nranks", "ranks": {worker: rank}, "bootstrapped": bool}``.

        Raises
        ------
        BootstrapError
            If there are no workers, or some worker failed or timed out;
            names the workers.
        """
        assert self.scheduler is not None and self._lock is not None
        async with self._lock:
            return await self._ensure_generation(options)

    async def _ensure_generation(self, options: dict[str, Any] | None) -> dict[str, Any]:
        assert self.scheduler is not None
        workers = tuple(sorted(self.scheduler.workers))
        if not workers:
            raise BootstrapError("cannot bootstrap mpshuffle: the cluster has no workers")
        gen = self.generation
        opts = Options(**options) if options is not None else (gen.options if gen else resolve_options())
        if gen is not None and not gen.stale and gen.workers == workers and gen.options == opts:
            return {**gen.describe(), "bootstrapped": False}
        new = _Generation(id=uuid.uuid4().hex[:12], workers=workers, token=secrets.token_hex(16), options=opts)
        if gen is not None:
            self._fail_runs_of(gen, f"generation {gen.id} was replaced by {new.id} (workers changed)")
        self._root_events[new.id] = asyncio.Event()
        spec = {
            "generation": new.id,
            "workers": list(workers),
            "token": new.token,
            "options": dataclasses.asdict(opts),
        }
        try:
            results = await asyncio.wait_for(
                self.scheduler.broadcast(
                    msg={"op": "mpshuffle_bootstrap", "spec": spec}, workers=list(workers), on_error="return"
                ),
                opts.bootstrap_timeout + 10,
            )
        except asyncio.TimeoutError:
            self.generation = None
            raise BootstrapError(
                f"bootstrap of generation {new.id} on {len(workers)} workers did not finish "
                f"within {opts.bootstrap_timeout + 10:g} s"
            ) from None
        finally:
            self._root_events.pop(new.id, None)
            self._roots.pop(new.id, None)
        failed = {w: r for w, r in results.items() if isinstance(r, BaseException)}
        if failed:
            self.generation = None
            detail = "; ".join(f"{w} (rank {workers.index(w)}): {type(e).__name__}: {e}" for w, e in failed.items())
            raise BootstrapError(f"bootstrap of generation {new.id} failed on {len(failed)} worker(s): {detail}")
        self.generation = new
        self.bootstraps += 1
        logger.info("mpshuffle: generation %s bootstrapped on %d workers", new.id, len(workers))
        return {**new.describe(), "bootstrapped": True}

    async def publish_root(self, generation: str, address: str) -> None:
        """Handler: rank 0 of ``generation`` publishes its address."""
        self._roots[generation] = address
        event = self._root_events.get(generation)
        if event is not None:
            event.set()

    async def get_root(self, generation: str, timeout: float) -> str:
        """Handler: wait (up to ``timeout`` s) for the root address of ``generation``."""
        event = self._root_events.get(generation)
        if event is None:
            raise BootstrapError(f"generation {generation} is not being bootstrapped")
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except asyncio.TimeoutError:
            gen_workers = sorted(self.scheduler.workers) if self.scheduler else []
            root = gen_workers[0] if gen_workers else "?"
            raise BootstrapError(
                f"rank 0 (worker {root}) of generation {generation} did not publish its address "
                f"within {timeout:g} s"
            ) from None
        return self._roots[generation]

    # -- runs ------------------------------------------------------------
    async def get_run(self, token: str, npartitions: int, extract_name: str, barrier_name: str) -> dict[str, Any]:
        """Handler: the run of graph ``token``, created (and pinned) on first call."""
        assert self.scheduler is not None and self._lock is not None
        async with self._lock:
            run = self.runs.get(token)
            if run is not None:
                if run.error:
                    return {"error": run.error}
                return self._describe(run)
            try:
                await self._ensure_generation(None)
            except BootstrapError as e:
                return {"error": f"bootstrap phase: {e}"}
            gen = self.generation
            assert gen is not None
            keys = [(extract_name, j) for j in range(npartitions)]
            run = _Run(token, next(self._ops), gen, npartitions, keys, barrier_name)
            self.runs[token] = run
            self._barrier_keys[barrier_name] = token
            restrictions = {
                key: gen.workers[partition_owner(j, len(gen.workers))]
                for j, key in enumerate(keys)
                if key in self.scheduler.tasks
            }
            self.scheduler.set_restrictions(restrictions)
            return self._describe(run)

    @staticmethod
    def _describe(run: _Run) -> dict[str, Any]:
        return {"op_id": run.op_id, "generation": run.generation.id, "workers": list(run.generation.workers)}

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

    def _end_run(self, run: _Run) -> None:
        self.runs.pop(run.token, None)
        self._barrier_keys.pop(run.barrier_key, None)
        self._unpin(run)
        self._broadcast(run.generation, {"op": "mpshuffle_end_run", "op_id": run.op_id, "token": run.token})

    def _unpin(self, run: _Run) -> None:
        assert self.scheduler is not None
        present = {k: None for k in run.extract_keys if k in self.scheduler.tasks}
        if present:
            self.scheduler.set_restrictions(present)

    def _fail_runs_of(self, gen: _Generation, reason: str) -> None:
        for run in list(self.runs.values()):
            if run.generation is gen and run.error is None:
                run.error = reason
                self._unpin(run)
                self._broadcast(
                    gen, {"op": "mpshuffle_fail_run", "op_id": run.op_id, "token": run.token, "reason": reason}
                )

    def _broadcast(self, gen: _Generation, msg: dict[str, Any]) -> None:
        assert self.scheduler is not None
        workers = [w for w in gen.workers if w in self.scheduler.workers]
        if workers:
            asyncio.ensure_future(self.scheduler.broadcast(msg=msg, workers=workers, on_error="ignore"))

    # -- membership ------------------------------------------------------
    def add_worker(self, scheduler: Scheduler, worker: str) -> None:
        # Picked up by the next run: the worker set no longer matches.
        logger.debug("mpshuffle: worker %s joined; the next shuffle bootstraps a new generation", worker)

    def remove_worker(self, scheduler: Scheduler, worker: str, **kwargs: Any) -> None:
        gen = self.generation
        if gen is None or worker not in gen.workers:
            return
        gen.stale = True
        rank = gen.workers.index(worker)
        self._fail_runs_of(gen, f"worker {worker} (rank {rank} of generation {gen.id}) left the cluster during the shuffle")
