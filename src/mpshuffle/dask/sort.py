"""Sorts of dask DataFrames: range partitioning from sampled quantiles, then a local sort.

1. A sample of the key column (up to ``sample_size`` non-null values per input
   partition, drawn with pandas' ``Series.sample``) and its global minimum and
   maximum are computed with Dask — one pass over the input, as Dask's own
   ``set_index`` and ``sort_values`` make. Where that cannot happen while the
   graph is built (on the event loop of an asynchronous Client, where
   ``dask.compute`` would have to block the loop it needs), the sample and
   the boundaries become tasks of the graph instead (see
   :func:`_deferred_range_shuffle`): the same sample, the same boundaries, so
   the same rows in the same partitions.
2. Boundaries ``b_0 < ... < b_{k-1}`` split the sorted distinct sampled
   values into ranges of about equal weight (each sampled value weighs the
   rows of its partition it stands for), greedily. A value heavier than a
   range's share (a skewed key) gets a range of its own and the rest are
   re-split over the remaining ranges, so skewed keys spread over several
   partitions whenever their distinct values allow; one value's rows always
   stay together.
3. mpshuffle shuffles the rows with :class:`RangePartitioner` (row ``x`` goes
   to ``searchsorted(b, x, side="right")``; nulls to the last partition, or
   the first with ``na_position="first"``) instead of the hash, and each
   output partition is sorted locally.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
from dask.base import tokenize

from mpshuffle.dask._checks import frame_type_error
from mpshuffle.dask.dataframe import _collection, _skip_aliases, graph_options
from mpshuffle.dask.graph import check_npartitions, shuffle_graph

__all__ = ["RangePartitioner", "set_index", "sort_values"]

#: Sampled non-null keys per input partition.
DEFAULT_SAMPLE_SIZE = 1000


@dataclasses.dataclass(frozen=True)
class RangePartitioner:
    """Map each row of a pandas frame to its range partition (picklable).

    Attributes
    ----------
    column
        The key column.
    bounds
        Sorted, distinct boundaries ``b_0 < ... < b_{k-1}`` (a ``pandas.Index``
        of the key's dtype); there are ``k + 1`` partitions.
    ascending
        ``False`` numbers the partitions from the largest values down.
    na_first
        Nulls go to the first partition instead of the last.
    """

    column: Any
    bounds: pd.Index
    ascending: bool = True
    na_first: bool = False

    @property
    def npartitions(self) -> int:
        """Number of output partitions, ``len(bounds) + 1``."""
        return len(self.bounds) + 1

    def __call__(self, frame: pd.DataFrame) -> np.ndarray:
        """Return the ``int64`` partition id of each row, shape ``(n,)``."""
        column = frame[self.column]
        null = column.isna().to_numpy()
        ids = np.empty(len(column), dtype=np.int64)
        ids[null] = 0 if self.na_first else self.npartitions - 1
        valid = ~null
        if valid.any():
            pos = np.asarray(
                self.bounds.searchsorted(column[valid].array, side="right"), dtype=np.int64
            )
            ids[valid] = pos if self.ascending else len(self.bounds) - pos
        return ids


def sort_values(
    df: dd.DataFrame,
    by: Hashable | Sequence[Hashable],
    ascending: bool | Sequence[bool] = True,
    *,
    na_position: str = "last",
    npartitions: int | None = None,
    sample_size: int = DEFAULT_SAMPLE_SIZE,
) -> dd.DataFrame:
    """Sort a dask DataFrame by one or more columns through mpshuffle.

    Parameters
    ----------
    df
        The collection (pandas partitions).
    by
        Column name or names; rows are range partitioned on the first, and
        each output partition is sorted by all of them.
    ascending
        One bool, or one per column of ``by`` (as ``pandas.sort_values``).
    na_position
        ``"last"`` (default) or ``"first"``: where rows with a null first key go.
    npartitions
        Target number of output partitions; by default ``df.npartitions``.
        Never more come out; fewer when the key has too few distinct sampled
        values or heavy keys (one value's rows are never split).
    sample_size
        Non-null key values sampled per input partition.

    Returns
    -------
    dask.dataframe.DataFrame
        Partitions in order: concatenated, they are sorted by ``by`` (ties in
        the first key are in one partition). The index travels with the rows;
        divisions are unknown (the index is not the sort key).

    Raises
    ------
    TypeError
        If ``df`` is not a dask DataFrame.
    KeyError
        If a column of ``by`` is missing.
    ValueError
        If ``by`` is empty, ``ascending`` has the wrong length, ``na_position``
        is not ``"first"``/``"last"``, or ``npartitions`` < 1.

    Notes
    -----
    The sample is computed eagerly (the input is read once for it and once
    for the shuffle). On the event loop of an asynchronous Client it is
    computed with the result instead: the sample and the boundaries are
    tasks of the graph, the input is read once and held in the cluster's
    memory until the boundaries are known, and there are exactly
    ``npartitions`` output partitions (those past the last boundary empty).
    See the module docstring for the algorithm.
    """
    _check_frame(df, "sort_values")
    by = _as_list(by)
    if not by:
        raise ValueError("sort_values needs at least one column in 'by'")
    _check_columns(df, by, "sort_values")
    asc = (
        [bool(ascending)] * len(by) if isinstance(ascending, (bool, np.bool_)) else list(ascending)
    )
    if len(asc) != len(by):
        raise ValueError(
            f"sort_values: ascending has {len(asc)} values for {len(by)} columns of 'by'"
        )
    if na_position not in ("first", "last"):
        raise ValueError(f"sort_values: na_position must be 'first' or 'last', got {na_position!r}")
    df = df.optimize()
    target = _target(df, npartitions)
    na_first = na_position == "first"
    if _sample_now():
        bounds, _, _ = _boundaries(df, by[0], target, sample_size)
        partitioner = RangePartitioner(by[0], bounds, asc[0], na_first)
        extract_keys, graph = _range_shuffle(df, partitioner, keep_index=True)
        hidden = None
    else:
        extract_keys, graph, hidden = _deferred_range_shuffle(
            df, by[0], target, sample_size, asc[0], na_first, keep_index=True
        )
    name = "mpshuffle-sort-" + tokenize(extract_keys, by, asc, na_position)
    keys = []
    for j, key in enumerate(extract_keys):
        graph[(name, j)] = (_sort_partition, key, by, asc, na_position, hidden)
        keys.append((name, j))
    return _collection(graph, df._meta, len(keys), keys)


def set_index(
    df: dd.DataFrame,
    column: Hashable,
    *,
    drop: bool = True,
    npartitions: int | None = None,
    sample_size: int = DEFAULT_SAMPLE_SIZE,
) -> dd.DataFrame:
    """Make a column the sorted index of a dask DataFrame, with known divisions.

    Parameters
    ----------
    df
        The collection (pandas partitions).
    column
        The column that becomes the index.
    drop
        Remove the column from the columns (as ``pandas.set_index``).
    npartitions
        Target number of output partitions (see :func:`sort_values`).
    sample_size
        Non-null key values sampled per input partition.

    Returns
    -------
    dask.dataframe.DataFrame
        Sorted by index, with divisions ``(min, b_0, ..., b_{k-1}, max)``:
        partition ``i`` holds the index values in ``[div_i, div_{i+1})``, the
        last one ``[div_{k}, max]``. Null keys go to the last partition,
        after ``max`` (as pandas sorts them); with only null keys, or no rows,
        there is one partition and divisions are unknown. On the event loop
        of an asynchronous Client the divisions are unknown (they would have
        to be computed before this function returns, which would block the
        loop the computation needs): the partitions are sorted and in order
        all the same, as :func:`sort_values` describes for that case.

    Raises
    ------
    TypeError
        If ``df`` is not a dask DataFrame.
    KeyError
        If ``column`` is missing.
    ValueError
        If ``npartitions`` < 1.
    """
    _check_frame(df, "set_index")
    _check_columns(df, [column], "set_index")
    df = df.optimize()
    target = _target(df, npartitions)
    if _sample_now():
        bounds, lo, hi = _boundaries(df, column, target, sample_size)
        partitioner = RangePartitioner(column, bounds)
        extract_keys, graph = _range_shuffle(df, partitioner, keep_index=False)
        hidden = None
    else:
        extract_keys, graph, hidden = _deferred_range_shuffle(
            df, column, target, sample_size, True, False, keep_index=False
        )
        lo = None
    name = "mpshuffle-set-index-" + tokenize(extract_keys, column, drop)
    keys = []
    for j, key in enumerate(extract_keys):
        graph[(name, j)] = (_set_index_partition, key, column, drop, hidden)
        keys.append((name, j))
    meta = df._meta.set_index(column, drop=drop)
    if lo is None:
        divisions: tuple[Any, ...] = (None,) * (len(keys) + 1)
    else:
        # Plain Python scalars throughout: the min and max come back as NumPy
        # scalars, the bounds as Python ones (tolist()); a mix compares and
        # prints oddly ((np.int64(1), 3, np.int64(4))).
        lo, hi = (x.item() if isinstance(x, np.generic) else x for x in (lo, hi))
        divisions = (lo, *bounds.tolist(), hi)
    return _collection(graph, meta, len(keys), keys, divisions)


# -- helpers -------------------------------------------------------------


def _check_frame(df: Any, what: str) -> None:
    if not isinstance(df, dd.DataFrame):
        raise frame_type_error(f"{what} expects a dask DataFrame", df)


def _check_columns(df: dd.DataFrame, columns: list[Any], what: str) -> None:
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise KeyError(
            f"{what}: column(s) {missing!r} not in the DataFrame's columns {list(df.columns)!r}"
        )


def _as_list(keys: Any) -> list[Any]:
    if isinstance(keys, (str, bytes, int)) or not isinstance(keys, Sequence):
        return [keys]
    return list(keys)


def _target(df: dd.DataFrame, npartitions: int | None) -> int:
    # Checked before the sample is computed, so a bad value costs nothing.
    return check_npartitions(df.npartitions if npartitions is None else npartitions)


def _sample(part: pd.DataFrame, column: Any, size: int) -> pd.DataFrame:
    values = part[column].dropna()
    n = len(values)
    if n > size:
        # A fixed seed keeps the boundaries (and so the graph) reproducible.
        values = values.sample(n=size, random_state=0)
    # Each sampled value stands for n / len(sample) rows of its partition.
    weight = n / len(values) if len(values) else 0.0
    return pd.DataFrame({"value": values.reset_index(drop=True), "weight": weight})


def _boundaries(
    df: dd.DataFrame, column: Any, npartitions: int, sample_size: int
) -> tuple[pd.Index, Any, Any]:
    """Return the range boundaries and the key's global min and max (``None`` if no values)."""
    key = df[column]
    values_meta = df._meta[column].iloc[:0].reset_index(drop=True)
    meta = pd.DataFrame({"value": values_meta, "weight": pd.Series([], dtype="float64")})
    sample, lo, hi = dask.compute(
        df.map_partitions(_sample, column, max(int(sample_size), 1), meta=meta),
        key.min(),
        key.max(),
    )
    bounds = _bounds_from_sample(sample, lo, values_meta, npartitions)
    if len(sample) == 0 or pd.isna(lo):
        return bounds, None, None
    return bounds, lo, hi


def _bounds_from_sample(
    sample: pd.DataFrame, lo: Any, values_meta: pd.Series, npartitions: int
) -> pd.Index:
    """The boundaries from the concatenated samples and the key's global minimum ``lo``."""
    if len(sample) == 0 or pd.isna(lo):
        return pd.Index(values_meta)
    weights = sample.groupby("value", sort=True, observed=True)["weight"].sum()
    bounds = _split_points(list(weights.index), weights.to_numpy(), npartitions)
    return pd.Index([b for b in bounds if b > lo], dtype=values_meta.dtype)


def _split_points(values: list[Any], weights: Any, npartitions: int) -> list[Any]:
    """Greedy equal-weight ranges over sorted distinct ``values``; returns the range starts.

    Walks the values keeping the current range's weight near
    ``remaining weight / remaining ranges``. A value at least that heavy gets a
    range of its own (closed before and after it), and the target is then
    recomputed over what is left, so the other values still spread over the
    remaining ranges. At most ``npartitions`` ranges; a value never spans two.
    """
    bounds: list[Any] = []
    remaining, parts = float(weights.sum()), int(npartitions)
    target = remaining / parts
    acc = 0.0

    def close(at: Any) -> None:
        nonlocal remaining, parts, target, acc
        bounds.append(at)
        remaining -= acc
        parts -= 1
        target = remaining / max(parts, 1)
        acc = 0.0

    for i, (value, weight) in enumerate(zip(values, weights, strict=True)):
        # Start a new range before this value if that lands nearer the target.
        if acc > 0 and parts > 1 and acc + weight - target > target - acc:
            close(value)
        acc += weight
        if parts > 1 and acc >= target and i + 1 < len(values):
            close(values[i + 1])
    return bounds


def _range_shuffle(
    df: dd.DataFrame, partitioner: RangePartitioner, keep_index: bool
) -> tuple[list[Any], dict[Any, Any]]:
    options = graph_options()
    meta = df._meta if keep_index else df._meta.reset_index(drop=True)
    token = tokenize(df._name, partitioner, keep_index, options.as_dict())
    graph = dict(df.__dask_graph__())
    layer, keys = shuffle_graph(
        _skip_aliases(graph, df.__dask_keys__()),
        on=[partitioner.column],
        npartitions=partitioner.npartitions,
        meta=meta,
        keep_index=keep_index,
        name="mpshuffle-range",
        token=token,
        partitioner=partitioner,
        options=options,
    )
    graph.update(layer)
    return keys, graph


def _sample_now() -> bool:
    """Whether the sample can be computed while the graph is built.

    Not on the event loop of an asynchronous Client: ``dask.compute`` refuses
    to block the loop that would have to run the computation (Dask raises
    ``RuntimeError`` there).
    """
    scheduler = dask.config.get("scheduler", None)
    if scheduler is not None and scheduler not in ("dask.distributed", "distributed"):
        # A named local scheduler, or a Client object given as the scheduler.
        return not getattr(scheduler, "asynchronous", False)
    try:
        from distributed import get_client

        client = get_client()
    except (ImportError, ValueError):
        return True
    return not client.asynchronous


def _deferred_range_shuffle(
    df: dd.DataFrame,
    column: Any,
    npartitions: int,
    sample_size: int,
    ascending: bool,
    na_first: bool,
    keep_index: bool,
) -> tuple[list[Any], dict[Any, Any], str]:
    """A range shuffle whose sample and boundaries are tasks of its graph.

    One sample task per input partition (the rows :func:`_sample` draws, and
    the partition's minimum and maximum key), one task that reduces them to
    the boundaries exactly as :func:`_boundaries` does, and one task per
    input partition that writes each row's range partition into a hidden
    ``int64`` column, which the shuffle partitions on. The number of output
    partitions is ``npartitions`` (it cannot depend on the sample); those past
    the last boundary stay empty.

    Returns the shuffle's output keys, the graph and the hidden column's
    name (the tasks after the shuffle drop it).
    """
    options = graph_options()
    hidden = "_mpshuffle_range"
    while hidden in df.columns:
        hidden = "_" + hidden
    values_meta = df._meta[column].iloc[:0].reset_index(drop=True)
    size = max(int(sample_size), 1)
    token = tokenize(df._name, column, npartitions, size, ascending, na_first, keep_index, options.as_dict())
    graph = dict(df.__dask_graph__())
    input_keys = _skip_aliases(graph, df.__dask_keys__())
    sample_name = f"mpshuffle-range-sample-{token}"
    bounds_name = f"mpshuffle-range-bounds-{token}"
    ids_name = f"mpshuffle-range-ids-{token}"
    for i, key in enumerate(input_keys):
        graph[(sample_name, i)] = (_sample_with_extremes, key, column, size)
    graph[bounds_name] = (
        _deferred_bounds, values_meta, npartitions, [(sample_name, i) for i in range(len(input_keys))]
    )
    for i, key in enumerate(input_keys):
        graph[(ids_name, i)] = (_with_range_ids, key, bounds_name, column, ascending, na_first, hidden)
    meta = df._meta.assign(**{hidden: np.empty(0, dtype=np.int64)})
    if not keep_index:
        meta = meta.reset_index(drop=True)
    layer, keys = shuffle_graph(
        [(ids_name, i) for i in range(len(input_keys))],
        on=[hidden],
        npartitions=npartitions,
        meta=meta,
        keep_index=keep_index,
        name="mpshuffle-range",
        token=token,
        partitioner=_HiddenIds(hidden),
        options=options,
    )
    graph.update(layer)
    return keys, graph, hidden


def _sample_with_extremes(part: pd.DataFrame, column: Any, size: int) -> tuple[pd.DataFrame, pd.Series]:
    """Task: :func:`_sample` of one partition, and its smallest and largest non-null key."""
    values = part[column].dropna()
    extremes = values.iloc[:0]
    if len(values):
        extremes = pd.Series([values.min(), values.max()], dtype=values.dtype)
    return _sample(part, column, size), extremes


def _deferred_bounds(
    values_meta: pd.Series, npartitions: int, samples: list[tuple[pd.DataFrame, pd.Series]]
) -> pd.Index:
    """Task: the boundaries from every partition's sample, as :func:`_boundaries` finds them."""
    sample = pd.concat([s for s, _ in samples], ignore_index=True)
    extremes = pd.concat([e for _, e in samples], ignore_index=True)
    lo = extremes.min() if len(extremes) else None
    return _bounds_from_sample(sample, lo, values_meta, npartitions)


def _with_range_ids(
    frame: pd.DataFrame, bounds: pd.Index, column: Any, ascending: bool, na_first: bool, hidden: str
) -> pd.DataFrame:
    """Task: ``frame`` with each row's range partition in the column ``hidden``."""
    ids = RangePartitioner(column, bounds, ascending, na_first)(frame)
    return frame.assign(**{hidden: ids})


@dataclasses.dataclass(frozen=True)
class _HiddenIds:
    """Partitioner: the partition ids :func:`_with_range_ids` wrote into ``column``."""

    column: str

    def __call__(self, frame: pd.DataFrame) -> np.ndarray:
        return np.asarray(frame[self.column], dtype=np.int64)


def _sort_partition(
    frame: pd.DataFrame, by: list[Any], ascending: list[bool], na_position: str,
    hidden: str | None = None,
) -> pd.DataFrame:
    """Task: sort one output partition (stable, so equal keys keep their input order)."""
    if hidden is not None:
        frame = frame.drop(columns=hidden)
    return frame.sort_values(by, ascending=ascending, na_position=na_position, kind="stable")


def _set_index_partition(
    frame: pd.DataFrame, column: Any, drop: bool, hidden: str | None = None
) -> pd.DataFrame:
    """Task: set and sort the index of one output partition (nulls last)."""
    if hidden is not None:
        frame = frame.drop(columns=hidden)
    return frame.set_index(column, drop=drop).sort_index(kind="stable", na_position="last")
