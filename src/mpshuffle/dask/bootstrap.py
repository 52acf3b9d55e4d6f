"""Bootstrapping mpshuffle's communicator across an existing Dask cluster."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from mpshuffle.config import set_options
from mpshuffle.dask.messages import Generation
from mpshuffle.dask.scheduler import ShuffleSchedulerPlugin
from mpshuffle.dask.worker import PLUGIN_NAME, ShuffleWorkerPlugin
from mpshuffle.errors import MPShuffleError

if TYPE_CHECKING:
    from distributed import Client

    from mpshuffle.shuffler.context import WorkerContext

__all__ = [
    "Generation",
    "bootstrap_dask_cluster",
    "get_worker_context",
    "register_plugins",
    "register_plugins_async",
]


def bootstrap_dask_cluster(client: Client | None = None, **options: Any) -> Any:
    """Bootstrap mpshuffle's communicator on every worker of a Dask cluster.

    One collective round, driven by the scheduler plugin and started with
    ``client.run_on_scheduler``: no task, no future, nothing in the
    dashboard's task stream. Workers are ranked by their sorted addresses;
    rank 0 publishes its address through the scheduler plugin, the others
    fetch it, connect, and all meet at a barrier, all without blocking any
    worker's event loop. Shuffles call this for you when they start; call it
    yourself to choose options or to pay the bootstrap up front.

    Works with synchronous and asynchronous clients in Dask's own way: with
    ``Client(asynchronous=True)`` it returns an awaitable.

    Parameters
    ----------
    client
        The client; by default :func:`distributed.get_client`.
    **options
        ``mpshuffle.*`` options (``timeout``, ``bootstrap_timeout``,
        ``spill_host``, ``spill_dir``, ``spill_device``, ``pool_size``,
        ``batch_bytes``, ``shared_memory``, ``preload_kernels``,
        ``listen_interface``, ``port``; see :class:`mpshuffle.options.Options`).
        They are set into this process's :mod:`dask.config`, as
        ``dask.config.set(...)`` outside a ``with`` block would, so every
        shuffle graph built here afterwards carries them: keyword arguments
        and ``dask.config`` are one path. The generation is bootstrapped with
        the options then in force.

    Returns
    -------
    Generation
        The generation (id, nranks, worker -> rank). Idempotent: for the same
        scheduler, workers and generation options (all but ``timeout`` and
        ``batch_bytes``, which each run carries) the same generation is
        returned with ``bootstrapped=False``; a changed worker set or
        generation options bootstrap a new one.

    Raises
    ------
    OptionError
        For unknown option names (``comm`` among them: the communicator
        follows from the cluster) or invalid values; nothing is set then.
    BootstrapError
        If the cluster has no workers or a worker failed or timed out; the
        message names the workers and ranks.
    """
    if client is None:
        from distributed import get_client

        client = get_client()
    opts = set_options(**options)
    return client.sync(_bootstrap, client, dataclasses.asdict(opts))


async def _bootstrap(client: Client, options: dict[str, Any]) -> Generation:
    await register_plugins_async(client)
    desc = await client.run_on_scheduler(_ensure_generation, options=options)
    return Generation.from_msg(desc)


async def _ensure_generation(options: dict[str, Any], dask_scheduler: Any = None) -> dict[str, Any]:
    plugin: ShuffleSchedulerPlugin = dask_scheduler.plugins[ShuffleSchedulerPlugin.name]
    return await plugin.ensure_generation(options)


async def register_plugins_async(client: Client, *, preload_kernels: bool = False) -> None:
    """Register mpshuffle's scheduler and worker plugins from the client's event loop (idempotent).

    Both plugins are idempotent: registering again keeps the ones running
    (and the worker plugin's ``preload_kernels`` of the first registration).

    Parameters
    ----------
    client
        A client, synchronous or asynchronous, awaited on its own loop.
    preload_kernels
        Workers start loading the insert's kernels as the worker plugin is
        set up (see :class:`~mpshuffle.dask.worker.ShuffleWorkerPlugin`).

    Raises
    ------
    OSError
        If a connection closes under the call (distributed's ``CommClosedError``).
    """
    await client.register_plugin(ShuffleSchedulerPlugin(), name=ShuffleSchedulerPlugin.name)
    await client.register_plugin(ShuffleWorkerPlugin(preload_kernels=preload_kernels), name=PLUGIN_NAME)


def register_plugins(client: Client) -> Any:
    """Register mpshuffle's scheduler and worker plugins (idempotent).

    Returns an awaitable for asynchronous clients, ``None`` otherwise.
    """
    return client.sync(register_plugins_async, client)


def get_worker_context(worker: Any = None) -> WorkerContext:
    """This worker's rank, communicator and shufflers (of its newest generation).

    Call on a worker: in a task, or in ``client.run`` passing the worker
    (``client.run(lambda dask_worker: get_worker_context(dask_worker))``),
    since :func:`distributed.get_worker` only knows the worker inside tasks.

    Parameters
    ----------
    worker
        The :class:`distributed.Worker`; by default :func:`distributed.get_worker`.

    Returns
    -------
    WorkerContext

    Raises
    ------
    ValueError
        If not called on a Dask worker.
    MPShuffleError
        If this worker has not been bootstrapped.
    """
    if worker is None:
        from distributed import get_worker

        worker = get_worker()
    plugin = worker.plugins.get(PLUGIN_NAME)
    ctx = getattr(plugin, "context", None)
    if ctx is None:
        raise MPShuffleError(
            f"worker {worker.address} has no mpshuffle context: call "
            "mpshuffle.dask.bootstrap_dask_cluster(client) or run a shuffle first"
        )
    return ctx
