"""Hash partitioning: which output partition, and which rank, each row goes to.

The hash
--------
1. Each key column is canonicalized, then hashed to ``uint64`` per row:

   - integers of every width and signedness (numpy, pandas nullable
     ``Int*``/``UInt*``, Arrow) and ``bool`` (as 0/1): the value as ``int64``
     (``uint64`` values above ``2**63`` wrap), hashed by
     :func:`pandas.util.hash_array` (a splitmix64-style bit mixer on the 8 bytes);
   - floats of every width: the value as ``float64`` with ``-0.0`` turned into
     ``0.0``, its 8 bytes hashed as above. Floats hash by their bits, so the
     float ``1.0`` and the integer ``1`` do *not* agree: cast keys to one dtype
     before co-partitioning integer and float columns;
   - datetimes, dates, times and timedeltas: ``int64`` nanoseconds (since the
     epoch, UTC, for datetimes; naive datetimes are taken as UTC), hashed as
     integers, so tz-aware values hash by instant and every unit agrees;
   - strings, bytes, ``object``: :func:`pandas.util.hash_array`'s SipHash-2-4 with
     the key ``"0123456789123456"`` of the UTF-8 bytes. ``object`` arrays with
     any other value hash a text per value: booleans and integral numbers the
     decimal integer (so ``True``, ``1`` and ``1.0``, which compare equal,
     agree), other reals ``repr(float)``, anything else ``str(value)``. A
     ``category`` / Arrow dictionary column hashes like its values, so
     ``category`` and ``str`` of the same text agree;
   - every missing value (``None``, ``NaN``, ``pd.NA``, ``NaT``, Arrow null) of
     any type: the fixed :data:`NULL_HASH` ``0x9E3779B97F4A7C15``. So all null
     keys land in one partition.

2. Key columns ``h_0 .. h_{k-1}`` are combined, in the order given, in ``uint64``
   arithmetic (mod ``2**64``)::

       acc = h_0
       acc = (acc * 0x9E3779B97F4A7C15) ^ h_i      for i = 1 .. k-1

   Multiplying by an odd constant is a bijection of ``uint64``, so the order of
   the key columns matters and no column's entropy is lost (the constant is
   Knuth's multiplicative-hashing golden ratio, TAOCP vol. 3, 6.4).

3. The partition id is ``acc % npartitions`` computed in ``uint64`` and cast to
   ``int64``; it never wraps for any ``npartitions`` below ``2**63``.

:func:`partition_ids` computes this in one compiled pass per key column
(:mod:`mpshuffle.table._kernels`) for integer, float, temporal and numpy
boolean columns, and with :func:`combine_hashes` / :func:`ids_from_hashes`'
arithmetic inside the same passes for the others; the tests compare both
ways value by value.

Pandas' row hash
----------------
A second rule, for rows that must land where another engine's partitioning
puts them: :class:`PandasRowHash` names the key columns, each either as
numbers to hash as their ``float64`` values or as hashes computed already,
and the id is pandas' row hash of them, ``hash_pandas_object(keys,
index=False) % npartitions`` in ``uint64``:

1. a column of numbers (any numpy integer, boolean or float type) hashes as
   pandas hashes the same values cast to ``float64``: the 8 bytes of the
   ``float64`` (every NaN as ``np.nan``'s bits, ``-0.0`` as ``0.0``) through
   the finalizer of step 1 above; a given column's ``uint64`` hashes are
   used as they are;
2. columns ``h_0 .. h_{k-1}`` combine as pandas' ``combine_hash_arrays``
   (CPython's old tuple hash): ``acc = 0x345678``, ``m = 1000003``; for each
   column ``i``: ``acc = (acc ^ h_i) * m``, ``m += 82520 + 2 * (k - i)``;
   finally ``acc += 97531`` (all mod ``2**64``).

This is the rule of Dask's ``partitioning_index`` once Dask has cast the
numeric key columns to ``float64``, which lets a shuffle compute Dask's
partitions in the fused pass instead of reading a column of them; the Dask
integration decides which columns are numbers (``mpshuffle.dask.partitioning``),
and its tests compare the ids with Dask's own.

Nothing uses Python's ``hash()`` (salted per process), so ids are equal across
processes, runs and machines that run the same pandas hashing; known values
are pinned by ``tests/test_table.py::test_known_hash_values`` so that a change
in pandas' hashing is noticed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import pyarrow as pa

from mpshuffle.table._canonical import NULL_HASH

if TYPE_CHECKING:
    import numpy.typing as npt

__all__ = [
    "NULL_HASH", "PandasRowHash", "combine_hashes", "ids_from_hashes", "owned_partitions", "pandas_row_ids",
    "partition_ids", "partition_owner",
]

#: Odd multiplier of the column-combining step (see the module docstring).
COMBINE_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)


def combine_hashes(hashes: Sequence[npt.NDArray[np.uint64]]) -> npt.NDArray[np.uint64]:
    """Combine per-column hashes into one ``uint64`` hash per row.

    Parameters
    ----------
    hashes
        One ``uint64`` array of shape ``(n,)`` per key column, in key order.

    Returns
    -------
    numpy.ndarray
        ``uint64``, shape ``(n,)``: ``acc = h_0; acc = acc * M ^ h_i`` (mod
        ``2**64``) with ``M = 0x9E3779B97F4A7C15``.

    Raises
    ------
    ValueError
        If ``hashes`` is empty.
    """
    if not hashes:
        raise ValueError("at least one key column is needed to hash-partition")
    acc = np.array(hashes[0], dtype=np.uint64, copy=True)
    for h in hashes[1:]:
        np.multiply(acc, COMBINE_MULTIPLIER, out=acc)
        np.bitwise_xor(acc, h, out=acc)
    return acc


def ids_from_hashes(hashes: npt.NDArray[np.uint64], npartitions: int) -> npt.NDArray[np.int64]:
    """Map combined row hashes to partition ids.

    Parameters
    ----------
    hashes
        ``uint64``, shape ``(n,)``.
    npartitions
        Number of output partitions, ``1 <= npartitions < 2**63``.

    Returns
    -------
    numpy.ndarray
        ``int64``, shape ``(n,)``, values in ``[0, npartitions)``.

    Raises
    ------
    ValueError
        If ``npartitions`` is out of range.
    """
    npartitions = _check_npartitions(npartitions)
    return (hashes % np.uint64(npartitions)).astype(np.int64)


def _check_npartitions(npartitions: int) -> int:
    n = int(npartitions)
    if n != npartitions or not 1 <= n < 2**63:
        raise ValueError(f"npartitions must be an integer in [1, 2**63), got {npartitions!r}")
    return n


def partition_ids(keys: Any, npartitions: int) -> npt.NDArray[np.int64]:
    """Compute the output partition id of every row from its key columns.

    Parameters
    ----------
    keys
        The key columns, shape ``(n, k)`` with ``k >= 1``: a ``pandas.DataFrame``
        or a ``pyarrow.Table``. All its columns are keys, in order.
    npartitions
        Number of output partitions, ``1 <= npartitions < 2**63``.

    Returns
    -------
    numpy.ndarray
        ``int64``, shape ``(n,)``, values in ``[0, npartitions)``; see the module
        docstring for the hash. Equal keys get equal ids whatever the frame
        type, dtype width, process or run.

    Raises
    ------
    ValueError
        If ``keys`` has no columns or ``npartitions`` is out of range.
    TypeError
        If ``keys`` is neither a pandas DataFrame nor a pyarrow Table, or a key
        column holds values that cannot be hashed (lists, dicts); names the column.
    """
    _check_npartitions(npartitions)
    from mpshuffle.table._columns import arrow_columns, hash_ids, key_columns

    if isinstance(keys, pd.DataFrame):
        columns, names = key_columns(keys), list(keys.columns)
    elif isinstance(keys, pa.Table):
        columns, names = arrow_columns(keys), list(keys.column_names)
    else:
        raise TypeError(
            f"partition_ids needs a pandas.DataFrame or pyarrow.Table, got {type(keys).__name__}"
        )
    if not columns:
        raise ValueError("at least one key column is needed to hash-partition")
    return hash_ids(columns, npartitions, len(keys), names).pid.astype(np.int64, copy=False)


@dataclass(frozen=True, eq=False)
class PandasRowHash:
    """The key columns of one frame, to partition its rows by pandas' row hash.

    Given as a frame's partition ids (``ids``) to an adapter's ``split``, it
    makes the insert compute ``hash_pandas_object(keys, index=False) %
    npartitions`` (see the module docstring) in its fused pass.

    Attributes
    ----------
    columns
        One 1-D numpy array per key column, in key order, all of the frame's
        length ``n``.
    given
        One flag per column: ``False``, the column holds numbers (integers of
        1 to 8 bytes, booleans, ``float32``/``float64``) hashed as their
        ``float64`` values; ``True``, it holds the column's ``uint64`` hashes.

    Raises
    ------
    ValueError
        On construction: no column, flags and columns of different counts,
        columns of different lengths or not 1-D, a given column not
        ``uint64``, or a number column of another dtype.
    """

    columns: tuple[Any, ...]
    given: tuple[bool, ...]

    def __post_init__(self) -> None:
        if not self.columns:
            raise ValueError("pandas' row hash needs at least one key column")
        if len(self.given) != len(self.columns):
            raise ValueError(f"{len(self.given)} flags for {len(self.columns)} key columns")
        lengths = {np.shape(c) for c in self.columns}
        if len(lengths) != 1 or len(next(iter(lengths))) != 1:
            raise ValueError(f"key columns must be 1-D and of one length, got shapes {sorted(lengths)}")
        for j, (c, g) in enumerate(zip(self.columns, self.given, strict=True)):
            dtype = np.asarray(c).dtype
            ok = dtype == np.uint64 if g else (dtype.kind in "iub" or dtype in (np.float32, np.float64))
            if not ok:
                what = "uint64 hashes" if g else "numbers (numpy integers, booleans, float32/64)"
                raise ValueError(f"key column {j} must hold {what}, got dtype {dtype}")

    @property
    def nrows(self) -> int:
        """Number of rows."""
        return int(np.shape(self.columns[0])[0])


def pandas_row_ids(keys: PandasRowHash, npartitions: int) -> npt.NDArray[np.int64]:
    """Each row's partition by pandas' row hash (see the module docstring).

    Parameters
    ----------
    keys
        The key columns.
    npartitions
        Number of output partitions, ``1 <= npartitions < 2**63``.

    Returns
    -------
    numpy.ndarray
        ``int64``, shape ``(n,)``, values in ``[0, npartitions)``: the ids
        the fused pass of an insert gives the same rows.

    Raises
    ------
    ValueError
        If ``npartitions`` is out of range.
    """
    npartitions = _check_npartitions(npartitions)
    from mpshuffle.table._columns import pandas_row_split

    return pandas_row_split(keys, npartitions).pid.astype(np.int64, copy=False)


def partition_owner(partition_id: int, nranks: int) -> int:
    """Return the rank that owns an output partition: ``partition_id % nranks``.

    Round-robin, so consecutive partitions go to consecutive ranks and every
    rank owns ``npartitions // nranks`` or one more. A pure function: every
    rank computes the same owner without communicating.

    Parameters
    ----------
    partition_id
        Output partition id, ``>= 0``.
    nranks
        Number of ranks of the communicator, ``>= 1``.

    Returns
    -------
    int
        Rank in ``[0, nranks)``.

    Raises
    ------
    ValueError
        If ``partition_id < 0`` or ``nranks < 1``.
    """
    if nranks < 1:
        raise ValueError(f"nranks must be >= 1, got {nranks}")
    if partition_id < 0:
        raise ValueError(f"partition_id must be >= 0, got {partition_id}")
    return int(partition_id) % int(nranks)


def partition_owners(partition_ids: npt.ArrayLike, nranks: int) -> npt.NDArray[np.int64]:
    """:func:`partition_owner` of every id of an array, at once.

    Parameters
    ----------
    partition_ids
        Output partition ids, ``>= 0`` (any shape).
    nranks
        Number of ranks, ``>= 1``.

    Returns
    -------
    numpy.ndarray
        ``int64``, the shape of ``partition_ids``: each id's rank.

    Raises
    ------
    ValueError
        If an id is negative or ``nranks < 1``.
    """
    if nranks < 1:
        raise ValueError(f"nranks must be >= 1, got {nranks}")
    ids = np.asarray(partition_ids, np.int64)
    if ids.size and int(ids.min()) < 0:
        raise ValueError(f"partition_id must be >= 0, got {int(ids.min())}")
    return ids % np.int64(nranks)


def owned_partitions(rank: int, nranks: int, npartitions: int) -> range:
    """The output partitions rank ``rank`` owns: those with ``partition_owner(p, nranks) == rank``.

    The inverse of :func:`partition_owner`; the one place (with it) where the
    owner rule is written. Vectorized forms of the rule over arrays of ids
    (:func:`mpshuffle.table.device.partition_order`) are tested against it.

    Parameters
    ----------
    rank
        A rank in ``[0, nranks)``.
    nranks
        Number of ranks, ``>= 1``.
    npartitions
        Number of output partitions, ``>= 0``.

    Returns
    -------
    range
        The ids, ascending.

    Raises
    ------
    ValueError
        If ``nranks < 1`` or ``rank`` is not in ``[0, nranks)``.
    """
    if nranks < 1:
        raise ValueError(f"nranks must be >= 1, got {nranks}")
    if not 0 <= rank < nranks:
        raise ValueError(f"rank must be in [0, {nranks}), got {rank}")
    return range(rank, max(npartitions, 0), nranks)
