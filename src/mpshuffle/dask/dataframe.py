"""Shuffles of dask DataFrames."""

from __future__ import annotations

import functools
import logging
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

import dask
import dask.dataframe as dd
from dask.base import tokenize

from mpshuffle.config import resolve_options
from mpshuffle.dask._checks import frame_type_error
from mpshuffle.dask.graph import check_npartitions, shuffle_graph

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from mpshuffle.options import Options

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
        raise frame_type_error("shuffle expects a dask DataFrame", df)
    if isinstance(on, (str, bytes, int)) or not isinstance(on, Sequence):
        on = [on]
    on = list(on)
    if not on:
        raise ValueError("shuffle needs at least one key column in 'on', got an empty list")
    missing = [c for c in on if c not in df.columns]
    if missing:
        raise KeyError(f"shuffle key column(s) {missing!r} not in the DataFrame's columns {list(df.columns)!r}")
    npartitions = check_npartitions(df.npartitions if npartitions is None else npartitions)
    options = graph_options()
    df = df.optimize()
    meta = df._meta
    keep_index = not ignore_index
    if ignore_index:
        meta = meta.reset_index(drop=True)
    graph = dict(df.__dask_graph__())
    input_keys = _skip_aliases(graph, df.__dask_keys__())
    token = tokenize(df._name, on, npartitions, keep_index, options.as_dict())
    layer, keys = shuffle_graph(
        input_keys, on=on, npartitions=npartitions, meta=meta, keep_index=keep_index, token=token,
        options=options,
    )
    graph.update(layer)
    return _collection(graph, meta, npartitions, keys)


def _collection(
    graph: dict[Any, Any], meta: Any, npartitions: int, keys: list[Any],
    divisions: tuple[Any, ...] | None = None,
) -> dd.DataFrame:
    """The dask DataFrame whose partitions are the tasks ``keys`` = ``[(name, 0), (name, 1), ...]``.

    ``dd.from_graph`` renames the keys and adds one alias task per partition;
    the expression below keeps ``name`` as the collection's own, so the
    scheduler runs no task beyond the graph's. Used for the shuffle's extract
    tasks and for the per-partition tasks of merges and sorts.
    """
    if divisions is None:
        divisions = (None,) * (npartitions + 1)
    if _ShuffleOutput is None:  # a dask without dask-expr's FromGraph
        return dd.from_graph(graph, meta, divisions, keys, "mpshuffle")
    from dask._collections import new_collection

    return new_collection(_ShuffleOutput(graph, meta, divisions, keys, keys[0][0]))


try:
    from dask.dataframe.dask_expr.io.io import FromGraph as _FromGraph
except ImportError:  # pragma: no cover - older dask
    _ShuffleOutput = None
else:

    class _ShuffleOutput(_FromGraph):  # type: ignore[no-redef]
        """A graph collection named like its partitions' keys ``(name, j)``: no alias task per partition."""

        @functools.cached_property
        def _name(self) -> str:
            return self.operand("name_prefix")

        def __dask_tokenize__(self) -> str:
            # The keys' name already holds a token of everything the graph is
            # made of (inputs, columns, partitions). Dask's default tokenizes
            # every task of the layer at compute time, pickling each task's
            # function: ~140 us a task, minutes and gigabytes for a million
            # output partitions, far more than building the graph.
            if not self._determ_token:
                self._determ_token = tokenize(
                    "mpshuffle-output", self.operand("name_prefix"), self.operand("keys")[-1],
                    self.operand("_meta"), self.operand("divisions"),
                )
            return self._determ_token

        def _layer(self) -> dict[Any, Any]:
            return dict(self.operand("layer"))


def _skip_aliases(graph: dict[Any, Any], keys: list[Any]) -> list[Any]:
    """Input keys with pure aliases replaced by their targets; unused aliases leave ``graph``.

    A persisted collection, once optimized, gets a new name whose tasks only
    alias the persisted keys: one extra task per partition for the scheduler
    and the workers to run before each insert. The inserts take the persisted
    keys instead.
    """
    try:
        from dask._task_spec import Alias
    except ImportError:  # an older dask: keep the aliases
        return keys
    resolved = []
    chains: set[Any] = set()  # aliases passed on the way (a.partitions[...] of a persisted a)
    for key in keys:
        target, task, hops = key, graph.get(key), 0
        while isinstance(task, Alias) and task.target in graph and hops < 64:
            chains.add(target)
            target, task, hops = task.target, graph.get(task.target), hops + 1
        resolved.append(target)
    chains.difference_update(resolved)
    if chains:
        from dask.core import keys_in_tasks

        # keys_in_tasks reads GraphNodes and legacy tuples alike and skips
        # values: a persisted frame is a value in the graph, and its
        # attributes (a column named "dependencies") are no references.
        refs: dict[Any, int] = dict.fromkeys(chains, 0)
        for task in graph.values():
            for k in keys_in_tasks(chains, [task]):
                refs[k] += 1
        unused = [k for k, n in refs.items() if n == 0]
        while unused:  # an alias dropped may leave the alias it read unused
            for k in keys_in_tasks(chains, [graph.pop(unused.pop())]):
                refs[k] -= 1
                if refs[k] == 0:
                    unused.append(k)
    return resolved


def graph_options() -> Options:
    """The options of a graph being built here, on the client; bootstraps early where it can.

    The one place where mpshuffle's collections (``shuffle``, ``merge``,
    ``sort_values``, ``set_index``, ``rechunk``) decide their runs' options:
    the client's ``dask.config``, carried by the graph from then on.

    Raises
    ------
    ValueError
        If Dask's multiprocessing scheduler is configured (its tasks share no state).
    OptionError
        If an ``mpshuffle.*`` setting is unknown or invalid.
    """
    if dask.config.get("scheduler", None) in ("processes", "multiprocessing"):
        raise ValueError(
            "mpshuffle cannot run on Dask's multiprocessing scheduler; use a distributed Client "
            "or the 'threads' or 'sync' scheduler"
        )
    options = resolve_options()
    _warm_up(options)
    return options


def _warm_up(options: Options) -> None:
    """Bootstrap a generation for the graph's ``options`` early, with a synchronous default client.

    The graph's first task would do it otherwise, while its inputs wait.
    """
    try:
        from distributed import default_client

        client = default_client()
    except (ImportError, ValueError):
        return
    if client.asynchronous or client.status != "running":
        return
    from mpshuffle.dask.bootstrap import register_plugins
    from mpshuffle.errors import BootstrapError

    try:
        register_plugins(client)
        client.run_on_scheduler(_warm_up_generation, options=options.as_dict())
    except (BootstrapError, OSError, TimeoutError) as exc:
        # No workers yet (an adaptive cluster), one that does not answer, or a
        # connection closed under the call (a worker lost while the graph is
        # built; distributed's CommClosedError is an OSError): building the
        # graph must not fail for it. The first task registers the plugins
        # and bootstraps again, and reports a failure then, in the bootstrap phase.
        logger.debug("mpshuffle: early bootstrap skipped: %r", exc)


async def _warm_up_generation(options: dict[str, Any], dask_scheduler: Any = None) -> dict[str, Any]:
    from mpshuffle.dask.scheduler import ShuffleSchedulerPlugin

    plugin = dask_scheduler.plugins[ShuffleSchedulerPlugin.name]
    return await plugin.ensure_generation(options)


