"""Statistics of the last shuffles, gathered from every worker."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distributed import Client, Worker

__all__ = ["gather_statistics"]


def gather_statistics(client: Client | None = None) -> Any:
    """Per-rank statistics of the last finished shuffles on every worker.

    One ``client.run`` round over the workers: no task is submitted. Works
    with synchronous and asynchronous clients in Dask's own way: with
    ``Client(asynchronous=True)`` it returns an awaitable.

    Parameters
    ----------
    client
        The client; by default :func:`distributed.get_client`.

    Returns
    -------
    dict[str, list[dict]]
        Worker address -> one dict per finished run on that worker's rank,
        oldest first (at most the last 64 runs of the current generation):
        ``{"op_id": int, "generation": str, "rank": int, **statistics}``,
        where the statistics have the keys of
        :class:`mpshuffle.shuffler.run.Statistics` for host and device runs
        alike (``bytes_inserted``, ``bytes_sent``, ``bytes_received``,
        ``bytes_spilled_host``, ``bytes_spilled_disk``,
        ``bytes_unspilled_disk``, ... in bytes, counts and seconds), and
        ``"options"``: the options the run used on that worker (the graph's,
        with the worker options the client left unset from the worker's own
        config; ``timeout``, ``batch_bytes``) and its ``host_budget`` in
        bytes. A worker that was never bootstrapped has an empty list.
    """
    if client is None:
        from distributed import get_client

        client = get_client()
    return client.sync(_gather, client)


async def _gather(client: Client) -> dict[str, list[dict[str, Any]]]:
    return await client.run(_worker_statistics)  # type: ignore[no-any-return]


def _worker_statistics(dask_worker: Worker) -> list[dict[str, Any]]:
    from mpshuffle.dask.worker import PLUGIN_NAME

    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    ctx = getattr(plugin, "context", None)
    if ctx is None:
        return []
    return [
        {"op_id": op_id, "generation": ctx.generation, "rank": ctx.rank, **stats, "options": ctx.used.get(op_id)}
        for op_id, stats in list(ctx.history)
    ]
