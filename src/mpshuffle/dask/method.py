"""mpshuffle as a shuffle method of Dask's own DataFrame operations.

After ``import mpshuffle.dask``, one line switches Dask's shuffles to mpshuffle::

    dask.config.set({"dataframe.shuffle.method": "mpshuffle"})
    # or, per call: df.shuffle("k", shuffle_method="mpshuffle"),
    # df.merge(other, on="k", shuffle_method="mpshuffle"), ...

How Dask gets here
------------------
Every hash shuffle of dask-expr -- ``shuffle``, hash joins of ``merge`` and
``join``, ``groupby(...).agg(split_out=n)``, ``drop_duplicates(split_out=n)``
and the shuffle step of ``set_index``/``sort_values`` -- lowers to one
abstract expression, ``dask.dataframe.dask_expr._shuffle.Shuffle``, whose
``_lower`` picks a concrete shuffle by method name among names fixed inside
Dask and raises ``ValueError`` for any other. Dask has no registry for
external methods (requested in dask/dask#9521); like dask-cuda's
explicit-comms shuffle, :func:`install` wraps ``Shuffle._lower``: for the
method ``"mpshuffle"`` it returns :class:`MPShuffle`, for every other method
it calls Dask's own ``_lower`` unchanged.

Dask decides everything around the shuffle as it does for its own methods:
which rows go to which output partition, the sample and divisions of a sort,
and whether a merge is a broadcast join. Before a ``Shuffle`` Dask computes
a column ``_partitions``: the range of a sort's key, or, for hash shuffles,
its hash of the keys (an ``AssignPartitioningIndex`` step). mpshuffle moves
each row to the partition that column names -- except that for a hash
shuffle of pandas frames it shuffles the frame from before that step and
computes the same ids in its insert (:class:`~mpshuffle.dask.partitioning.DaskPartitioning`),
so the column is neither computed as a task of its own nor moved: each
extract appends it to its output partition ``j`` as the constant ``j``
(which it is), so the output is Dask's, column for column.
Either way a frame shuffled with ``tasks`` and one shuffled with mpshuffle
are partitioned alike. Dask's broadcast-join test only accepts its own method
names, so :func:`install` also wraps ``Merge.is_broadcast_join`` to answer
for ``"mpshuffle"`` as Dask answers for ``"tasks"``.

Supported versions
------------------
The lowering above was read and tested on dask :data:`SUPPORTED_DASK`
(``>= lower, < upper``, the range in ``pyproject.toml``). With another dask,
choosing the method raises :class:`UnsupportedDaskError` naming the
versions; it never falls back to another method silently.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, cast

import dask
import numpy as np

# Dask's base of its lowered shuffles (tasks, disk, p2p): a Shuffle that can
# compute a subset of its output partitions (PartitionsFiltered). Every dask
# of SUPPORTED_DASK has it (dask-expr is part of dask since 2025.1.0).
# The range starts at 2025.4.0: the first dask whose compute() goes through
# dask._collections and collections_to_expr, which the output collection
# (dataframe.py) and the tests rely on; on 2025.1.0 a worker lost mid-insert
# also failed the retried bootstrap. .ci/run runs tests on the oldest.
from dask.dataframe.dask_expr._expr import Blockwise as _Blockwise
from dask.dataframe.dask_expr._shuffle import SimpleShuffle as _Lowered

from mpshuffle.dask.partitioning import DaskPartitioning
from mpshuffle.errors import MPShuffleError

__all__ = [
    "METHOD",
    "SUPPORTED_DASK",
    "MPInsert",
    "MPShuffle",
    "UnsupportedDaskError",
    "check_dask_version",
    "install",
    "installed",
    "mpshuffle_expr",
    "uninstall",
]

METHOD = "mpshuffle"
"""The name to give ``dataframe.shuffle.method`` or ``shuffle_method``."""

SUPPORTED_DASK = ("2025.4.0", "2026.9.0")
"""Dask versions whose lowering this module knows: ``lower <= version < upper``."""

# Column Dask assigns before every Shuffle it builds: the output partition of each row.
_PARTITIONS = "_partitions"


class UnsupportedDaskError(MPShuffleError, RuntimeError):
    """The ``mpshuffle`` shuffle method was chosen on a dask whose lowering mpshuffle does not know."""


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit()) if not piece.isdigit() else piece
        if not digits:
            break
        parts.append(int(digits))
        if not piece.isdigit():  # 2026.9.0rc1, 2026.9.0+dev: stop at the first non-number
            break
    return tuple(parts)


def check_dask_version(version: str | None = None) -> None:
    """Raise unless ``version`` (default: the installed dask's) is in :data:`SUPPORTED_DASK`.

    Parameters
    ----------
    version
        A dask version string such as ``"2026.8.0"``.

    Raises
    ------
    UnsupportedDaskError
        If the version is outside ``[SUPPORTED_DASK[0], SUPPORTED_DASK[1])``,
        naming both and what to do.
    """
    version = dask.__version__ if version is None else version
    lower, upper = (_version_tuple(v) for v in SUPPORTED_DASK)
    if not lower <= _version_tuple(version) < upper:
        raise UnsupportedDaskError(
            f"the shuffle method {METHOD!r} supports dask >= {SUPPORTED_DASK[0]} and "
            f"< {SUPPORTED_DASK[1]} (the versions whose DataFrame lowering it was tested on); "
            f"the installed dask is {version}. Install a supported dask "
            f"(pip install 'dask>={SUPPORTED_DASK[0]},<{SUPPORTED_DASK[1]}'), or choose another "
            f"shuffle method, or call mpshuffle.dask.shuffle/merge/sort_values/set_index directly."
        )


class _ColumnIds:
    """Partitioner: the output partition of each row is the value of one column (Dask's ``_partitions``)."""

    def __init__(self, column: Any) -> None:
        self.column = column

    def __call__(self, frame: Any) -> Any:
        return np.asarray(frame[self.column], dtype=np.int64)

    def __dask_tokenize__(self) -> tuple[str, Any]:
        return ("mpshuffle._ColumnIds", self.column)

    def __repr__(self) -> str:
        return f"_ColumnIds({self.column!r})"


def _expr_classes() -> tuple[Any, Any, Any]:
    from dask.dataframe.dask_expr._merge import Merge
    from dask.dataframe.dask_expr._shuffle import Shuffle, ShuffleBase

    return Shuffle, ShuffleBase, Merge


_SHUFFLE_PARAMETERS = [
    "frame",
    "partitioning_index",
    "npartitions_out",
    "ignore_index",
    "options",
    "original_partitioning_index",
    "_partitions",
    "mpshuffle_options",
    "partitioning",
    "output_columns",
]
_SHUFFLE_DEFAULTS = {
    "ignore_index": False,
    "options": None,
    "original_partitioning_index": None,
    "_partitions": None,
    "mpshuffle_options": None,
    "partitioning": None,
    "output_columns": None,
}


class MPInsert(_Blockwise):  # type: ignore[misc, valid-type]
    """The insert tasks of one :class:`MPShuffle`: one per input partition, each returning an ``Inserted``.

    Parameters (operands)
    ---------------------
    frame
        The expression to shuffle (the frame before the shuffle).
    partitioning_index, npartitions_out, ignore_index, options, original_partitioning_index, mpshuffle_options, partitioning, output_columns
        The shuffle's, as :class:`MPShuffle` documents them.

    Notes
    -----
    A ``Blockwise`` expression, so that Dask's blockwise fusion
    (``optimize_blockwise_fusion``) runs each insert in the task that makes
    its input partition, where that input is a blockwise expression used by
    nothing else (a ``map_partitions``, ``from_map``, ``read_parquet``, an
    ``assign``...): ``n`` tasks fewer for ``n`` input partitions, the
    scheduler's round trip per task and the input's hand-over in worker
    memory saved. Dask then names the fused task by its own rule (e.g.
    ``frommap-mpshuffle-<token>``); unfused, the key is
    ``mpshuffle-insert-<token>``. The barrier depends on whichever keys
    the graph has. ``_meta`` is the input's: the expression stands for the
    input's partitions in Dask's plan, and nothing but its
    :class:`MPShuffle` reads it (its tasks return ``Inserted`` records).
    The :class:`~mpshuffle.dask.graph.ShuffleSpec` is built from the
    operands where the graph is materialized (the scheduler).
    """

    _parameters = [p for p in _SHUFFLE_PARAMETERS if p != "_partitions"]  # noqa: RUF012
    _defaults = {k: v for k, v in _SHUFFLE_DEFAULTS.items() if k != "_partitions"}  # noqa: RUF012

    def __str__(self) -> str:
        return f"MPInsert({self._name[-7:]})"

    @functools.cached_property
    def _shuffle_token(self) -> str:
        from dask.base import tokenize

        return tokenize(self.frame._name, *[self.operand(p) for p in self._parameters[1:]])

    @functools.cached_property
    def _name(self) -> str:
        return f"{METHOD}-insert-{self._shuffle_token}"

    @functools.cached_property
    def _meta(self) -> Any:
        return self.frame._meta

    def _divisions(self) -> Any:
        return self.frame.divisions

    def _simplify_up(self, parent: Any, dependents: Any) -> None:
        return None  # only its MPShuffle uses it

    def _simplify_down(self) -> None:
        return None

    @functools.cached_property
    def _output_meta(self) -> Any:
        """The shuffle's output meta: the input's, Dask's ids appended where it has them, ``output_columns`` applied."""
        partitioning = self.operand("partitioning")
        meta = self.frame._meta
        if partitioning is not None:
            # As after Dask's AssignPartitioningIndex: the ids as the last column.
            meta = _with_ids(meta, 0, partitioning.ids_dtype)
        columns = self.operand("output_columns")
        return meta if columns is None else meta[list(columns)]

    @functools.cached_property
    def _keeps_index(self) -> bool:
        # Dask's meta keeps the index for every method but tasks. With
        # ignore_index a default RangeIndex need not travel (Dask documents
        # that its values may be lost): each output partition gets a fresh
        # RangeIndex, of the meta's type. Any other index travels.
        import pandas as pd

        index = self._output_meta.index
        return not (self.ignore_index and isinstance(index, pd.RangeIndex) and index.name is None)

    @functools.cached_property
    def _partitioner(self) -> Any:
        partitioner = self.operand("partitioning")
        if partitioner is None and list(self._partitioning_index) == [_PARTITIONS]:
            return _ColumnIds(_PARTITIONS)
        return partitioner

    @functools.cached_property
    def _partitioning_index(self) -> list[Any]:
        index = self.partitioning_index
        return [index] if isinstance(index, (str, int)) else list(index)

    @functools.cached_property
    def _ids_dtype(self) -> str | None:
        """The dtype (``numpy`` ``str``) of ``_partitions`` where it is Dask's ids, else ``None``.

        Output partition ``j``'s ``_partitions`` values are all ``j``: where
        the column is Dask's ids (a hash computed in the insert, or a sort's
        ranges as the frame's last column), it does not travel and each
        extract appends it as that constant, when the output has it.
        """
        partitioner = self._partitioner
        if partitioner is not None and partitioner is self.operand("partitioning"):
            return str(partitioner.ids_dtype.str)
        columns = list(self.frame._meta.columns)
        if (
            isinstance(partitioner, _ColumnIds)
            and columns[-1:] == [_PARTITIONS]
            and columns.count(_PARTITIONS) == 1
            and isinstance(self.frame._meta[_PARTITIONS].dtype, np.dtype)
            and self.frame._meta[_PARTITIONS].dtype.kind in "iu"
        ):
            return str(self.frame._meta[_PARTITIONS].dtype.str)
        return None

    @property
    def appended_ids_dtype(self) -> str | None:
        """The dtype of the ``_partitions`` column each extract appends (see ``_ids_dtype``), or ``None``."""
        return self._ids_dtype if _PARTITIONS in self._output_meta.columns else None

    @functools.cached_property
    def spec(self) -> Any:
        """The shuffle's :class:`~mpshuffle.dask.graph.ShuffleSpec`, which every task of it carries."""
        from mpshuffle.dask.graph import shuffle_spec
        from mpshuffle.options import Options

        # Built where Dask materializes the graph (the scheduler, since dask
        # 2025.3): the options come from the expression, resolved on the
        # client by _lower, never from this process's configuration.
        chosen = self.operand("mpshuffle_options")
        options = Options(**chosen) if chosen is not None else None
        on = self._partitioning_index
        if self.operand("partitioning") is not None:
            on = on or ["_index"]  # a shuffle on the index; not read with a partitioner
        dropped = self._ids_dtype is not None
        columns = list(self._output_meta.columns)
        select: list[Any] | None = [c for c in columns if not (dropped and c == _PARTITIONS)]
        meta = self.frame._meta[select]
        if select == list(self.frame._meta.columns):
            select = None  # every column travels
        return shuffle_spec(
            on=on,
            npartitions=self.npartitions_out,
            meta=meta,
            select=select,
            keep_index=self._keeps_index,
            name=METHOD,
            token=self._shuffle_token,
            partitioner=self._partitioner,
            on_lossy_cast="keep",
            options=options,
            # Checked against the client's mpshuffle.max-npartitions by _lower.
            npartitions_limit=sys.maxsize,
        )

    def _task(self, name: Any, index: int) -> Any:
        from dask._task_spec import Task, TaskRef

        from mpshuffle.dask.graph import insert

        # The spec comes from the shuffle's start task (graph.started): one root for all inserts.
        return Task(name, insert, TaskRef(self._input_key(index)), index, TaskRef(self.spec.start_name))

    @functools.cached_property
    def _persisted_keys(self) -> list[Any] | None:
        """The keys a persisted input's partitions are held under, or ``None`` (see :meth:`_input_key`)."""
        from dask.dataframe.dask_expr.io.io import FromGraph

        frame = self.frame
        return list(frame.operand("keys")) if isinstance(frame, FromGraph) else None

    def _input_key(self, index: int) -> Any:
        """The key of input partition ``index`` that insert ``index`` reads.

        A persisted collection enters an expression as Dask's ``FromGraph``,
        whose partitions are named anew and point to the held results through
        one ``Alias`` task each: a task per input partition for the
        scheduler and the worker to run, which does nothing (the config line
        on a persisted 60-partition frame ran 182 tasks instead of 122).
        The inserts read the held keys themselves; the aliases then have no
        dependent and the scheduler never runs them.
        """
        keys = self._persisted_keys
        return keys[index] if keys is not None else (self.frame._name, index)


class MPShuffle(_Lowered):  # type: ignore[misc, valid-type]
    """A lowered Dask shuffle whose tasks are mpshuffle's insert, barrier and extract tasks.

    Parameters (operands)
    ---------------------
    frame
        The shuffle's :class:`MPInsert` (or, once Dask fused it into its
        input's tasks, the ``Fused`` expression whose first member it is);
        its own ``frame`` is the expression to shuffle (a DataFrame; Dask
        turns Series into frames before its shuffles). Build the pair with
        :func:`mpshuffle_expr`. The operands below are the insert's too,
        which the tasks follow.
    partitioning_index
        ``"_partitions"`` (Dask's column of output partition ids: each row
        goes to the partition it names), or key columns hashed by
        mpshuffle's hash.
    npartitions_out
        Number of output partitions; may be smaller or larger than the
        input's (no repartition step is needed).
    ignore_index
        With ``True``, an unnamed ``RangeIndex`` (the meta's) does not travel:
        each output partition gets a fresh ``RangeIndex`` (Dask documents
        that the index values may be lost). Any other index travels either
        way: Dask's abstract shuffle keeps the index in its meta for every
        method but ``tasks``, and its tests expect the methods other than
        ``tasks`` to keep it (as ``p2p`` and ``disk`` do).
    options
        Accepted for Dask's signature (Dask's own shuffle options).
    original_partitioning_index
        The keys Dask hashed into ``_partitions`` (tells later merges the
        output is partitioned on them).
    _partitions
        The output partitions to compute (Dask's ``df.partitions[...]``), or
        ``None`` for all.
    mpshuffle_options
        mpshuffle's options as a dict, resolved from the client's
        ``dask.config`` where Dask lowers the expression (on the client,
        before the graph goes to the scheduler, which builds the tasks);
        part of the shuffle's token.
    partitioning
        ``None``, or the :class:`~mpshuffle.dask.partitioning.DaskPartitioning`
        that computes Dask's ids in the insert; ``frame`` is then the frame
        before Dask's ``AssignPartitioningIndex`` and ``partitioning_index``
        the keys Dask hashes.
    output_columns
        ``None`` (every column), or the output's columns, a subset of them in
        their order: the Projection that Dask puts after every Shuffle (it
        drops ``_partitions``) absorbed by :meth:`_simplify_up` where it
        would be a ``getitem`` task per output partition (one feeding a
        blockwise expression stays, fused into that one's tasks). The
        inserts compute the rows' partitions first, then send only these
        columns; ``_partitions``, where it is Dask's ids, never travels (each
        extract appends it as the constant it is).

    Notes
    -----
    The graph has :func:`mpshuffle.dask.shuffle_graph`'s shape, built from
    :func:`~mpshuffle.dask.graph.output_tasks` here and the inserts'
    own tasks: one insert task per input partition (:class:`MPInsert`'s, keyed
    ``mpshuffle-insert-<token>`` unless fused into the input's tasks), one
    barrier, one extract task per output partition, keyed
    ``mpshuffle-barrier-<token>`` and ``mpshuffle-extract-<token>`` (another token once the inserts are fused, see ``_extracts``). Without
    a partition filter the last is this expression's name, so its
    partitions are the extract tasks themselves; with one, only the chosen
    extract tasks are in the graph and the expression's keys alias them.
    Extracts keep a column's dtype where the data does not fit Dask's meta
    (as Dask's shuffles do) instead of raising.
    """

    _parameters = _SHUFFLE_PARAMETERS
    _defaults = _SHUFFLE_DEFAULTS
    _filter_passthrough = False  # Dask pushed filters below the abstract Shuffle already

    def __str__(self) -> str:
        return f"MPShuffle({self._name[-7:]})"

    @functools.cached_property
    def _inserts(self) -> MPInsert:
        frame = self.frame
        if isinstance(frame, MPInsert):
            return frame
        exprs = getattr(frame, "exprs", None)  # Dask's Fused: its first member is the group's top
        if exprs and isinstance(exprs[0], MPInsert):
            return cast(MPInsert, exprs[0])
        raise TypeError(f"MPShuffle's frame must be its MPInsert, got {type(frame).__name__}")

    @property
    def _source(self) -> Any:
        """The expression shuffled (the insert's input)."""
        return self._inserts.frame

    @property
    def _shuffle_token(self) -> str:
        # The shuffle itself, whichever of its outputs this expression keeps.
        return self._inserts._shuffle_token

    @functools.cached_property
    def _name(self) -> str:
        if self._filtered:
            from dask.base import tokenize

            return f"{METHOD}-partitions-{tokenize(self._extracts, self.operand('_partitions'))}"
        return self._extracts

    @functools.cached_property
    def _extracts(self) -> str:
        """The extract tasks' key name: the spec's, or, with the inserts fused, one that follows the fused input's name.

        Dask keeps one expression object per name: the shuffle over the
        fused inserts must be named apart from the one over the unfused.
        """
        if self.frame is self._inserts:
            return f"{METHOD}-extract-{self._shuffle_token}"
        from dask.base import tokenize

        return f"{METHOD}-extract-{tokenize(self._shuffle_token, self.frame._name)}"

    @functools.cached_property
    def _meta(self) -> Any:
        return self._inserts._output_meta

    def _node_label_args(self) -> list[Any]:
        return [self._source, self.partitioning_index]

    def _simplify_up(self, parent: Any, dependents: Any) -> Any:
        from dask.dataframe.dask_expr._expr import Projection

        # Dask's other rewrites of a shuffle (a reduction or a filter moved
        # below it) ran on the abstract Shuffle before it was lowered; they
        # would read this expression's frame, the inserts, as the data.
        if isinstance(parent, Projection):
            return self._absorb_projection(parent, dependents)
        return None

    def _absorb_projection(self, parent: Any, dependents: Any) -> Any:
        """This shuffle sending only the columns that its dependents select, or ``None``.

        Dask runs its simplification again after lowering (``optimize_until``):
        the Projection that Dask's lowering puts after every Shuffle then
        meets this expression. The columns that all dependents use (Dask's
        ``determine_column_projection``) become ``output_columns``, in the
        output's order; a parent that selects exactly those is replaced by
        the shuffle itself, any other keeps its Projection on top. Only a
        Projection that would be a task of its own is absorbed: one that
        feeds a blockwise expression is fused into that one's tasks.
        """
        from dask.dataframe.dask_expr._expr import Blockwise, determine_column_projection

        users = [ref() for ref in dependents.get(parent._name, ())]
        if any(isinstance(user, Blockwise) for user in users):
            # Dask fuses the Projection into its blockwise user's task (a
            # merge's, say): it costs no task there, and Dask's plan keeps
            # its shape.
            return None
        wanted = determine_column_projection(self, parent, dependents)
        wanted_set = set(wanted if isinstance(wanted, list) else [wanted])
        current = list(self._meta.columns)
        kept = [c for c in current if c in wanted_set]
        if not kept or len(kept) == len(current) or len(set(current)) != len(current):
            return None
        inserts = self._inserts
        own_hash = inserts.operand("partitioning") is None and inserts._partitioning_index != [_PARTITIONS]
        if own_hash and not set(inserts._partitioning_index) <= set(kept):
            # mpshuffle's own hash reads the key columns in the pass that
            # splits the frame: they must travel.
            return None
        shuffle = self.with_output_columns(kept)
        if parent.operand("columns") == kept:
            return shuffle
        return type(parent)(shuffle, *parent.operands[1:])

    def with_output_columns(self, columns: list[Any]) -> MPShuffle:
        """This shuffle (its inserts too) with ``output_columns`` ``columns``, a subset of its output's in order."""
        operands = {p: self.operand(p) for p in self._parameters[1:]}
        operands["output_columns"] = list(columns)
        return mpshuffle_expr(self._source, **operands)

    def _lower(self) -> None:
        return None

    def _layer(self) -> dict[Any, Any]:
        from mpshuffle.dask.graph import output_tasks, started

        inserts = self._inserts
        spec = inserts.spec
        graph, keys = output_tasks(
            spec, [(self.frame._name, i) for i in range(self.frame.npartitions)], extract_name=self._extracts
        )
        graph[spec.start_name] = (started, spec)
        ids_dtype = inserts.appended_ids_dtype
        if ids_dtype is not None:
            for j, key in enumerate(keys):
                _, barrier_name, _, spec = graph[key]
                graph[key] = (_extract_with_ids, barrier_name, j, spec, ids_dtype)
        if not self._filtered:
            return graph
        # Extract tasks keep their keys (extract-name, j): the scheduler plugin
        # places output partition j by that j.
        wanted = set(self._partitions)
        for j, key in enumerate(keys):
            if j not in wanted:
                del graph[key]
        for i, j in enumerate(self._partitions):
            graph[(self._name, i)] = _alias((self._name, i), keys[j])
        return graph


def mpshuffle_expr(frame: Any, *args: Any, **operands: Any) -> MPShuffle:
    """The :class:`MPShuffle` of ``frame`` over its :class:`MPInsert`; operands as :class:`MPShuffle`'s, after ``frame``.

    Raises
    ------
    TypeError
        For an operand name that :class:`MPShuffle` does not have.
    """
    names = _SHUFFLE_PARAMETERS[1:]
    given = dict(zip(names, args, strict=False))
    unknown = set(operands) - set(names)
    if unknown:
        raise TypeError(f"unknown MPShuffle operand(s): {sorted(unknown)}")
    given.update(operands)
    values = [given.get(p, _SHUFFLE_DEFAULTS.get(p)) for p in names]
    inserts = MPInsert(frame, *[v for p, v in zip(names, values, strict=True) if p != "_partitions"])
    return MPShuffle(inserts, *values)


def _with_ids(frame: Any, partition_id: int, dtype: Any) -> Any:
    return frame.assign(**{_PARTITIONS: np.full(len(frame), partition_id, dtype=dtype)})


def _extract_with_ids(run: Any, partition_id: int, spec: Any, dtype: str) -> Any:
    """Task: output partition ``partition_id``, with Dask's ``_partitions`` column (all ``partition_id``)."""
    from mpshuffle.dask.graph import extract

    return _with_ids(extract(run, partition_id, spec), partition_id, dtype)


def _before_partitioning(shuffle: Any) -> tuple[Any, Any, DaskPartitioning | None]:
    """The frame to shuffle, its keys and the partitioner, for a Shuffle by Dask's ``_partitions``.

    A hash shuffle's frame is Dask's ``AssignPartitioningIndex`` of the frame
    before it: then that frame, the keys Dask hashes and a
    :class:`DaskPartitioning` that computes the same ids in the insert.
    Otherwise (a sort's ranges, keys given as an expression, a Series, cudf
    frames) the Shuffle's own frame and partitioning index, and ``None``.
    """
    import pandas as pd
    from dask.dataframe.dask_expr._expr import Expr
    from dask.dataframe.dask_expr._shuffle import AssignPartitioningIndex

    frame = shuffle.frame
    unchanged = (frame, shuffle.partitioning_index, None)
    if type(frame) is not AssignPartitioningIndex or shuffle._partitioning_index != [_PARTITIONS]:
        return unchanged
    keys = frame.operand("partitioning_index")
    before = frame.frame
    if (
        frame.operand("index_name") != _PARTITIONS
        or frame.operand("npartitions_out") != shuffle.npartitions_out
        or isinstance(keys, Expr)
        or not isinstance(before._meta, pd.DataFrame)
        or not isinstance(frame.operand("meta"), pd.DataFrame)
    ):
        return unchanged
    keys = list(keys) if isinstance(keys, (list, tuple)) else [keys]
    partitioning = DaskPartitioning(
        keys, shuffle.npartitions_out, frame.operand("meta"), bool(frame.operand("index_shuffle"))
    )
    return before, keys, partitioning


def _alias(key: Any, target: Any) -> Any:
    try:
        from dask._task_spec import Alias
    except ImportError:  # pragma: no cover - older dask: a legacy graph's alias
        return target
    return Alias(key, target)



_state: dict[str, Any] = {}


def _resolved(method: Any) -> Any:
    if method:
        return method
    from dask.utils import get_default_shuffle_method

    return get_default_shuffle_method()


def install() -> None:
    """Make ``"mpshuffle"`` a shuffle method of dask-expr; idempotent.

    Wraps ``Shuffle._lower`` and ``Merge.is_broadcast_join`` (see the module
    docstring); other methods reach Dask's own code unchanged. Called by
    ``import mpshuffle.dask``.

    Notes
    -----
    Every dask that ``pyproject.toml`` allows has ``dask.dataframe.dask_expr``;
    a dask without it fails at ``import mpshuffle.dask`` with an ImportError.
    """
    if _state:
        return
    Shuffle, _, Merge = _expr_classes()
    original_lower = Shuffle.__dict__["_lower"]
    original_broadcast = Merge.__dict__["is_broadcast_join"]

    def _lower(self: Any) -> Any:
        if _resolved(self.method) != METHOD:
            return original_lower(self)
        check_dask_version()
        from mpshuffle.dask.dataframe import graph_options
        from mpshuffle.dask.graph import check_npartitions

        # Here, on the client, with the user's dask.config: the graph's tasks
        # are built on the scheduler, whose configuration is not the user's.
        check_npartitions(self.npartitions_out)
        frame, partitioning_index, partitioning = _before_partitioning(self)
        return mpshuffle_expr(
            frame,
            partitioning_index,
            self.npartitions_out,
            self.ignore_index,
            self.options,
            self.original_partitioning_index,
            None,
            # The client's, decided here (see MPShuffle); with a running
            # synchronous client the generation bootstraps now, while the
            # graph is built, as for mpshuffle's own functions.
            graph_options().as_dict(),
            partitioning,
        )

    def is_broadcast_join(self: Any) -> bool:
        if _resolved(self.shuffle_method) == METHOD:
            # Dask's test lists only its own methods; answer as it does for tasks.
            self = self.substitute_parameters({"shuffle_method": "tasks"})
        return bool(original_broadcast.func(self))

    def prop(func: Any, cls: Any, name: str) -> Any:
        p = functools.cached_property(func)
        p.__set_name__(cls, name)
        return p

    _lower.__doc__ = original_lower.__doc__
    Shuffle._lower = _lower
    Merge.is_broadcast_join = prop(is_broadcast_join, Merge, "is_broadcast_join")
    _state.update(
        shuffle=Shuffle, lower=original_lower, merge=Merge, broadcast=original_broadcast
    )


def uninstall() -> None:
    """Restore Dask's own ``Shuffle._lower`` and ``Merge.is_broadcast_join``."""
    if not _state:
        return
    _state["shuffle"]._lower = _state["lower"]
    _state["merge"].is_broadcast_join = _state["broadcast"]
    _state.clear()


def installed() -> bool:
    """Whether :func:`install` is in effect."""
    return bool(_state)


