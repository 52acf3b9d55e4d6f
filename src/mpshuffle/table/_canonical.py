"""Per-column hashes of canonicalized key values (see :mod:`mpshuffle.table.hashing`).

Every function here maps one key column to a ``uint64`` array of shape
``(nrows,)`` such that equal keys get equal hashes whatever the frame type
(pandas or pyarrow) and whatever the width of the dtype. Typed columns are
canonicalized through Arrow (a pandas column is converted with
``pyarrow.array(..., from_pandas=True)``), so both frame types share one code
path and cannot drift apart; only pandas ``object`` columns take their own path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

if TYPE_CHECKING:
    import numpy.typing as npt

__all__ = ["NULL_HASH", "hash_arrow_column", "hash_object_values", "hash_pandas_column"]

#: Hash of every missing key (None, NaN, NA, NaT, arrow null), in any dtype.
#: The 64-bit golden-ratio constant (Knuth, TAOCP vol. 3, 6.4): arbitrary but
#: fixed; nothing else about it matters.
NULL_HASH = np.uint64(0x9E3779B97F4A7C15)

# Key used by pandas.util.hash_array's SipHash-2-4 for object arrays. This is
# pandas' default, spelled out so that a change of default cannot move keys.
_HASH_KEY = "0123456789123456"

# Nanoseconds per unit of Arrow's temporal types.
_NS_PER_UNIT = {"s": 1_000_000_000, "ms": 1_000_000, "us": 1_000, "ns": 1}
_NS_PER_DAY = 86_400 * 1_000_000_000


def _hash_int64(values: npt.NDArray[np.int64]) -> npt.NDArray[np.uint64]:
    return pd.util.hash_array(values, hash_key=_HASH_KEY)


def _with_nulls(
    hashes: npt.NDArray[np.uint64], null: npt.NDArray[np.bool_] | None
) -> npt.NDArray[np.uint64]:
    if null is not None and null.any():
        hashes[null] = NULL_HASH
    return hashes


def _null_mask(arr: pa.Array) -> npt.NDArray[np.bool_] | None:
    if arr.null_count == 0:
        return None
    return arr.is_null().to_numpy(zero_copy_only=False)


def hash_object_values(
    values: npt.NDArray[np.object_], null: npt.NDArray[np.bool_] | None = None
) -> npt.NDArray[np.uint64]:
    """Hash an object array by value with pandas' SipHash-2-4.

    ``str`` values hash their UTF-8 bytes and ``bytes`` values their bytes
    (so ``"a"``, ``b"a"`` and a categorical or Arrow string ``"a"`` agree).
    If any value is neither, pandas hashes ``str(value)`` for the whole array.

    Parameters
    ----------
    values
        Shape ``(n,)``, dtype object.
    null
        Optional mask of missing values, shape ``(n,)``; computed with
        :func:`pandas.isna` when omitted.

    Returns
    -------
    numpy.ndarray
        ``uint64``, shape ``(n,)``; missing values get :data:`NULL_HASH`.
    """
    if null is None:
        null = pd.isna(values)
    if pd.api.types.infer_dtype(values, skipna=True) not in ("string", "bytes", "empty"):
        values = _canonical_objects(values)
    hashes = pd.util.hash_array(values, hash_key=_HASH_KEY, categorize=True)
    return _with_nulls(np.asarray(hashes, dtype=np.uint64), null)


def _canonical_objects(values: npt.NDArray[np.object_]) -> npt.NDArray[np.object_]:
    """Replace numbers in a mixed object array by one text per equal value.

    ``True == 1 == 1.0`` in Python, and pandas groups them together; but
    hashing ``str(value)`` after factorizing hashes whichever of them came
    first in the partition, so equal keys could land in different output
    partitions. Each distinct value (not each row) is mapped: booleans and
    integral numbers to the decimal text of the integer, other reals to
    ``repr(float)``, anything else to ``str``.
    """
    codes, uniques = pd.factorize(values, use_na_sentinel=True)
    canon = np.empty(len(uniques) + 1, dtype=object)
    canon[:-1] = [_canonical_object(u) for u in uniques]
    canon[-1] = None  # code -1: missing, hashed as NULL_HASH by the caller
    return canon[codes]


def _canonical_object(value: Any) -> Any:
    if isinstance(value, (str, bytes)):
        return value
    if isinstance(value, (bool, np.bool_, int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        f = float(value)
        if f.is_integer():
            return str(int(f))
        return repr(0.0 if f == 0 else f)
    return str(value)


def _hash_temporal(arr: pa.Array) -> npt.NDArray[np.uint64]:
    t = arr.type
    if pa.types.is_date32(t):
        ints, factor = arr.cast(pa.int32()).cast(pa.int64()), _NS_PER_DAY
    elif pa.types.is_date64(t):
        ints, factor = arr.cast(pa.int64()), _NS_PER_UNIT["ms"]
    else:
        # timestamp (UTC instants whatever the tz), duration, time32/64.
        ints = arr.cast(pa.int32() if pa.types.is_time32(t) else pa.int64()).cast(pa.int64())
        factor = _NS_PER_UNIT[t.unit]
    values = pc.fill_null(ints, 0).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    # numpy integer arrays wrap on overflow; the few values outside the
    # nanosecond range (before 1677 / after 2262) stay deterministic.
    ns = values * np.int64(factor)
    return _with_nulls(_hash_int64(ns), _null_mask(arr))


def _hash_arrow_array(arr: pa.Array, distinct: bool = False) -> npt.NDArray[np.uint64]:
    # ``distinct``: the values are known to be unique (a dictionary), so
    # factorizing them again would gain nothing.
    t = arr.type
    n = len(arr)
    if pa.types.is_null(t):
        return np.full(n, NULL_HASH, dtype=np.uint64)
    if pa.types.is_dictionary(t):
        # A categorical hashes like its values: hash the (small) dictionary
        # once, then gather by index.
        dict_hashes = _hash_arrow_array(arr.dictionary, distinct=True)
        indices = arr.indices
        if len(dict_hashes) == 0:
            return np.full(n, NULL_HASH, dtype=np.uint64)
        idx = pc.fill_null(indices, 0).cast(pa.int64()).to_numpy(zero_copy_only=False)
        return _with_nulls(dict_hashes[idx], _null_mask(indices))
    if pa.types.is_integer(t) or pa.types.is_boolean(t):
        # Every width and signedness (and bool as 0/1) -> int64 values;
        # uint64 above 2**63 wraps, which keeps equal keys equal.
        filled = pc.fill_null(arr, False if pa.types.is_boolean(t) else 0)
        values = filled.cast(pa.int64(), safe=False).to_numpy(zero_copy_only=False)
        return _with_nulls(_hash_int64(values), _null_mask(arr))
    if pa.types.is_floating(t):
        values = arr.cast(pa.float64()).to_numpy(zero_copy_only=False)
        null = np.isnan(values)  # arrow nulls come back as NaN
        # -0.0 + 0.0 == +0.0 (IEEE 754 round-to-nearest), so both zeros hash alike.
        values = np.where(null, 0.0, values) + 0.0
        return _with_nulls(_hash_int64(values.view(np.int64)), null)
    if pa.types.is_temporal(t):
        return _hash_temporal(arr)
    if pa.types.is_string_view(t):
        arr = arr.cast(pa.large_string())
        t = arr.type
    if pa.types.is_binary_view(t):
        arr = arr.cast(pa.large_binary())
        t = arr.type
    if (
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
    ):
        if distinct:
            values = arr.to_numpy(zero_copy_only=False)
            return hash_object_values(values, _null_mask(arr))
        # Factorize in C++ so only the distinct values become Python objects.
        return _hash_arrow_array(pc.dictionary_encode(arr))
    # Decimals, nested and extension types: hash str(value) of the Python objects.
    values = np.asarray(arr.to_pandas(), dtype=object)
    null = arr.is_null().to_numpy(zero_copy_only=False)
    return hash_object_values(values, null)


def hash_arrow_column(column: pa.Array | pa.ChunkedArray) -> npt.NDArray[np.uint64]:
    """Hash one Arrow key column.

    Parameters
    ----------
    column
        Shape ``(n,)``; a ``pyarrow.Array`` or ``pyarrow.ChunkedArray``.

    Returns
    -------
    numpy.ndarray
        ``uint64``, shape ``(n,)``.
    """
    if isinstance(column, pa.ChunkedArray):
        if column.num_chunks == 1:
            return _hash_arrow_array(column.chunk(0))
        if column.num_chunks == 0:
            return np.empty(0, dtype=np.uint64)
        return np.concatenate([_hash_arrow_array(c) for c in column.chunks])
    return _hash_arrow_array(column)


def hash_pandas_column(column: pd.Series) -> npt.NDArray[np.uint64]:
    """Hash one pandas key column.

    ``object`` columns are hashed by value (:func:`hash_object_values`); every
    other dtype is converted to Arrow and hashed by :func:`hash_arrow_column`.
    A column Arrow cannot convert falls back to the object path.

    Parameters
    ----------
    column
        Shape ``(n,)``.

    Returns
    -------
    numpy.ndarray
        ``uint64``, shape ``(n,)``.
    """
    if column.dtype != object:
        try:
            return hash_arrow_column(pa.array(column, from_pandas=True))
        except (pa.ArrowException, TypeError, ValueError):
            pass
    return hash_object_values(np.asarray(column.astype(object)))
