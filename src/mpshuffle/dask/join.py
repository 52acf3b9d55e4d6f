"""Hash joins of dask DataFrames: two co-partitioned mpshuffle shuffles, then ``pandas.merge``.

Both sides are shuffled on their key columns into the same number of output
partitions with the same hash (:mod:`mpshuffle.table.hashing`), so rows with
equal keys meet in output partition ``j`` of both shuffles. Each shuffle's
extract task for ``j`` is pinned to the worker of rank
``partition_owner(j, nranks)`` of the generation current when the run is
created, so when both runs bind to one generation (the usual case: a new
generation only starts when the workers change) the two halves of partition
``j`` are produced on one worker and the join task runs there without moving
data.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import dask.dataframe as dd
import pandas as pd
from dask.base import tokenize
from dask.dataframe.utils import make_meta, meta_nonempty

from mpshuffle.dask._checks import frame_type_error
from mpshuffle.dask.dataframe import _collection, shuffle

__all__ = ["merge"]

#: The ``how`` values Dask's own ``merge`` accepts (``leftsemi`` is Dask's, not pandas').
HOWS = ("inner", "left", "right", "outer", "leftsemi")


def merge(
    left: dd.DataFrame,
    right: dd.DataFrame,
    how: str = "inner",
    on: Hashable | Sequence[Hashable] | None = None,
    *,
    left_on: Hashable | Sequence[Hashable] | None = None,
    right_on: Hashable | Sequence[Hashable] | None = None,
    suffixes: tuple[str, str] = ("_x", "_y"),
    npartitions: int | None = None,
) -> dd.DataFrame:
    """Join two dask DataFrames on key columns through mpshuffle.

    Parameters
    ----------
    left, right
        The collections to join (pandas partitions). A ``pandas.DataFrame`` is
        taken as a one-partition collection.
    how
        ``"inner"``, ``"left"``, ``"right"``, ``"outer"`` (as ``pandas.merge``)
        or ``"leftsemi"`` (as Dask's ``merge``: the rows of ``left`` whose key
        occurs in ``right``, ``left``'s columns only, each left row once).
    on
        Key column name(s) present in both sides. With neither ``on`` nor
        ``left_on``/``right_on``, the columns the two sides share (as pandas).
    left_on, right_on
        Key column name(s) of each side, paired in order; the names may differ.
    suffixes
        Appended to overlapping non-key column names, as ``pandas.merge``.
    npartitions
        Number of output partitions; by default the larger of the two inputs'.

    Returns
    -------
    dask.dataframe.DataFrame
        ``npartitions`` partitions with unknown divisions and a fresh index per
        partition; partition ``j`` is ``pandas.merge`` of output partition ``j``
        of the two shuffles, so the rows are those of ``pandas.merge`` of the
        whole frames (in another order).

    Raises
    ------
    TypeError
        If an input is not a DataFrame, or a pair of key columns has dtypes
        that do not hash alike (integer vs float, say); cast one side first.
    ValueError
        If ``how`` is not supported, ``on`` is combined with ``left_on`` /
        ``right_on``, the key lists differ in length, or there are no keys.
    KeyError
        If a key column is missing; names it and the side.

    Notes
    -----
    Null keys: like ``pandas.merge``, a null key (``None``, ``NaN``, ``NaT``,
    ``pd.NA``) matches a null key of the other side. Every null hashes to one
    value, so all null keys meet in one output partition, where
    ``pandas.merge`` pairs them as it would in one frame.

    Key dtypes: integers of any width (and ``bool``) hash alike, as do
    strings, ``object`` columns holding strings and ``category`` of strings;
    datetimes hash by instant. Integer vs float keys do not hash alike
    (``1`` and ``1.0`` land in different partitions) and are refused rather
    than joined wrongly.

    Output dtypes are ``pandas.merge``'s per partition: a column of the side
    that may lack a match (``right`` of a left join, say) becomes ``float64``
    in a partition with unmatched rows when it is an integer column, as Dask's
    own merge does; the meta is computed from non-empty metas as Dask does.

    The two shuffles each bind to the generation current when their first
    task runs. If the workers change between the two, partition ``j`` of the
    two sides may be produced on different workers; Dask then moves one to the
    other for the join task, so the result stays right.
    """
    left = _as_collection(left, "left")
    right = _as_collection(right, "right")
    if how not in HOWS:
        raise ValueError(f"merge how={how!r} is not supported; choose one of {HOWS}")
    left_on, right_on = _keys(left, right, on, left_on, right_on)
    _check_key_dtypes(left, right, left_on, right_on)
    if npartitions is None:
        npartitions = max(left.npartitions, right.npartitions)
    if int(npartitions) < 1:
        raise ValueError(f"npartitions must be >= 1, got {npartitions}")
    npartitions = int(npartitions)

    pandas_how = how
    if how == "leftsemi":
        # Only the right side's distinct keys matter; renaming them to the left
        # names keeps the result to exactly the left columns.
        right = right[right_on].rename(columns=dict(zip(right_on, left_on, strict=True)))
        right_on = list(left_on)
        pandas_how = "inner"
    kwargs = {
        "how": pandas_how,
        "left_on": left_on,
        "right_on": right_on,
        "suffixes": tuple(suffixes),
    }
    meta = make_meta(meta_nonempty(left._meta).merge(meta_nonempty(right._meta), **kwargs))

    lshuf = shuffle(left, left_on, npartitions=npartitions, ignore_index=True)
    rshuf = shuffle(right, right_on, npartitions=npartitions, ignore_index=True)
    name = "mpshuffle-merge-" + tokenize(lshuf._name, rshuf._name, how, left_on, right_on, suffixes)
    graph: dict[Any, Any] = dict(lshuf.__dask_graph__())
    graph.update(rshuf.__dask_graph__())
    keys = []
    semi = how == "leftsemi"
    for j, (lk, rk) in enumerate(zip(lshuf.__dask_keys__(), rshuf.__dask_keys__(), strict=True)):
        graph[(name, j)] = (merge_partition, lk, rk, kwargs, list(meta.columns), semi)
        keys.append((name, j))
    return _collection(graph, meta, npartitions, keys)


def merge_partition(
    left: pd.DataFrame,
    right: pd.DataFrame,
    kwargs: dict[str, Any],
    columns: list[Any],
    semi: bool = False,
) -> pd.DataFrame:
    """Task: ``pandas.merge`` of output partition ``j`` of both shuffles.

    Parameters
    ----------
    left, right
        The two sides' rows of one output partition.
    kwargs
        Keyword arguments of ``pandas.merge`` (``how``, ``left_on``, ...).
    columns
        The result's columns in the meta's order (pandas may reorder them
        when ``left`` is empty).
    semi
        Drop duplicate right keys first (for ``leftsemi``).

    Returns
    -------
    pandas.DataFrame
    """
    if semi:
        right = right.drop_duplicates()
    out = left.merge(right, **kwargs)
    return out[columns] if list(out.columns) != columns else out


def _as_collection(df: Any, side: str) -> dd.DataFrame:
    if isinstance(df, pd.DataFrame):
        return dd.from_pandas(df, npartitions=1)
    if not isinstance(df, dd.DataFrame):
        raise frame_type_error(f"merge: {side} must be a dask or pandas DataFrame", df)
    return df


def _as_list(keys: Any) -> list[Any]:
    if isinstance(keys, (str, bytes, int)) or not isinstance(keys, Sequence):
        return [keys]
    return list(keys)


def _keys(
    left: dd.DataFrame, right: dd.DataFrame, on: Any, left_on: Any, right_on: Any
) -> tuple[list[Any], list[Any]]:
    if on is not None:
        if left_on is not None or right_on is not None:
            raise ValueError("merge: pass either 'on' or 'left_on' and 'right_on', not both")
        left_on = right_on = on
    elif left_on is None and right_on is None:
        left_on = right_on = [c for c in left.columns if c in set(right.columns)]
    elif left_on is None or right_on is None:
        raise ValueError("merge: 'left_on' and 'right_on' must be given together")
    lkeys, rkeys = _as_list(left_on), _as_list(right_on)
    if not lkeys:
        raise ValueError("merge: no key columns (the sides share no column names; pass 'on')")
    if len(lkeys) != len(rkeys):
        raise ValueError(f"merge: left_on {lkeys!r} and right_on {rkeys!r} differ in length")
    for side, df, ks in (("left", left, lkeys), ("right", right, rkeys)):
        missing = [k for k in ks if k not in df.columns]
        if missing:
            raise KeyError(
                f"merge: key column(s) {missing!r} not in the {side} columns {list(df.columns)!r}"
            )
    return lkeys, rkeys


def _hash_family(dtype: Any) -> str:
    """Which values of this dtype hash alike (see :mod:`mpshuffle.table.hashing`)."""
    if isinstance(dtype, pd.CategoricalDtype):
        return _hash_family(dtype.categories.dtype)
    api = pd.api.types
    if api.is_bool_dtype(dtype) or api.is_integer_dtype(dtype):
        return "integer"
    if api.is_float_dtype(dtype):
        return "float"
    if api.is_datetime64_any_dtype(dtype):
        return "datetime"
    if api.is_timedelta64_dtype(dtype):
        return "timedelta"
    if api.is_string_dtype(dtype) or api.is_object_dtype(dtype):
        return "string"
    return str(dtype)


def _check_key_dtypes(
    left: dd.DataFrame, right: dd.DataFrame, left_on: list[Any], right_on: list[Any]
) -> None:
    for lk, rk in zip(left_on, right_on, strict=True):
        ldt, rdt = left._meta[lk].dtype, right._meta[rk].dtype
        if _hash_family(ldt) != _hash_family(rdt):
            raise TypeError(
                f"merge: key {lk!r} of left ({ldt}) and {rk!r} of right ({rdt}) do not hash alike, "
                "so equal values could land in different partitions; cast one side to the "
                "other's dtype (e.g. .astype) before merging"
            )
