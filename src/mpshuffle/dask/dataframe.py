"""Shuffles of dask DataFrames."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import dask
import dask.dataframe as dd
from dask.base import tokenize

from mpshuffle.dask.graph import check_npartitions, shuffle_graph

__all__ = ["shuffle"]


def shuffle(
    df: dd.DataFrame,
    on: Hashable | Sequence[Hashable],
    *,
    npartitions: int | None = None,
    ignore_index: bool = False,
) -> dd.DataFrame:
    """Shuffle a dask DataFrame so that equal keys share an output partition.

    Parameters
    ----------
    df
        The collection to shuffle: pandas partitions, or cudf partitions
        (dask_cudf; needs ``ignore_index=True``), which take the device path:
        hash partitioning on each worker's GPU and NCCL between the GPUs.
    on
        Column name or names; rows with equal values end up in the same
        output partition. Null keys all land in one partition. See
        :mod:`mpshuffle.table.hashing` for the hash.
    npartitions
        Number of output partitions; by default ``df.npartitions``.
    ignore_index
        Drop the index (faster); by default it travels with the rows.

    Returns
    -------
    dask.dataframe.DataFrame
        ``npartitions`` partitions with unknown divisions. Partition ``j``
        holds the rows whose key hashes to ``j``, ordered by input partition,
        then by position within it.

    Raises
    ------
    TypeError
        If ``df`` is not a dask DataFrame or ``npartitions`` not an integer.
    ValueError
        If ``on`` is empty, ``npartitions`` < 1, the multiprocessing
        scheduler is configured, or the partitions are cudf frames and
        ``ignore_index`` is False.
    KeyError
        If a column of ``on`` is not in ``df``; names the missing columns.

    Notes
    -----
    Nothing runs until the result is computed or persisted. Then the first
    task binds the shuffle to the cluster's current generation (bootstrapping
    one if needed) under a fresh run id, so recomputing the result, using an
    asynchronous client, or changing the workers in between all work. With
    no distributed Client, Dask's ``sync`` or ``threads`` scheduler runs the
    shuffle in one process.
    """
    if not isinstance(df, dd.DataFrame):
        raise TypeError(f"shuffle expects a dask DataFrame, got {type(df).__name__}")
    if isinstance(on, (str, bytes, int)) or not isinstance(on, Sequence):
        on = [on]
    on = list(on)
    if not on:
        raise ValueError("shuffle needs at least one key column in 'on', got an empty list")
    missing = [c for c in on if c not in df.columns]
    if missing:
        raise KeyError(f"shuffle key column(s) {missing!r} not in the DataFrame's columns {list(df.columns)!r}")
    npartitions = check_npartitions(df.npartitions if npartitions is None else npartitions)
    if dask.config.get("scheduler", None) in ("processes", "multiprocessing"):
        raise ValueError(
            "mpshuffle cannot run on Dask's multiprocessing scheduler; use a distributed Client "
            "or the 'threads' or 'sync' scheduler"
        )
    _warm_up()
    df = df.optimize()
    meta = df._meta
    keep_index = not ignore_index
    if ignore_index:
        meta = meta.reset_index(drop=True)
    input_keys = df.__dask_keys__()
    token = tokenize(df._name, on, npartitions, keep_index)
    layer, keys = shuffle_graph(
        input_keys, on=on, npartitions=npartitions, meta=meta, keep_index=keep_index, token=token
    )
    graph = dict(df.__dask_graph__())
    graph.update(layer)
    return dd.from_graph(graph, meta, (None,) * (npartitions + 1), keys, "mpshuffle")


def _warm_up() -> None:
    """Bootstrap early with a synchronous default client; the tasks do it otherwise."""
    try:
        from distributed import default_client

        client = default_client()
    except (ImportError, ValueError):
        return
    if client.asynchronous or client.status != "running":
        return
    import dataclasses

    from mpshuffle.config import resolve_options
    from mpshuffle.dask.bootstrap import register_plugins

    register_plugins(client)
    # Options resolved here only seed the first generation: one the user
    # bootstrapped with keyword arguments (spill_host=...) must be kept, not
    # replaced by one with the dask.config defaults.
    client.run_on_scheduler(_warm_up_generation, options=dataclasses.asdict(resolve_options()))


async def _warm_up_generation(options: dict[str, Any], dask_scheduler: Any = None) -> dict[str, Any]:
    from mpshuffle.dask.scheduler import ShuffleSchedulerPlugin

    plugin = dask_scheduler.plugins[ShuffleSchedulerPlugin.name]
    return await plugin.ensure_generation(None if plugin.generation is not None else options)


