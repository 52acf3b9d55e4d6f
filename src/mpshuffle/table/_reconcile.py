"""Make an unpacked pandas frame match the meta: same columns, same dtypes, or an error.

Pieces from different input partitions can disagree on a column's dtype (a
string column that is all None in one partition arrives as ``object`` or Arrow
``null``; an integer column may be ``int64`` where the meta says ``Int64``).
Each such column is cast toward the meta's dtype only when the cast is
lossless: the same rows are missing before and after, and casting back gives
the same values. Anything else raises :class:`~mpshuffle.errors.ShuffleError`
naming the column and both dtypes, never a silent lossy cast.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from mpshuffle.errors import ShuffleError
from mpshuffle.table.base import check_columns as base_check_columns

__all__ = ["check_columns", "reconcile", "same_dtype"]


def check_columns(actual: list[Any], meta: pd.DataFrame) -> None:
    """Raise if the data's columns and the meta's differ as sets (see :func:`~mpshuffle.table.base.check_columns`)."""
    base_check_columns(actual, list(meta.columns))


def _lossy(name: Any, have: Any, want: Any, why: str = "") -> ShuffleError:
    return ShuffleError(
        f"column {name!r}: cannot cast dtype {have} to the meta's dtype {want} "
        f"without losing values{': ' + why if why else ''}"
    )


def _same_values(a: pd.Series, b: pd.Series) -> bool:
    null_a = a.isna().to_numpy()
    if not np.array_equal(null_a, b.isna().to_numpy()):
        return False
    keep = ~null_a
    # Series.equals compares in C (object arrays element-wise), and needs
    # equal dtypes, which the caller guarantees by casting back.
    return bool(a[keep].reset_index(drop=True).equals(b[keep].reset_index(drop=True)))


def cast_lossless(column: pd.Series, dtype: Any) -> pd.Series:
    """Cast ``column`` to ``dtype`` if no value changes, else raise.

    Parameters
    ----------
    column
        Shape ``(n,)``.
    dtype
        The meta's dtype for this column.

    Returns
    -------
    pandas.Series
        With ``dtype`` — except a categorical whose values are not all among
        the meta's categories (e.g. Dask's unknown-categories meta), which
        keeps its own categories (the union over the pieces), cast to the
        dtype of the meta's categories, with the meta's ``ordered``.

    Raises
    ------
    ShuffleError
        Naming the column and both dtypes.
    """
    have = column.dtype
    if isinstance(have, pd.CategoricalDtype) and isinstance(dtype, pd.CategoricalDtype):
        # Only the (few) categories are compared, never the rows.
        covered = bool(column.cat.categories.isin(dtype.categories).all())
        if covered:
            return column.astype(dtype)
        # Unknown categories in the meta: keep the data's categories, but in
        # the meta's categories dtype (e.g. string[pyarrow], not str) and order.
        categories = cast_lossless(pd.Series(column.cat.categories), dtype.categories.dtype)
        own = pd.CategoricalDtype(pd.Index(categories), ordered=dtype.ordered)
        # CategoricalDtype equality ignores the categories' own dtype.
        if own == have and own.categories.dtype == have.categories.dtype:
            return column
        return column.astype(own)
    if dtype == object:
        # None (not NaN) for missing, as an object column built by the user has.
        values = column.to_numpy(dtype=object, na_value=None)
        return pd.Series(values, index=column.index, name=column.name, dtype=object)
    try:
        cast = column.astype(dtype)
    except (TypeError, ValueError, OverflowError) as e:
        raise _lossy(column.name, have, dtype, f"{type(e).__name__}: {e}") from e
    if column.isna().all() and cast.isna().all():
        return cast
    try:
        back = cast.astype(have)
    except (TypeError, ValueError, OverflowError) as e:
        raise _lossy(column.name, have, dtype, "the cast does not round-trip") from e
    if back.dtype != have or not _same_values(column, back):
        raise _lossy(column.name, have, dtype)
    return cast


def reconcile(
    frame: pd.DataFrame, meta: pd.DataFrame, on_lossy_cast: str = "raise", dtypes: Sequence[Any] | None = None
) -> pd.DataFrame:
    """Return ``frame`` with ``meta``'s column order and dtypes.

    Parameters
    ----------
    frame
        The concatenated pieces.
    meta
        Empty frame with the expected columns and dtypes.
    on_lossy_cast
        ``"raise"``: a column whose values do not fit the meta's dtype is an
        error. ``"keep"``: such a column keeps the data's dtype, as Dask's own
        shuffles do (Dask's meta can be wrong, e.g. an ``int64`` column that
        an outer merge filled with NaN).
    dtypes
        ``frame``'s column dtypes in order where the caller knows them
        (``frame.dtypes`` builds a Series, ~50 us on a new frame); ``None``:
        asked of the frame.

    Returns
    -------
    pandas.DataFrame

    Raises
    ------
    ShuffleError
        If a column is missing or extra, or (``on_lossy_cast="raise"``)
        cannot be cast losslessly.
    """
    columns, wanted = list(frame.columns), list(meta.columns)
    check_columns(columns, meta)
    if columns != wanted:
        frame = frame[wanted]
        dtypes = None
    if frame.shape[1] != len(wanted):
        dup = sorted({str(c) for c in columns if columns.count(c) > 1} | {str(c) for c in wanted if wanted.count(c) > 1})
        raise ShuffleError(f"column names must be unique; repeated: {dup!r}")
    changed = {}
    # The columns are unique and in the meta's order now: compare the dtypes
    # by position (a Series per column cost ~50 us on a fresh frame).
    for name, have, want in zip(wanted, frame.dtypes if dtypes is None else dtypes, meta.dtypes, strict=True):
        if not same_dtype(have, want):
            try:
                changed[name] = cast_lossless(frame[name], want)
            except ShuffleError:
                if on_lossy_cast != "keep":
                    raise
    if changed:
        frame = _replace(frame, changed)
    return frame


def same_dtype(have: Any, want: Any) -> bool:
    """``have == want`` for two dtypes, ``False`` where numpy cannot compare them."""
    # numpy compares its dtypes with an ArrowDtype by parsing it, which fails
    # ("data type not understood") for nested Arrow types.
    try:
        return bool(have == want)
    except TypeError:
        return False


def _replace(frame: pd.DataFrame, changed: dict[Any, pd.Series]) -> pd.DataFrame:
    frame = frame.copy(deep=False)
    for name, column in changed.items():
        frame[name] = column
    return frame
