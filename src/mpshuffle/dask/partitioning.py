"""Dask's partition rule for hash shuffles, computed in mpshuffle's insert.

Before every hash shuffle (``df.shuffle``, hash joins, ``split_out``
group-bys and ``drop_duplicates``) dask-expr adds a blockwise step,
``AssignPartitioningIndex``, that computes each row's output partition and
stores it as a column ``_partitions``; the shuffle then moves rows by that
column. Its rule: select the key columns (or the index, for a shuffle on the
index); cast those whose dtype *in the meta* is numeric, or categorical of
numbers, to ``float64`` (``astype(..., errors="ignore")``: a column that does
not cast stays as it is); hash the rows with
``pandas.util.hash_pandas_object(keys, index=False)``; take the hash modulo
the number of output partitions (``dask.dataframe.shuffle.partitioning_index``).

With the ``mpshuffle`` method (:mod:`mpshuffle.dask.method`) the shuffle
reads the frame *before* that step and :class:`DaskPartitioning` computes the
same ids inside the insert, so the ``_partitions`` column is neither computed
as a separate task nor moved:

* a key column whose values the insert's kernels read (numpy integers,
  booleans, ``float32``/``float64``) is handed over as it is and hashed as
  its ``float64`` values in the fused pass
  (:class:`mpshuffle.table.hashing.PandasRowHash`), which is exactly
  pandas' hash of the column cast to ``float64``;
* any other key column is cast (where Dask casts it) and hashed by pandas
  itself (``hash_pandas_object`` of the column, which is the per-column hash
  pandas combines), and only the combination runs in the fused pass;
* anything else -- a frame that is not a pandas DataFrame, no key column --
  gets its ids from Dask's own ``AssignPartitioningIndex`` code.

The ids are Dask's, bit for bit (``tests/dask/test_dask_partitioning.py``
compares them with ``partitioning_index`` for every dtype), so a frame
shuffled with ``tasks`` or ``p2p`` and one shuffled with mpshuffle are
partitioned alike, and merges between them stay right.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from mpshuffle.table.hashing import PandasRowHash

__all__ = ["DaskPartitioning"]

# Dask's name for the index when a shuffle on the index names it.
_INDEX = "_index"


def _key_frame(frame: pd.DataFrame, keys: Sequence[Any], index_shuffle: bool) -> pd.DataFrame:
    """The frame of key columns Dask hashes (``AssignPartitioningIndex.operation``'s selection)."""
    if index_shuffle:
        name = {"name": _INDEX} if list(keys) == [_INDEX] else {}
        return frame.index.to_frame(**name)
    from dask.dataframe.dask_expr._shuffle import _select_columns_or_index

    return _select_columns_or_index(frame, list(keys))  # type: ignore[no-any-return]


def _key_columns(frame: pd.DataFrame, keys: Sequence[Any], index_shuffle: bool) -> list[pd.Series]:
    """The key columns Dask hashes, as in :func:`_key_frame`, without copying them into a frame.

    Where every key is a string naming one column of ``frame`` (Dask's
    selection is then ``frame[keys]``, no index level), the columns
    themselves: the selected frame was a copy of the keys for every insert.
    The labels are compared as a list, not through ``frame.columns``' hash
    table: each input partition is a new frame, and building that table for
    a string index (``is_unique``) cost ~80 us an insert.
    """
    if not index_shuffle and all(isinstance(k, str) for k in keys):
        labels = list(frame.columns)
        present = set(labels)
        if len(present) == len(labels) and all(k in present for k in keys):
            return [frame.iloc[:, labels.index(k)] for k in keys]
    selected = _key_frame(frame, keys, index_shuffle)
    return [selected.iloc[:, j] for j in range(selected.shape[1])]


def _numeric_cast(dtype: Any) -> bool:
    """Whether Dask casts a key column of this (meta) dtype to ``float64`` before hashing."""
    from dask.dataframe.dask_expr._shuffle import _is_numeric_cast_type

    return bool(_is_numeric_cast_type(dtype))


def _kernel_numbers(dtype: Any) -> bool:
    """Whether the fused pass reads a column of this dtype as numbers to hash as ``float64``."""
    return isinstance(dtype, np.dtype) and (
        (dtype.kind in "iub" and dtype.itemsize <= 8) or dtype in (np.float32, np.float64)
    )


class DaskPartitioning:
    """Partitioner of a shuffle: Dask's ``partitioning_index`` of each row, from the key columns.

    Parameters
    ----------
    keys
        What Dask hashes: column names (and the index's name), as given to
        its ``AssignPartitioningIndex``; with ``index_shuffle``, ``[]`` or
        ``["_index"]``.
    npartitions
        Number of output partitions, ``>= 1``.
    meta
        The empty frame whose dtypes decide which key columns Dask casts to
        ``float64`` (``AssignPartitioningIndex``'s meta).
    index_shuffle
        The keys are the index (``df.shuffle(on_index=True)``, merges on
        the index).

    Notes
    -----
    Called with an input partition, it returns a
    :class:`~mpshuffle.table.hashing.PandasRowHash` of the partition's key
    columns (the insert computes the ids in its fused pass), or Dask's ids
    as an ``int64`` array where its own code computes them (see the module
    docstring). Picklable; it travels in every insert task.
    """

    def __init__(
        self, keys: Sequence[Any], npartitions: int, meta: pd.DataFrame, index_shuffle: bool = False
    ) -> None:
        self.keys = list(keys)
        self.npartitions = int(npartitions)
        self.meta = meta
        self.index_shuffle = bool(index_shuffle)
        #: dtype of Dask's ``_partitions`` column (``partitioning_index``'s
        #: smallest signed integer that holds ``-npartitions - 1``).
        self.ids_dtype = np.min_scalar_type(-self.npartitions - 1)
        dtypes = _key_frame(meta, self.keys, self.index_shuffle).dtypes
        self.to_float = tuple(_numeric_cast(d) for d in dtypes)

    def __call__(self, frame: Any) -> PandasRowHash | np.ndarray:
        if not isinstance(frame, pd.DataFrame):
            return self.dask_ids(frame)
        keys = _key_columns(frame, self.keys, self.index_shuffle)
        if not keys or len(keys) != len(self.to_float):
            return self.dask_ids(frame)
        columns: list[np.ndarray] = []
        given: list[bool] = []
        for column, cast in zip(keys, self.to_float, strict=True):
            if cast and _kernel_numbers(column.dtype):
                columns.append(column.to_numpy())
                given.append(False)
                continue
            if cast:
                try:
                    column = column.astype(np.float64)
                except (TypeError, ValueError):
                    pass  # Dask's astype(errors="ignore") keeps such a column as it is
            if column.dtype == np.float64:
                columns.append(column.to_numpy())
                given.append(False)
            else:
                hashes = pd.util.hash_pandas_object(column, index=False)
                columns.append(hashes.to_numpy(dtype=np.uint64))
                given.append(True)
        return PandasRowHash(tuple(columns), tuple(given))

    def dask_ids(self, frame: Any) -> np.ndarray:
        """Dask's ids for ``frame``, by Dask's own code (``AssignPartitioningIndex.operation``)."""
        from dask.dataframe.dask_expr._shuffle import AssignPartitioningIndex

        assigned = AssignPartitioningIndex.operation(
            frame, self.keys, "_partitions", self.npartitions, self.meta, self.index_shuffle
        )
        return np.asarray(assigned["_partitions"], dtype=np.int64)

    def __dask_tokenize__(self) -> tuple[Any, ...]:
        from dask.base import tokenize

        return ("mpshuffle.DaskPartitioning", self.keys, self.npartitions, self.index_shuffle,
                self.to_float, tokenize(self.meta))

    def __repr__(self) -> str:
        on = "index" if self.index_shuffle else self.keys
        return f"DaskPartitioning({on!r}, npartitions={self.npartitions})"
