"""The worker plugin: bootstraps this worker's rank and owns its context."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import TYPE_CHECKING, Any

from distributed.comm.addressing import get_address_host, parse_address
from distributed.diagnostics.plugin import WorkerPlugin
from distributed.utils import sync

from mpshuffle.comm import TcpCommunicator
from mpshuffle.config import Options
from mpshuffle.dask.context import RunInfo, WorkerContext
from mpshuffle.errors import BootstrapError, ShuffleError

if TYPE_CHECKING:
    from distributed import Worker

__all__ = ["PLUGIN_NAME", "ShuffleWorkerPlugin"]

logger = logging.getLogger(__name__)

PLUGIN_NAME = "mpshuffle"


class ShuffleWorkerPlugin(WorkerPlugin):
    """Holds this worker's :class:`WorkerContext` and answers the scheduler plugin.

    Registered on every worker (present and future) by
    :func:`mpshuffle.dask.bootstrap_dask_cluster`. It adds three handlers to
    the worker's RPC server, all coroutines that never block the worker's
    event loop:

    ``mpshuffle_bootstrap(spec)``
        Become rank ``spec["workers"].index(address)`` of a new generation:
        listen, learn the root's address from the scheduler plugin (or
        publish it, on rank 0), connect, and meet the others at the barrier.
    ``mpshuffle_end_run(op_id, token)``
        Free a run's state (it finished or was released).
    ``mpshuffle_fail_run(op_id, token, reason)``
        Fail a run (a peer left) and free its state.
    """

    idempotent = True
    name = PLUGIN_NAME

    def __init__(self) -> None:
        self.worker: Worker | None = None
        self.context: WorkerContext | None = None
        self.runs: dict[str, RunInfo] = {}
        self._bootstrap_lock: asyncio.Lock | None = None

    def setup(self, worker: Worker) -> None:
        self.worker = worker
        # Created here, not in __init__: the plugin is pickled on its way to the worker.
        self._runs_lock = threading.Lock()
        self._bootstrap_lock = asyncio.Lock()
        worker.handlers["mpshuffle_bootstrap"] = self.bootstrap
        worker.handlers["mpshuffle_end_run"] = self.end_run
        worker.handlers["mpshuffle_fail_run"] = self.fail_run

    async def teardown(self, worker: Worker) -> None:
        for name in ("mpshuffle_bootstrap", "mpshuffle_end_run", "mpshuffle_fail_run"):
            worker.handlers.pop(name, None)
        ctx, self.context = self.context, None
        if ctx is not None:
            await asyncio.to_thread(ctx.close)

    # -- handlers (on the worker's event loop) ---------------------------
    async def bootstrap(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Join generation ``spec`` as this worker's rank (RPC handler)."""
        assert self.worker is not None and self._bootstrap_lock is not None
        async with self._bootstrap_lock:
            ctx = self.context
            if ctx is not None and ctx.generation == spec["generation"]:
                return {"rank": ctx.rank, "address": ctx.comm.addresses[ctx.rank]}
            self.context = None
            with self._runs_lock:
                self.runs.clear()
            if ctx is not None:
                await asyncio.to_thread(ctx.close)
            workers = tuple(spec["workers"])
            address = self.worker.address
            if address not in workers:
                raise BootstrapError(f"worker {address} is not in generation {spec['generation']}")
            rank = workers.index(address)
            options = Options(**spec["options"])
            scheduler = self.worker.scheduler
            timeout = options.bootstrap_timeout
            comm = await TcpCommunicator.start(
                rank,
                len(workers),
                generation=spec["generation"],
                token=spec["token"],
                listen_address=_listen_address(address),
                security=self.worker.security,
            )
            try:
                if rank == 0:
                    root = comm.addresses[0]
                    await scheduler.mpshuffle_publish_root(generation=spec["generation"], address=root)
                else:
                    root = await scheduler.mpshuffle_get_root(generation=spec["generation"], timeout=timeout)
                await comm.rendezvous(root, timeout)
            except BaseException:
                await asyncio.to_thread(comm.close)
                raise
            self.context = WorkerContext(
                comm,
                spec["generation"],
                options,
                memory_limit=self.worker.memory_manager.memory_limit,
                local_directory=self.worker.local_directory,
                workers=workers,
            )
            return {"rank": rank, "address": comm.addresses[rank]}

    def end_run(self, op_id: int, token: str) -> None:
        """Free run ``op_id`` of graph ``token`` on this worker (RPC handler)."""
        with self._runs_lock:
            run = self.runs.get(token)
            if run is not None and run.op_id == op_id:
                del self.runs[token]
        if self.context is not None:
            self.context.end_run(op_id)

    def fail_run(self, op_id: int, token: str, reason: str) -> None:
        """Fail run ``op_id`` of graph ``token`` on this worker (RPC handler)."""
        with self._runs_lock:
            run = self.runs.get(token)
            if run is not None and run.op_id == op_id:
                del self.runs[token]
        if self.context is not None:
            self.context.fail_run(op_id, reason)

    # -- from task threads -------------------------------------------------
    def get_run(self, token: str, npartitions: int, extract_name: str, barrier_name: str) -> RunInfo:
        """Bind graph ``token`` to a run (asking the scheduler plugin once per run).

        Called from task threads; waits on the worker's event loop without
        blocking it.

        Raises
        ------
        ShuffleError
            If the run failed, or this worker is not a rank of its generation.
        """
        assert self.worker is not None
        with self._runs_lock:
            run = self.runs.get(token)
        if run is None:
            resp = sync(
                self.worker.loop,
                self.worker.scheduler.mpshuffle_get_run,
                token=token,
                npartitions=npartitions,
                extract_name=extract_name,
                barrier_name=barrier_name,
            )
            if resp.get("error"):
                raise ShuffleError(resp["error"])
            run = RunInfo(
                token=token,
                op_id=resp["op_id"],
                generation=resp["generation"],
                workers=tuple(resp["workers"]),
                npartitions=npartitions,
            )
            with self._runs_lock:
                run = self.runs.setdefault(token, run)
        return run

    def context_for(self, run: RunInfo) -> WorkerContext:
        """This worker's context, checked to be a rank of ``run``'s generation.

        Raises
        ------
        ShuffleError
            If this worker is not a rank of the run's generation.
        """
        ctx = self.context
        if ctx is None or ctx.generation != run.generation:
            assert self.worker is not None
            raise ShuffleError(
                f"worker {self.worker.address} is not a rank of generation {run.generation} "
                f"used by shuffle op {run.op_id} (it joined or was re-bootstrapped after the "
                "shuffle started)"
            )
        return ctx


def _listen_address(worker_address: str) -> str:
    """Listen where the worker does: same protocol and host, a free port."""
    protocol, _ = parse_address(worker_address)
    if protocol == "inproc":
        return "inproc://"
    return f"{protocol}://{get_address_host(worker_address)}:0"
