"""A Dask client preload: workers start loading mpshuffle's kernels as a client connects.

A fresh worker's first insert loads the insert's compiled numba kernels
(:mod:`mpshuffle.table.warm`): about 1 CPU-s a worker process with numba's
cache filled, seconds more where the cache is empty and they compile. The
worker plugin does that on a thread as the worker joins a generation (option
``preload_kernels``), but a generation starts with the first shuffle graph,
whose inserts follow within a fraction of a second, so the first shuffle of
a fresh cluster still paid it (measured on the 2-core machine, 60 -> 60
partitions of 100,000 rows on 2 workers: 4.7 workers' CPU-s against 2.2 for
the next shuffle with numba's cache filled, 9.8 with it empty).

``import mpshuffle.dask`` adds this module to Dask's
``distributed.client.preload`` list (Dask's own mechanism for code that runs
as a :class:`distributed.Client` starts; :func:`install`). From then on, each
client this process starts registers mpshuffle's scheduler and worker plugins
(both idempotent; no task, no generation, no communicator) in the
background, the worker plugin asking each worker, present and future, to load
the kernels on a thread of its own while the user's first work runs. With option ``preload_kernels`` off
(``dask.config.set({"mpshuffle.preload_kernels": False})`` before the client
starts) it registers nothing. A failure is logged at DEBUG and does not stop
the client: the first shuffle registers the plugins again and reports
failures itself.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import dask.config

if TYPE_CHECKING:
    from distributed import Client

__all__ = ["dask_setup", "install"]

logger = logging.getLogger(__name__)

#: The name under which Dask imports this module as a client preload.
MODULE = __name__

# Registrations under way (a task that nothing references may be collected).
_PENDING: set[asyncio.Future[Any]] = set()


async def dask_setup(client: Client) -> None:
    """Register mpshuffle's plugins as ``client`` starts, asking workers to preload the kernels.

    Dask calls it (``distributed.client.preload``) at the end of the
    client's start, on its event loop, for synchronous and asynchronous
    clients alike.

    Parameters
    ----------
    client
        The client that is starting, connected to its scheduler.

    Notes
    -----
    The registration runs as a task of the client's loop and is not awaited;
    a failure (a cluster without mpshuffle, a client closed at once) is
    logged at DEBUG and leaves the registration to the first shuffle.
    """
    from mpshuffle.config import resolve_options
    from mpshuffle.errors import OptionError

    try:
        options = resolve_options()
    except OptionError:
        return  # the first shuffle graph names the bad option
    if not options.preload_kernels:
        return
    # Not awaited: the client's start does not wait for the workers to import
    # mpshuffle (~3 s on a fresh `dask worker` cluster), and a session that
    # never shuffles does not pay for it.
    task = asyncio.ensure_future(_register(client))
    _PENDING.add(task)
    task.add_done_callback(_PENDING.discard)


async def _register(client: Client) -> None:
    from mpshuffle.dask.bootstrap import register_plugins_async

    try:
        await register_plugins_async(client, preload_kernels=True)
    except Exception as exc:  # noqa: BLE001 - best effort: the first shuffle registers and reports
        # A cluster without mpshuffle installed, a client closed at once, a
        # scheduler gone: the first shuffle registers the plugins again and
        # reports what fails, in its bootstrap phase.
        logger.debug("mpshuffle: plugins not registered as the client started: %r", exc)


def install() -> None:
    """Add this module to ``distributed.client.preload`` in this process's Dask config; idempotent.

    Only clients started after the call run it. Other preloads the user
    configured stay, in their order.
    """
    current = dask.config.get("distributed.client.preload", default=None) or []
    if isinstance(current, str):
        current = [current]
    if MODULE in current:
        return
    update: dict[str, Any] = {"distributed.client.preload": [*current, MODULE]}
    argv = dask.config.get("distributed.client.preload-argv", default=None) or []
    if argv and all(isinstance(a, (list, tuple)) for a in argv):
        # Arguments per preload: distributed wants one list per preload.
        update["distributed.client.preload-argv"] = [*argv, []]
    dask.config.set(update)
