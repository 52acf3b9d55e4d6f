"""The worker plugin: bootstraps this worker's ranks and owns their contexts."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from collections.abc import Coroutine, Iterator
from typing import TYPE_CHECKING, Any

import psutil
from distributed.comm.addressing import get_address_host, parse_address
from distributed.diagnostics.plugin import WorkerPlugin
from distributed.utils import sync

from mpshuffle.comm.tcp import TcpCommunicator
from mpshuffle.config import with_worker_config
from mpshuffle.dask.messages import BootstrapSpec, Joined, Restarted, RunBinding, Verdict
from mpshuffle.dask.runtime import RunInfo
from mpshuffle.errors import (
    BootstrapError,
    CommTimeoutError,
    MPShuffleError,
    OptionError,
    ShuffleError,
    phase,
)
from mpshuffle.memory.spill import remove_orphans
from mpshuffle.options import Options
from mpshuffle.shuffler.context import WorkerContext
from mpshuffle.table import partition_owner

if TYPE_CHECKING:
    from distributed import Worker

__all__ = ["PLUGIN_NAME", "ShuffleWorkerPlugin"]

logger = logging.getLogger(__name__)

PLUGIN_NAME = "mpshuffle"

# Seconds a task waits for the scheduler's answer about a lost peer, past the
# run's own timeout.
_VERDICT_GRACE = 5.0


#: How often (milliseconds) a worker checks whether Dask paused it (:meth:`ShuffleWorkerPlugin._when_paused`).
_PAUSE_WATCH_MS = 250


class ShuffleWorkerPlugin(WorkerPlugin):
    """Holds this worker's :class:`WorkerContext` per generation and answers the scheduler plugin.

    Registered on every worker (present and future) by
    :func:`mpshuffle.dask.bootstrap_dask_cluster`. It adds four handlers to
    the worker's RPC server, all coroutines or quick calls that never block
    the worker's event loop (closing a communicator runs in a thread):

    ``mpshuffle_bootstrap(spec)``
        Become this worker's rank of a new generation (a :class:`BootstrapSpec`):
        listen, learn the root's address from the scheduler plugin (or
        publish it, on rank 0), connect, and meet the others at the barrier;
        then, with option ``preload_kernels``, start loading the insert's
        kernels in the background (:func:`mpshuffle.table.warm.warm_up`).
        Contexts of older generations stay open for the runs still using
        them, until the scheduler closes them.
    ``mpshuffle_close_generation(generation)``
        Close a generation's context: its progress thread, sockets, buffers.
    ``mpshuffle_abort_bootstrap(generation, reason)``
        Give up joining ``generation``: another rank failed its bootstrap,
        so waiting for it until the timeout would only delay the error.
    ``mpshuffle_end_run(op_id, token)``
        Free a run's state (it finished or was released): :meth:`release_run`.
    ``mpshuffle_fail_run(op_id, token, reason)``
        Fail a run (a peer left; the scheduler restarts it) and free its state.

    Parameters
    ----------
    preload_kernels
        Start loading the insert's kernels as the plugin is set up on a
        worker, before any generation (as a client registers it when it
        starts: :mod:`mpshuffle.dask.client_preload`); otherwise as the worker
        joins a generation whose option ``preload_kernels`` is on.

    Attributes
    ----------
    context
        The context of the newest generation this worker is a rank of, or ``None``.
    contexts
        Open contexts by generation id.
    """

    idempotent = True
    name = PLUGIN_NAME

    def __init__(self, *, preload_kernels: bool = False) -> None:
        self.preload_kernels = preload_kernels
        self.worker: Worker | None = None
        self.contexts: dict[str, WorkerContext] = {}
        self.current: str | None = None
        self.runs: dict[str, RunInfo] = {}
        self._bootstrap_lock: asyncio.Lock | None = None
        self._preloading: threading.Thread | None = None

    @property
    def context(self) -> WorkerContext | None:
        """The context of the newest generation, or ``None``."""
        return self.contexts.get(self.current) if self.current else None

    def setup(self, worker: Worker) -> None:
        self.worker = worker
        # Created here, not in __init__: the plugin is pickled on its way to the worker.
        self._runs_lock = threading.Lock()
        self._bootstrap_lock = asyncio.Lock()
        self._failed: dict[int, str] = {}
        worker.handlers["mpshuffle_bootstrap"] = self.bootstrap
        worker.handlers["mpshuffle_close_generation"] = self.close_generation
        worker.handlers["mpshuffle_abort_bootstrap"] = self.abort_bootstrap
        # Bootstraps the scheduler gave up on (another rank failed), with why.
        self._aborted: dict[str, tuple[asyncio.Event, list[str]]] = {}
        worker.handlers["mpshuffle_end_run"] = self.release_run
        worker.handlers["mpshuffle_fail_run"] = self.fail_run
        self._moving = False
        self._pause_watch: Any = None
        with contextlib.suppress(RuntimeError):  # no running event loop: nothing to watch from
            from tornado.ioloop import PeriodicCallback

            asyncio.get_running_loop()
            self._pause_watch = PeriodicCallback(self._when_paused, _PAUSE_WATCH_MS)
            self._pause_watch.start()
            if self.preload_kernels:
                self._preload()

    async def _when_paused(self) -> None:
        """While Dask pauses this worker, move what its runs hold in memory to disk.

        Dask pauses a worker above its pause fraction and starts no task
        until memory falls; the chunks a run holds in memory are nothing Dask
        can spill, and with no task running no extract frees them, so the
        worker stayed paused for good (an out-of-core rechunk on workers of
        1 GiB). Moving them to the run's spill file frees the memory; their
        pieces are read back at their extracts.
        """
        from distributed.core import Status

        ctx, worker = self.context, self.worker
        if worker is None or worker.status != Status.paused or ctx is None or self._moving or not ctx.shufflers:
            return
        self._moving = True
        try:
            freed = await asyncio.to_thread(ctx.move_to_disk)
        finally:
            self._moving = False
        if freed:
            logger.info("mpshuffle: worker %s paused; moved %d bytes of its runs to disk", worker.address, freed)

    async def teardown(self, worker: Worker) -> None:
        if getattr(self, "_pause_watch", None) is not None:
            self._pause_watch.stop()
        # The other handlers stay: the scheduler may still tell a closing worker
        # to close or fail something, which is then a no-op.
        worker.handlers.pop("mpshuffle_bootstrap", None)
        contexts, self.contexts, self.current = list(self.contexts.values()), {}, None
        for ctx in contexts:
            try:
                await asyncio.to_thread(ctx.close)
            except RuntimeError:
                # The loop's executor is shut down already (an in-process
                # cluster left open until the interpreter exits): close here.
                ctx.close()

    # -- handlers (on the worker's event loop) ---------------------------
    async def bootstrap(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Join the generation of a :class:`BootstrapSpec` message as this worker's rank (RPC handler).

        Returns a :class:`Joined` message: this rank and its address, or the
        error (a :class:`BootstrapError` if this worker is not in the
        generation, or some rank did not arrive within the bootstrap timeout,
        naming those ranks and their workers), so the scheduler reads it from
        a field.
        """
        try:
            joined = await self._join(BootstrapSpec.from_msg(spec))
        except Exception as e:  # noqa: BLE001 -- every failure goes back to the scheduler, named
            joined = Joined(-1, "", error=f"{type(e).__name__}: {e}")
        return joined.to_msg()

    async def _join(self, spec: BootstrapSpec) -> Joined:
        from mpshuffle.table.warm import paused

        # The kernels' warm-up (a thread) waits while this rank bootstraps:
        # its stretches of GIL slowed every message of the rendezvous (16
        # workers on the 2-core machine: 3.5 s against 0.25 s).
        with paused():
            return await self._join_paused(spec)

    async def _join_paused(self, spec: BootstrapSpec) -> Joined:
        assert self.worker is not None and self._bootstrap_lock is not None
        generation = spec.generation
        async with self._bootstrap_lock:
            ctx = self.contexts.get(generation)
            if ctx is not None:
                return Joined(ctx.rank, ctx.comm.addresses[ctx.rank])
            workers = spec.workers
            address = self.worker.address
            if address not in workers:
                raise BootstrapError(f"worker {address} is not in generation {generation}")
            rank = workers.index(address)
            # The client's options, but for the worker options it left unset:
            # those name this machine's directory, interface and ports.
            options = with_worker_config(Options(**spec.options))
            scheduler = self.worker.scheduler
            timeout = options.bootstrap_timeout
            comm = await TcpCommunicator.start(
                rank,
                len(workers),
                generation=generation,
                token=spec.token,
                listen_address=_listen_addresses(address, options),
                security=self.worker.security,
                shared_memory=options.shared_memory,
                # A legitimate peer says hello at once; a stranger gets as
                # long as a rank of the bootstrap would.
                hello_timeout=timeout,
            )
            async def meet() -> None:
                if rank == 0:
                    root = comm.addresses[0]
                    await scheduler.mpshuffle_publish_root(generation=generation, address=root)
                else:
                    root = await scheduler.mpshuffle_get_root(generation=generation, timeout=timeout)
                await comm.rendezvous(root, timeout)

            try:
                await self._unless_aborted(generation, meet())
            except CommTimeoutError as e:
                await asyncio.to_thread(comm.close)
                who = ", ".join(f"rank {r} (worker {workers[r]})" for r in e.missing)
                raise BootstrapError(
                    f"bootstrap of generation {generation}: {who} did not arrive within {timeout:g} s"
                ) from None
            except BaseException:
                await asyncio.to_thread(comm.close)
                raise
            # Spill directories of workers that died mid-shuffle (SIGKILL, OOM)
            # stay on a shared or custom disk: the next bootstrap on that
            # directory removes those whose owner's lock is gone.
            await asyncio.to_thread(remove_orphans, options.spill_dir or self.worker.local_directory)
            ctx = WorkerContext(
                comm,
                generation,
                options,
                memory_limit=self.worker.memory_manager.memory_limit,
                memory_ceiling=_dask_ceiling(self.worker.memory_manager),
                memory_in_use=psutil.Process().memory_info().rss,
                local_directory=self.worker.local_directory,
                workers=workers,
            )
            ctx.on_link_lost = functools.partial(self._link_lost, ctx)
            self.contexts[generation] = ctx
            self.current = generation
            if options.preload_kernels:
                self._preload()
            return Joined(rank, comm.addresses[rank])

    async def abort_bootstrap(self, generation: str, reason: str) -> None:
        """Handler: stop joining ``generation`` (or refuse to start), failing with ``reason``."""
        event, reasons = self._aborted.setdefault(generation, (asyncio.Event(), []))
        reasons.append(reason)
        event.set()

    async def _unless_aborted(self, generation: str, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` unless, or until, the scheduler aborts the bootstrap of ``generation``.

        Raises
        ------
        BootstrapError
            If it was aborted; names the rank that failed.
        """
        event, reasons = self._aborted.setdefault(generation, (asyncio.Event(), []))
        task = asyncio.ensure_future(work)
        stop = asyncio.ensure_future(event.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            self._aborted.pop(generation, None)
        if task.done():
            task.result()
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise BootstrapError(f"bootstrap of generation {generation} stopped: {reasons[0]}")

    def _preload(self) -> None:
        # Not awaited: the bootstrap (and its timeout) does not wait for it.
        # Once per process (warm_up returns at once after the first time), on
        # a daemon thread, not the loop's executor: a worker closed while it
        # loads (a client that connected and left at once) exits at once
        # instead of waiting seconds for the executor's thread.
        if self._preloading is None:
            self._preloading = threading.Thread(target=_warm_up, name="mpshuffle-preload", daemon=True)
            self._preloading.start()

    async def close_generation(self, generation: str) -> None:
        """Close generation ``generation`` on this worker (RPC handler); unknown ids are ignored."""
        ctx = self.contexts.pop(generation, None)
        self._aborted.pop(generation, None)  # an abort that came after this worker's join ended
        if self.current == generation:
            self.current = None
        with self._runs_lock:
            for token, run in list(self.runs.items()):
                if run.generation == generation:
                    del self.runs[token]
        if ctx is not None:
            await asyncio.to_thread(ctx.close)

    def release_run(self, op_id: int, token: str) -> None:
        """Free run ``op_id`` of graph ``token`` on this worker: it finished or was released (RPC handler)."""
        ctx = self._forget_run(op_id, token)
        if ctx is not None:
            ctx.end_run(op_id)

    def fail_run(self, op_id: int, token: str, reason: str) -> None:
        """Fail run ``op_id`` of graph ``token`` on this worker (RPC handler)."""
        self._failed[op_id] = reason
        ctx = self._forget_run(op_id, token)
        if ctx is not None:
            ctx.fail_run(op_id, reason)

    def _forget_run(self, op_id: int, token: str) -> WorkerContext | None:
        with self._runs_lock:
            run = self.runs.get(token)
            if run is not None and run.op_id == op_id:
                del self.runs[token]
        for ctx in list(self.contexts.values()):
            if op_id in ctx.shufflers:
                return ctx
        return self.contexts.get(run.generation) if run is not None else self.context

    def _link_lost(self, ctx: WorkerContext, peer: int, reason: str, op_ids: list[int]) -> None:
        """Tell the scheduler plugin that ``ctx``'s rank gave up rank ``peer`` (its :attr:`~WorkerContext.on_link_lost`).

        The communicator gives a peer up when a connection to it breaks
        (reset, closed without a goodbye, a send that fails): data still in
        the stream may be gone, and finish counting could not tell, so it
        does not reconnect within the generation (a flap that TCP rides over
        breaks no connection, and a connection that cannot be opened yet is
        retried by ``distributed.comm.connect`` until its timeout). The runs
        ``op_ids`` can no longer complete on this rank; other ranks may be
        waiting for them and would hear only after ``timeout``. The scheduler
        plugin fails them on every rank at once, naming the link, and retires
        the generation (:meth:`ShuffleSchedulerPlugin.link_lost`). Called on
        the progress thread (or a task's): the report goes from the worker's
        event loop.
        """
        if self.worker is None or self.contexts.get(ctx.generation) is not ctx:
            return  # the generation is closing
        self.worker.loop.add_callback(self._report_link_lost, ctx.generation, ctx.rank, peer, reason, op_ids)

    async def _report_link_lost(self, generation: str, rank: int, peer: int, reason: str, op_ids: list[int]) -> None:
        assert self.worker is not None
        try:
            await self.worker.scheduler.mpshuffle_link_lost(
                generation=generation, rank=rank, peer=peer, reason=reason, op_ids=op_ids
            )
        except Exception:  # the scheduler is gone or unreachable: its own watch takes over
            logger.debug("mpshuffle: could not report the lost link to rank %d", peer, exc_info=True)

    # -- from task threads -------------------------------------------------
    def get_run(
        self, token: str, npartitions: int, *, options: Options, extract_name: str, barrier_name: str,
        inserting: bool = False,
    ) -> RunInfo:
        """Bind graph ``token`` to a run (asking the scheduler plugin once per run).

        Called from task threads; waits on the worker's event loop without
        blocking it. ``options`` are the graph's and go to the scheduler
        plugin, which binds the run to a generation made with them; this
        worker's own configuration plays no part (but for the worker options,
        at bootstrap). ``inserting`` is not needed here: the scheduler plugin
        makes a new run when a computation of the graph ended.

        Raises
        ------
        ShuffleError
            If the run failed.
        """
        assert self.worker is not None
        with self._runs_lock:
            run = self.runs.get(token)
            if run is not None and run.generation not in self.contexts and self.worker.address in run.workers:
                # A run of a generation this worker no longer holds, whose end
                # or failure it did not hear (its link was down when the
                # scheduler said so): a new computation of the same graph asks
                # the scheduler again instead of failing on the stale run.
                del self.runs[token]
                run = None
        if run is None:
            binding = RunBinding.from_msg(sync(
                self.worker.loop,
                self.worker.scheduler.mpshuffle_get_run,
                token=token,
                npartitions=npartitions,
                extract_name=extract_name,
                barrier_name=barrier_name,
                options=options.as_dict(),
            ))
            if binding.error is not None:
                raise ShuffleError(binding.error)
            run = RunInfo(token, binding.op_id, binding.generation, binding.workers, npartitions, options.timeout)
            with self._runs_lock:
                run = self.runs.setdefault(token, run)
        return run

    def context_for(self, run: RunInfo) -> WorkerContext:
        """This worker's context of ``run``'s generation.

        Raises
        ------
        Reschedule
            If this worker is not a rank of the run's generation (it joined
            after the run started): the scheduler runs the task on a rank.
        ShuffleError
            If this worker is a rank of the generation but no longer holds it
            (it was closed because the run failed).
        """
        assert self.worker is not None
        ctx = self.contexts.get(run.generation)
        if ctx is not None:
            return ctx
        if self.worker.address not in run.workers:
            from distributed import Reschedule

            raise Reschedule()
        raise ShuffleError(
            f"worker {self.worker.address} no longer holds generation {run.generation} "
            f"of shuffle op {run.op_id} (the run failed or was restarted)"
        )

    def check_owner(self, run: RunInfo, partition_id: int) -> None:
        """Raise :class:`distributed.Reschedule` unless this worker holds the rank owning ``partition_id``.

        Extract tasks are pinned by the scheduler plugin; one that still lands
        elsewhere moves.
        """
        assert self.worker is not None
        if self.worker.address != run.workers[partition_owner(partition_id, len(run.workers))]:
            from distributed import Reschedule

            raise Reschedule()

    def extracted(self, run: RunInfo, ctx: WorkerContext) -> None:
        """Nothing to do: the scheduler plugin ends the run when its barrier task is released."""

    @contextlib.contextmanager
    def guard(self, name: str, run: RunInfo, ctx: WorkerContext) -> Iterator[None]:
        """Run one phase of a task of ``run``: restart-aware, with clear errors.

        Inside, errors are labelled with the phase and this rank (see
        :func:`mpshuffle.errors.phase`). If the run failed because a peer was
        lost, the task asks the scheduler whether the run was restarted and
        raises :class:`distributed.Reschedule` if so; otherwise the error names
        the lost ranks' workers.
        """
        where = f"rank {ctx.rank} (worker {ctx.workers[ctx.rank]})"
        try:
            with phase(name, where):
                yield
        except MPShuffleError as e:
            if ctx.comm.lost or run.op_id in self._failed:
                verdict = self._verdict(run, run.timeout, ctx)
                if verdict.restart:
                    if name == "insert":
                        # The restart released this task; Dask may still take
                        # this execution's result for the resumed task, and it
                        # drops a Reschedule it cannot place (the task then
                        # waits forever). Return normally instead: the result
                        # names the old run, and the barrier restarts again.
                        return
                    from distributed import Reschedule

                    raise Reschedule() from None
            elif isinstance(e, TimeoutError):
                # A wait that timed out without a lost peer means a rank stopped
                # answering: retire the generation, whose next run could hang the
                # same way. Other errors (bad data, a released run) leave it alone.
                self._verdict(run, 0)
            raise

    def restart_run(self, run: RunInfo, reason: str) -> None:
        """Ask the scheduler to compute ``run`` again, then reschedule this task.

        Called from a task thread: the barrier that found inputs of an older
        run, or an extract whose partition this rank already handed out. The
        restart releases this task too, so the ``Reschedule`` only matters if
        the scheduler declined.

        Raises
        ------
        distributed.Reschedule
            If the run was restarted.
        ShuffleError
            If it was not (naming ``reason``).
        """
        assert self.worker is not None
        reply = Restarted.from_msg(
            sync(self.worker.loop, self.worker.scheduler.mpshuffle_restart_run, op_id=run.op_id, reason=reason)
        )
        if reply.restarted:
            from distributed import Reschedule

            raise Reschedule()
        raise ShuffleError(f"shuffle op {run.op_id}: {reason}, and it could not be restarted")

    def _verdict(self, run: RunInfo, timeout: float, ctx: WorkerContext | None = None) -> Verdict:
        assert self.worker is not None
        # The peers this rank lost, and why: the scheduler names them in the run's error.
        lost = [] if ctx is None else [[peer, why] for peer, why in sorted(ctx.comm.lost.items())]
        try:
            return Verdict.from_msg(sync(
                self.worker.loop,
                self.worker.scheduler.mpshuffle_run_lost,
                op_id=run.op_id,
                timeout=timeout,
                rank=-1 if ctx is None else ctx.rank,
                lost=lost,
                callback_timeout=timeout + _VERDICT_GRACE,
            ))
        except Exception:
            logger.debug("mpshuffle: no verdict from the scheduler on op %d", run.op_id, exc_info=True)
            return Verdict(restart=False)


def _warm_up() -> None:
    from mpshuffle.table.warm import warm_up

    try:
        warm_up()
    except Exception:  # the first insert loads them again and reports what fails
        logger.warning("mpshuffle: loading the insert's kernels ahead failed", exc_info=True)


def _listen_addresses(worker_address: str, options: Options) -> list[str]:
    """Where this rank's communicator may listen, in order of preference.

    The worker's protocol (``tcp://``, ``tls://``); the host of the worker's
    own address, or the IPv4 address of option ``listen_interface``; the
    port of option ``port`` (each port of a range in turn), else a free one.

    Raises
    ------
    OptionError
        If ``listen_interface`` names no interface of this machine with an
        IPv4 address.
    """
    protocol, _ = parse_address(worker_address)
    if protocol == "inproc":
        return ["inproc://"]
    host = get_address_host(worker_address)
    if options.listen_interface is not None:
        from distributed.utils import get_ip_interface

        try:
            host = get_ip_interface(options.listen_interface)
        except ValueError as e:
            raise OptionError(
                f"option 'listen_interface': {options.listen_interface!r} on worker {worker_address}: {e}"
            ) from None
    low, high = options.port_range()
    return [f"{protocol}://{host}:{port}" for port in range(low, high + 1)]


def _dask_ceiling(manager: Any) -> float | None:
    """The fraction of ``memory_limit`` at which Dask spills or pauses the worker (the lower), or ``None``.

    A run's host budget stays under it with room for the worker's own data
    (:meth:`mpshuffle.options.Options.host_budget`): above the pause
    fraction Dask starts no task, and memory held by a run is none that Dask
    can spill.
    """
    fractions = [
        f for f in (getattr(manager, "memory_spill_fraction", False), getattr(manager, "memory_pause_fraction", False))
        if f is not False and f is not None
    ]
    return min(float(f) for f in fractions) if fractions else None
