"""Dask Array rechunking through mpshuffle: ``array.rechunk.method: mpshuffle``.

After ``import mpshuffle.dask``, one line sends Dask's rechunks through mpshuffle::

    dask.config.set({"array.rechunk.method": "mpshuffle"})
    # or, per call: x.rechunk((400, 50, 50), method="mpshuffle")

xarray's ``.chunk(...)`` of a dask-backed object calls Dask's ``rechunk``, so
the same line applies there.

How Dask gets here
------------------
``dask.array.rechunk.rechunk`` (which ``Array.rechunk`` and
``dask.array.rechunk`` call) runs its ``"tasks"`` or ``"p2p"`` method and
raises ``NotImplementedError`` for any other name; Dask has no registry for
external methods. :func:`install` wraps it (in ``dask.array.rechunk`` and
as ``dask.array.rechunk``): for the method ``"mpshuffle"`` (the ``method``
argument, else ``array.rechunk.method``) it calls :func:`rechunk`; for every
other method, Dask's own function unchanged. The target chunks are Dask's:
:func:`rechunk` normalizes them with Dask's own helpers (``normalize_chunks``
for ``"auto"``, ``-1``, dicts and ``block_size_limit``; ``balance``; the same
checks), so the output has exactly the chunks Dask's rechunk would give. With
Dask's experimental array expressions (``array.query-planning``), which do
not call that function, choosing ``"mpshuffle"`` raises
``NotImplementedError`` instead of running Dask's tasks method.

The graph
---------
Cutting is independent per axis: along one axis, consecutive output chunks
that share an input chunk belong to one *group*, and the groups of the axes
multiply into independent n-dimensional groups (each input and output block
in exactly one). A group with one input block or one output block needs no
exchange: each output block is one task, a slice of its input block or an
assembly of its input blocks' slices. A group with several of both is one
mpshuffle run (:func:`mpshuffle.dask.graph.insert` / ``barrier`` /
``extract`` with a :class:`~mpshuffle.table.ndarray.NDArrayAdapter`): an
insert task takes the input blocks one worker holds (up to
:data:`INSERT_GROUP_BYTES`) where the blocks are in memory when the graph is
built, else one block; each input block's insert cuts it into one cut per output block it
overlaps and sends, per output *partition* (:func:`partition_bytes` of
consecutive output blocks: 64 MiB, less on workers with a small host
budget; the count of blocks moved to one that tiles the grid of output
blocks, :func:`aligned_per_partition`), one piece holding its cuts for that partition's
blocks to the partition's owner (the pieces its own rank keeps stay
views of the input block where the cuts allow, see
:mod:`mpshuffle.table.ndarray`); each partition's extract task (its adapter
carries the plan and the partition) assembles its blocks once, and each
output block is a task that takes its block from its partition's result. All keys start with ``mpshuffle-rechunk``; the
output blocks' keys are the array's ``(name, i, j, ...)``. The run's tasks
are never fused with their neighbours by Dask's low-level optimization
(the scheduler plugin pins the extract tasks by their keys).

Which arrays
------------
NumPy-backed arrays of any dtype and number of dimensions, irregular and
zero-size chunks, and axes of unknown chunk sizes (NaN) that the rechunk
leaves as they are (Dask's rule). Blocks of dtypes holding Python objects
(``object``, structured dtypes with object fields) travel pickled. Arrays
whose blocks are not ``numpy.ndarray`` (masked, sparse, CuPy) are refused
with a ``TypeError`` when the graph is built (from the array's meta); a
block that turns out not to be one when it is computed (a meta that does
not match the blocks) fails its task with a
:class:`~mpshuffle.errors.ShuffleError` naming the block's type, in the
exchange and in a task assembling an output block from several input
blocks alike (never an output with the masks or the type dropped).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import sys
from collections.abc import Sequence
from typing import Any

import dask
import numpy as np
from dask._task_spec import Alias, Task, TaskRef
from dask.base import tokenize

from mpshuffle.dask.dataframe import graph_options
from mpshuffle.dask.graph import (
    Inserted,
    ShuffleSpec,
    barrier,
    check_npartitions,
    extract,
    insert_parts,
)
from mpshuffle.dask.method import METHOD, check_dask_version
from mpshuffle.options import Options
from mpshuffle.table.ndarray import AxisCuts, BlockPlan, NDArrayAdapter, check_plain_block

__all__ = [
    "BALANCE_RATIO", "INSERT_GROUP_BYTES", "PARTITION_BUDGET_FRACTION", "PARTITION_BYTES", "aligned_per_partition", "install", "installed", "partition_bytes",
    "rechunk", "uninstall",
]

#: Most bytes of output blocks gathered into one output partition of a rechunk's
#: run (one piece per insert and partition; see :func:`_exchange`); less on
#: workers with a small host budget (:func:`partition_bytes`).
PARTITION_BYTES = 64 * 2**20
#: An output partition is at most this fraction of the smallest host budget
#: of the cluster's workers (:func:`partition_bytes`).
PARTITION_BUDGET_FRACTION = 1 / 8


def rechunk(
    x: Any,
    chunks: Any = "auto",
    threshold: int | None = None,
    block_size_limit: int | None = None,
    balance: bool = False,
) -> Any:
    """Rechunk dask array ``x`` through mpshuffle; what ``x.rechunk(..., method="mpshuffle")`` calls.

    Parameters
    ----------
    x
        A dask array of ``numpy.ndarray`` blocks.
    chunks, block_size_limit, balance
        As for :func:`dask.array.rechunk`: the target chunks (int, tuple,
        dict, ``"auto"``, ``-1``; ``block_size_limit`` in bytes bounds
        ``"auto"``; ``balance`` evens the chunk sizes out), normalized by
        Dask's own helpers, so the result has exactly Dask's chunks.
    threshold
        Accepted for Dask's signature; not used (mpshuffle has no
        intermediate steps to plan).

    Returns
    -------
    dask.array.Array
        A normal dask array with the new chunks, named ``mpshuffle-rechunk-<token>``;
        ``x`` itself where Dask would return it (nothing to do).

    Raises
    ------
    TypeError
        If ``x`` is not a dask array, or its blocks are not ``numpy.ndarray``.
    ValueError
        If the chunks do not fit ``x``'s shape (Dask's checks and messages),
        or a group of the rechunk has more than ``mpshuffle.max-npartitions``
        output blocks.
    mpshuffle.dask.method.UnsupportedDaskError
        Outside the dask versions this module was tested on.
    mpshuffle.errors.OptionError
        If an ``mpshuffle.*`` option in ``dask.config`` is unknown or invalid.
    """
    import dask.array as da

    check_dask_version()
    if not isinstance(x, da.Array):
        raise TypeError(f"rechunk expects a dask array, got {type(x).__module__}.{type(x).__qualname__}")
    if x.ndim > 0 and all(s == 0 for s in x.shape):
        return x  # nothing to move (as Dask does)
    new = _target_chunks(x, chunks, block_size_limit)
    if not balance and new == x.chunks:
        return x
    from dask.array.rechunk import _balance_chunksizes, _validate_rechunk

    if balance:
        new = tuple(_balance_chunksizes(axis) for axis in new)  # type: ignore[arg-type]
    _validate_rechunk(x.chunks, new)
    meta = x._meta
    if type(meta) is not np.ndarray:
        cls = type(meta)
        raise TypeError(
            f"mpshuffle rechunks arrays of numpy.ndarray blocks; this array's blocks are "
            f"{cls.__module__}.{cls.__qualname__}. Use method='tasks' or 'p2p' for it."
        )
    options = graph_options()
    return _build(x, new, options)


def _target_chunks(x: Any, chunks: Any, block_size_limit: int | None) -> tuple[tuple[float, ...], ...]:
    """Dask's target chunks for ``x.rechunk(chunks, block_size_limit=...)``, before ``balance``."""
    from dask.array.core import normalize_chunks
    from dask.array.utils import validate_axis

    if isinstance(chunks, dict):
        given = {validate_axis(axis, x.ndim): c for axis, c in chunks.items()}
        chunks = {a: x.chunks[a] if given.get(a) is None else given[a] for a in range(x.ndim)}
    if isinstance(chunks, (tuple, list)):
        chunks = tuple(old if c is None else c for c, old in zip(chunks, x.chunks, strict=False))
    new = normalize_chunks(
        chunks, x.shape, limit=block_size_limit, dtype=x.dtype, previous_chunks=x.chunks
    )
    if len(new) != x.ndim:
        raise ValueError("Provided chunks are not consistent with shape")
    return tuple(tuple(axis) for axis in new)


@dataclasses.dataclass(frozen=True)
class _AxisGroup:
    """Along one axis: input chunks ``olds`` (global indices) and output chunks ``news`` that share them."""

    olds: tuple[int, ...]
    news: range
    cuts: AxisCuts  # per position in olds: (output chunk - news.start, start, stop, offset)
    recipes: tuple[tuple[tuple[int, slice, int], ...], ...]  # per output chunk: (old, slice, offset)


def _axis_groups(recipes: Sequence[Sequence[tuple[int, slice]]]) -> list[_AxisGroup]:
    """Group one axis's output chunks by shared input chunks (Dask's ``old_to_new`` of the axis)."""
    spans: list[list[int]] = []  # [first output chunk, last output chunk + 1]
    for j, recipe in enumerate(recipes):
        # Output chunks overlap ascending input chunks: j shares one with j - 1
        # exactly when its first input chunk is j - 1's last.
        if spans and recipes[j - 1][-1][0] == recipe[0][0]:
            spans[-1][1] = j + 1
        else:
            spans.append([j, j + 1])
    groups = []
    for lo, hi in spans:
        olds: list[int] = []
        cuts: dict[int, list[tuple[int, int, int, int]]] = {}
        placed = []
        for j in range(lo, hi):
            offset, entries = 0, []
            for old, sl in recipes[j]:
                if old not in cuts:
                    olds.append(old)
                    cuts[old] = []
                stop = -1 if sl.stop is None else int(sl.stop)
                cuts[old].append((j - lo, int(sl.start), stop, offset))
                entries.append((old, sl, offset))
                offset += 0 if sl.stop is None else int(sl.stop) - int(sl.start)
            placed.append(tuple(entries))
        groups.append(_AxisGroup(
            tuple(olds), range(lo, hi), tuple(tuple(cuts[o]) for o in olds), tuple(placed)
        ))
    return groups


class _Pinned(Task):  # type: ignore[misc]
    """A task that Dask's low-level optimization never fuses: the scheduler plugin pins it by its key."""

    @property
    def block_fusion(self) -> bool:
        return True


def _build(x: Any, chunks: tuple[tuple[float, ...], ...], options: Options) -> Any:
    from dask.array.core import Array
    from dask.array.rechunk import old_to_new
    from dask.highlevelgraph import HighLevelGraph

    per_axis = [_axis_groups(recipes) for recipes in old_to_new(x.chunks, chunks)]
    groups = list(itertools.product(*per_axis))
    runs = [
        g for g in groups
        if math.prod(len(a.olds) for a in g) > 1 and math.prod(len(a.news) for a in g) > 1
    ]
    cluster: tuple[int, int] = (1, PARTITION_BYTES)
    holders: dict[Any, int] = {}
    if runs:
        cluster, holders = _cluster(options, [
            (x.name, *(a.olds[i] for a, i in zip(g, local, strict=True)))
            for g in runs for local in np.ndindex(*(len(a.olds) for a in g))
        ])
    # Where the input blocks lie shapes the insert tasks (_insert_groups), so it names the graph too.
    token = tokenize(x.name, chunks, METHOD, options.as_dict(), sorted(holders.items()))
    name = f"{METHOD}-rechunk-{token}"
    layer: dict[Any, Any] = {}
    for gix, group in enumerate(groups):
        nold = math.prod(len(g.olds) for g in group)
        nnew = math.prod(len(g.news) for g in group)
        if nold > 1 and nnew > 1:
            _exchange(layer, x, name, token, gix, group, options, *cluster, holders=holders)
        else:
            _local(layer, x, name, group)
    graph = HighLevelGraph.from_collections(name, layer, dependencies=[x])
    return Array(graph, name, chunks, meta=x._meta)


def _local(layer: dict[Any, Any], x: Any, name: str, group: tuple[_AxisGroup, ...]) -> None:
    """Output blocks of a group with one input or one output block: one task each, no exchange."""
    input_name = x.name
    for new in itertools.product(*(g.news for g in group)):
        key = (name, *new)
        recipe = [g.recipes[j - g.news.start] for g, j in zip(group, new, strict=True)]
        inputs = list(itertools.product(*recipe))
        if len(inputs) == 1:
            (entry,) = inputs
            olds = tuple(e[0] for e in entry)
            slices = tuple(e[1] for e in entry)
            whole = all(
                s.start == 0 and (s.stop is None or s.stop == x.chunks[a][o])
                for a, (s, o) in enumerate(zip(slices, olds, strict=True))
            )
            if whole:
                layer[key] = Alias(key, (input_name, *olds))  # type: ignore[arg-type]
            else:
                layer[key] = Task(key, _take, TaskRef((input_name, *olds)), slices)
            continue
        layout = tuple((tuple(e[1] for e in entry), tuple(e[2] for e in entry)) for entry in inputs)
        refs = [TaskRef((input_name, *(e[0] for e in entry))) for entry in inputs]
        layer[key] = Task(key, _assemble, layout, *refs)


def _exchange(
    layer: dict[Any, Any], x: Any, name: str, token: str, gix: int, group: tuple[_AxisGroup, ...],
    options: Options, workers: int, nbytes_per_partition: int = PARTITION_BYTES,
    holders: dict[Any, int] | None = None,
) -> None:
    """The tasks of one mpshuffle run: inserts of input blocks, a barrier, an extract per output partition.

    ``holders`` maps an input block's key to the worker holding it when the
    graph is built (an index; blocks not in memory are missing): the blocks
    held by one worker are inserted by a few tasks (:func:`_insert_groups`),
    every other block by a task of its own.

    Output partition ``p`` is ``nbytes_per_partition`` (:func:`partition_bytes`)
    of consecutive output blocks (C order; one block at least, and at least
    two partitions per worker of a default client where the blocks allow):
    an insert sends one piece per partition, not per block. Each output
    block is then a task that takes its block out of its partition's result.
    """
    ndim = len(group)
    nout = tuple(len(g.news) for g in group)
    nblocks = math.prod(nout)
    known = all(not math.isnan(c) for axis in _chunks_of(x, group) for c in axis)
    per_partition = 1
    if known and nblocks > 1:
        nbytes = x.dtype.itemsize * math.prod(sum(axis) for axis in _chunks_of(x, group))
        wanted = max(math.ceil(nbytes / max(1, nbytes_per_partition)), 2 * workers)
        per_partition = aligned_per_partition(max(1, nblocks // max(1, min(wanted, nblocks))), nout, workers)
    plan = BlockPlan(cuts=tuple(g.cuts for g in group), nout=nout, per_partition=per_partition)
    gtoken = tokenize(token, gix)
    spec = ShuffleSpec(
        token=gtoken,
        on=(),
        npartitions=check_npartitions(plan.npartitions),
        meta=np.empty((0,) * ndim, dtype=x.dtype),
        insert_name=f"{METHOD}-rechunk-insert-{token}",
        barrier_name=f"{METHOD}-rechunk-barrier-{gtoken}",
        extract_name=f"{METHOD}-rechunk-extract-{gtoken}",
        options=options,
    )
    locals_ = list(np.ndindex(*(len(g.olds) for g in group)))
    olds = [tuple(g.olds[i] for g, i in zip(group, local, strict=True)) for local in locals_]
    where = [(holders or {}).get((x.name, *old)) for old in olds]
    refs, index = [], 0  # input indices run through the tasks in order: the barrier's order
    sizes = [x.dtype.itemsize * n for n in _block_elements(x, olds)]
    for members in _insert_groups(where, sizes):
        # Keyed by the first block's index: unique among all the runs of this rechunk.
        key = (spec.insert_name, *olds[members[0]])
        blocks = [TaskRef((x.name, *olds[m])) for m in members]
        batches = tuple(tuple(locals_[m] for m in batch) for batch in _insert_batches(members, sizes))
        layer[key] = _Pinned(key, _insert_blocks, spec, plan, batches, index, *blocks)
        refs.append(TaskRef(key))
        index += len(batches)
    layer[spec.barrier_name] = _Pinned(spec.barrier_name, _barrier, spec, *refs)
    for pid in range(plan.npartitions):
        key = (spec.extract_name, pid)
        out = NDArrayAdapter(x.dtype, plan, partition=pid)
        layer[key] = _Pinned(key, extract, TaskRef(spec.barrier_name), pid, spec, out)
    for b, local in enumerate(np.ndindex(*nout)):
        key = (name, *(g.news.start + i for g, i in zip(group, local, strict=True)))
        layer[key] = Task(key, _pick, TaskRef((spec.extract_name, b // per_partition)), b)


#: Most bytes of input blocks one insert task takes (:func:`_insert_groups`):
#: Dask's default ``array.chunk-size``, as P2P's rechunk merges its inputs up to it.
INSERT_GROUP_BYTES = 128 * 2**20


def _block_elements(x: Any, olds: Sequence[tuple[int, ...]]) -> list[int]:
    """Elements of each input block (0 where a size is unknown)."""
    out = []
    for old in olds:
        sizes = [x.chunks[a][o] for a, o in enumerate(old)]
        out.append(0 if any(math.isnan(c) for c in sizes) else math.prod(int(c) for c in sizes))
    return out


def _insert_groups(where: Sequence[int | None], nbytes: Sequence[int]) -> list[list[int]]:
    """The input blocks (positions) each insert task takes, in order.

    Blocks in memory on one worker when the graph is built (``where`` its
    index) go into tasks of consecutive such blocks of at most
    :data:`INSERT_GROUP_BYTES` (one block at least); each other block
    (``None``: not in memory) gets a task of its own. Why by worker: Dask
    runs a task where its inputs are and moves the others to it, so a task
    over blocks of two workers would move half of them once more before the
    run moves them (P2P's merged transfer tasks do that). Why: an insert task
    costs Dask's scheduling and mpshuffle's binding (~1 ms, the sum of ~0.4
    CPU-s per worker at 400 blocks), a few of them per worker much less.

    The tasks are ordered by their first block, so the input indices the
    blocks get (their place in the returned order) run through them.
    """
    open_: dict[int, list[int]] = {}
    size: dict[int, int] = {}
    out: list[list[int]] = []
    for pos, (w, n) in enumerate(zip(where, nbytes, strict=True)):
        if w is None:
            out.append([pos])
            continue
        group = open_.get(w)
        if group is None or size[w] + n > INSERT_GROUP_BYTES:
            group = open_[w] = []
            size[w] = 0
            out.append(group)
        group.append(pos)
        size[w] += n
    return out


#: Most bytes of input blocks one insert call takes as one input
#: (:func:`_insert_batches`): its pieces for each rank travel together, in
#: chunks sized as one insert's, and its copies of the pieces sent away
#: exist at once. Why batch: a block's bytes spread over the ranks, so a
#: block inserted alone sent each rank ``block / ranks`` bytes in a message
#: of its own; at 16 ranks the 4 MB blocks of a 6.4 GB time-to-space rechunk
#: made 24,000 socket messages of ~250 KB, and the run took longer than P2P's
#: (``benchmarks/results/README.md``, session 24). Why not the whole task
#: (:data:`INSERT_GROUP_BYTES`): the pieces copied for other ranks are held
#: until sent, so a batch bounds that memory.
INSERT_BATCH_BYTES = 32 * 2**20


def _insert_batches(members: Sequence[int], nbytes: Sequence[int]) -> list[list[int]]:
    """The blocks of one insert task (positions ``members``) in batches inserted as one input each, in order.

    Consecutive blocks of at most :data:`INSERT_BATCH_BYTES` together (one
    block at least); a block of unknown size (0 in ``nbytes``) is a batch of
    its own.
    """
    out: list[list[int]] = []
    size = 0
    for m in members:
        n = nbytes[m]
        if not out or n == 0 or nbytes[out[-1][-1]] == 0 or size + n > INSERT_BATCH_BYTES:
            out.append([])
            size = 0
        out[-1].append(m)
        size += n
    return out


def _insert_blocks(
    spec: ShuffleSpec, plan: BlockPlan, batches: tuple[tuple[tuple[int, ...], ...], ...], first: int, *blocks: Any
) -> tuple[Inserted, ...]:
    """Task: insert input blocks ``blocks`` in ``batches`` (their positions in the group), batch ``i`` as input
    index ``first + i`` (:func:`~mpshuffle.dask.graph.insert_parts`)."""
    dtype = spec.meta.dtype
    given = iter(blocks)
    out = []
    for i, batch in enumerate(batches):
        parts = [(next(given), NDArrayAdapter(dtype, plan, local, views=True)) for local in batch]
        out.append(insert_parts(parts, first + i, spec))
    return tuple(out)


def _barrier(spec: ShuffleSpec, *inserted: tuple[Inserted, ...]) -> Any:
    """Task: :func:`mpshuffle.dask.graph.barrier` over the blocks of all insert tasks, in input index order."""
    return barrier(spec, *itertools.chain.from_iterable(inserted))


#: How far (by ratio) from the bytes' count of blocks per partition
#: :func:`aligned_per_partition` looks for a count that loads the ranks
#: alike: 16 -> 20 blocks (space-to-time on 2 workers), 4 -> 5 (time-to-space
#: on 16).
BALANCE_RATIO = 1.25


def aligned_per_partition(target: int, nout: Sequence[int], ranks: int = 1) -> int:
    """Output blocks per output partition: ``target``, moved to the nearest count that tiles the block grid
    and spreads the blocks evenly over the ranks.

    A partition of consecutive blocks (C order) is a box of the grid of
    output blocks when its count divides the last axis's blocks, or is the
    last axis's blocks times a divisor of the axis before (and so on
    outwards). Then every input block's cuts for one partition are one box
    of the block too, and where that box spans the block's trailing axes
    whole (time-to-space: a partition of whole rows of pixel columns) its
    byte range holds nothing but the cuts: kept pieces stay views of the
    input block, and sent pieces go out as such ranges, uncopied
    (:mod:`mpshuffle.table.ndarray`). A count that does not tile (16 of a
    row of 20) leaves every other partition's range spanning two rows,
    twice its cuts, and such pieces are copied.

    Among tiling counts within :data:`BALANCE_RATIO` of ``target``, those
    whose partitions give no rank more blocks than another come first
    (partition ``p`` is rank ``p % ranks``'s): the extracts of the rank with
    the most blocks end the run. Only that near, because the bytes set
    ``target`` (an eighth of a small budget, two partitions per worker at
    least): a count twice as large for balance made 2 partitions of 500
    blocks where 5 of 200 were asked for (a breaker, session 26). Space-to-time
    on 2 ranks in partitions of 16 blocks made 25 partitions, 13 against 12;
    in 20, 20 partitions: 1.45-1.56 s against 1.65 on the 2-core VM (medians
    of 5, session 26). At 16 ranks, time-to-space's 100 partitions of 4
    blocks are 7 on some ranks and 6 on others; 80 of 5 are 5 each.

    Parameters
    ----------
    target
        Blocks per partition from the bytes (:func:`partition_bytes`), >= 1.
    nout
        Output blocks of the group per axis.
    ranks
        Ranks of the run (workers); 1 weighs no balance.

    Returns
    -------
    int
        Among the tiling counts within :data:`BALANCE_RATIO` of ``target``,
        the one whose most loaded rank holds the fewest blocks against the
        mean (to 1 %), then the nearest to ``target`` by ratio (the smaller
        on a tie). Where none is that near: the nearest tiling count if it
        is at most twice ``target``, else ``target``.
    """
    candidates = {1}
    inner = 1
    for n in reversed(list(nout)):
        small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
        candidates.update(inner * d for d in (*small, *(n // d for d in small)))
        inner *= n
    nblocks = math.prod(nout)

    def ratio(c: int) -> float:
        return max(c / target, target / c)

    fits = [c for c in candidates if ratio(c) <= BALANCE_RATIO]
    if not fits:
        best = min(candidates, key=lambda c: (ratio(c), c))
        return best if best <= 2 * target else target

    def load(c: int) -> float:
        """The most blocks one rank extracts, over the mean (1.0: even)."""
        full, rest = divmod(nblocks, c)
        rounds, extra = divmod(full, ranks)
        most = max((rounds + (extra > 0)) * c, rounds * c + rest)
        return round(most * ranks / max(1, nblocks), 2)

    return min(fits, key=lambda c: (load(c), ratio(c), c))


def _chunks_of(x: Any, group: tuple[_AxisGroup, ...]) -> list[list[float]]:
    """Per axis, the sizes of the group's input chunks."""
    return [[x.chunks[a][o] for o in g.olds] for a, g in enumerate(group)]


def _cluster(options: Options, keys: Sequence[Any] = ()) -> tuple[tuple[int, int], dict[Any, int]]:
    """The default distributed client's workers and output partition bytes, and where ``keys`` are.

    Returns ``((workers, bytes), holders)``: the number of workers (1
    without a client), the bytes of an output partition there
    (:func:`partition_bytes`), and for each of ``keys`` in memory on a worker
    an index of the worker holding it (the first by address, numbered by
    address among the holders);
    ``holders`` is empty without a client, from an asynchronous one (no
    blocking call from an event loop), or if the scheduler did not answer.
    """
    try:
        from distributed import default_client

        client = default_client()
    except (ImportError, ValueError):
        return (1, PARTITION_BYTES), {}
    info = None
    holders: dict[Any, int] = {}
    if not client.asynchronous and client.status == "running":
        try:
            # The scheduler's answer itself: scheduler_info() returns the client's
            # shared identity, which its periodic refresh (without workers) can
            # overwrite between the fetch and the read.
            info = client.sync(client.scheduler.identity, n_workers=-1)["workers"]
            if keys:
                who = client.sync(client.scheduler.who_has, keys=list(keys))
                first = {k: min(ws) for k, ws in who.items() if ws}
                names = {a: i for i, a in enumerate(sorted(set(first.values())))}
                holders = {k: names[first[k]] for k in keys if k in first}
        except (OSError, TimeoutError):
            pass  # the connection went under the call: size from what the client last saw
    if info is None:
        # No blocking call from an event loop: the identity the client last saw.
        info = getattr(client, "_scheduler_identity", {}).get("workers", {})
    return (max(1, len(info)), partition_bytes(options, info.values())), holders


def partition_bytes(options: Options, workers: Any) -> int:
    """Bytes of output blocks per output partition of a rechunk run on ``workers``.

    :data:`PARTITION_BYTES`, or :data:`PARTITION_BUDGET_FRACTION` of the
    smallest host budget among the workers where that is less (1 MiB at
    least). Why: an extract holds its partition twice (the pieces read back,
    the blocks assembled), and Dask starts the next extract (all are ready
    at the barrier) before the tasks that take the blocks out of the last
    one have run, so a worker holds a few partitions at once outside the
    run's budget. The budget is half of the room the worker had below Dask's
    spill fraction when it joined (:meth:`~mpshuffle.options.Options.host_budget`),
    the other half is for the worker's own data; partitions of an eighth of
    the budget keep those few within it. With 64 MiB partitions, workers of
    1 GiB (a budget of ~270 MB) passed Dask's pause fraction in an
    out-of-core rechunk, and a nanny restarted one at 95 %.

    Parameters
    ----------
    options
        The rechunk's options (``spill_host``).
    workers
        The scheduler's view of each worker (``scheduler_info()["workers"]``
        values): ``memory_limit`` in bytes (0 or missing: none) and
        ``metrics["memory"]``, the process's memory in bytes.

    Returns
    -------
    int
        Bytes, > 0.
    """
    import dask

    fractions = [dask.config.get(f"distributed.worker.memory.{k}", None) for k in ("spill", "pause")]
    known = [float(f) for f in fractions if f not in (None, False)]
    ceiling = min(known) if known else None
    budgets = []
    for w in workers:
        limit = int(w.get("memory_limit") or 0)
        in_use = int((w.get("metrics") or {}).get("memory") or 0)
        budget = options.host_budget(limit or None, ceiling=ceiling, in_use=in_use)
        if budget is not None:
            budgets.append(budget)
    if not budgets:
        return PARTITION_BYTES
    return max(2**20, min(PARTITION_BYTES, int(min(budgets) * PARTITION_BUDGET_FRACTION)))


def _pick(blocks: dict[int, Any], b: int) -> Any:
    """Output block ``b`` of its output partition's blocks."""
    return blocks[b]


def _take(block: Any, slices: tuple[slice, ...]) -> Any:
    """An output block that is one slice of one input block (a view, as Dask's own rechunk gives)."""
    return block[slices]


def _assemble(layout: tuple[tuple[tuple[slice, ...], tuple[int, ...]], ...], *blocks: Any) -> Any:
    """An output block made of slices of several input blocks, placed at their offsets.

    Raises
    ------
    ShuffleError
        If a block is not a plain ``numpy.ndarray`` (its mask or type would be lost).
    """
    for block in blocks:
        check_plain_block(block)
    parts = [block[slices] for block, (slices, _) in zip(blocks, layout, strict=True)]
    ndim = len(layout[0][0])
    extent = tuple(
        max(offsets[a] + part.shape[a] for part, (_, offsets) in zip(parts, layout, strict=True))
        for a in range(ndim)
    )
    out = np.empty(extent, dtype=parts[0].dtype)
    for part, (_, offsets) in zip(parts, layout, strict=True):
        out[tuple(slice(o, o + s) for o, s in zip(offsets, part.shape, strict=True))] = part
    return out


# -- install -------------------------------------------------------------

_state: dict[str, Any] = {}


def install() -> None:
    """Make ``"mpshuffle"`` a rechunk method of Dask arrays; idempotent.

    Wraps ``dask.array.rechunk.rechunk`` (also bound as ``dask.array.rechunk``)
    and, where Dask has them, the array expressions' ``Rechunk._lower``
    (which then refuses the method clearly); see the module docstring.
    Called by ``import mpshuffle.dask``.
    """
    if _state:
        return
    import dask.array as da

    module = sys.modules["dask.array.rechunk"]
    original = module.rechunk

    @functools.wraps(original)
    def dispatch(
        x: Any, chunks: Any = "auto", threshold: Any = None, block_size_limit: Any = None,
        balance: bool = False, method: Any = None,
    ) -> Any:
        if (method or dask.config.get("array.rechunk.method", None)) != METHOD:
            return original(x, chunks, threshold, block_size_limit, balance, method)
        return rechunk(x, chunks, threshold, block_size_limit, balance)

    module.rechunk = dispatch  # type: ignore[attr-defined]
    bound = getattr(da, "rechunk", None) is original
    if bound:
        da.rechunk = dispatch  # type: ignore[attr-defined]
    _state.update(module=module, original=original, bound=bound)
    try:
        from dask.array._array_expr._rechunk import Rechunk
    except ImportError:  # pragma: no cover - a dask without array expressions
        return
    lower = Rechunk.__dict__["_lower"]

    def _lower(self: Any) -> Any:
        if (self.method or dask.config.get("array.rechunk.method", None)) == METHOD:
            raise NotImplementedError(
                f"the rechunk method {METHOD!r} works on Dask's arrays without query planning; "
                "array.query-planning is on. Turn it off, or choose the 'tasks' method."
            )
        return lower(self)

    Rechunk._lower = _lower  # type: ignore[method-assign]
    _state.update(expr=Rechunk, expr_lower=lower)


def uninstall() -> None:
    """Restore Dask's own rechunk functions."""
    if not _state:
        return
    import dask.array as da

    _state["module"].rechunk = _state["original"]
    if _state["bound"]:
        da.rechunk = _state["original"]  # type: ignore[attr-defined]
    if "expr" in _state:
        _state["expr"]._lower = _state["expr_lower"]
    _state.clear()


def installed() -> bool:
    """Whether :func:`install` is in effect."""
    return bool(_state)
