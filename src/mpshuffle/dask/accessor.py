"""The ``df.mpshuffle`` accessor on dask DataFrames.

Registered with Dask's public accessor API,
:func:`dask.dataframe.extensions.register_dataframe_accessor`, by
:func:`register_accessor`, which ``import mpshuffle.dask`` (or importing any
of its modules) calls, so after it::

    df.mpshuffle.shuffle("key")
    df.mpshuffle.merge(other, on="key", how="left")
    df.mpshuffle.sort_values("key")
    df.mpshuffle.set_index("key")

Dask has no public way to make ``df.shuffle(..., shuffle_method=...)`` or the
``dataframe.shuffle.method`` option pick a third-party shuffle: the method
names are a fixed list inside Dask's expression lowering. So adoption is one
attribute away (``df.mpshuffle.``), not zero.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import dask.dataframe as dd
from dask.dataframe.extensions import register_dataframe_accessor

__all__ = ["ACCESSOR_NAME", "MPShuffleAccessor", "register_accessor"]

#: The attribute name on ``dask.dataframe.DataFrame``.
ACCESSOR_NAME = "mpshuffle"


class MPShuffleAccessor:
    """mpshuffle's operations as methods of a dask DataFrame (``df.mpshuffle``).

    Parameters
    ----------
    df
        The collection the accessor is read from.
    """

    _df: dd.DataFrame

    def __init__(self, df: dd.DataFrame) -> None:
        self._df = df

    def shuffle(
        self,
        on: Hashable | Sequence[Hashable],
        *,
        npartitions: int | None = None,
        ignore_index: bool = False,
    ) -> dd.DataFrame:
        """Shuffle so that equal keys share an output partition; see :func:`mpshuffle.dask.shuffle`."""
        from mpshuffle.dask.dataframe import shuffle

        return shuffle(self._df, on, npartitions=npartitions, ignore_index=ignore_index)

    def merge(self, right: Any, how: str = "inner", on: Any = None, **kwargs: Any) -> dd.DataFrame:
        """Join with ``right``; see :func:`mpshuffle.dask.merge` for the arguments."""
        from mpshuffle.dask.join import merge

        return merge(self._df, right, how=how, on=on, **kwargs)

    def sort_values(
        self,
        by: Hashable | Sequence[Hashable],
        ascending: bool | Sequence[bool] = True,
        **kwargs: Any,
    ) -> dd.DataFrame:
        """Sort by ``by``; see :func:`mpshuffle.dask.sort_values` for the arguments."""
        from mpshuffle.dask.sort import sort_values

        return sort_values(self._df, by, ascending, **kwargs)

    def set_index(self, column: Hashable, **kwargs: Any) -> dd.DataFrame:
        """Make ``column`` the sorted index; see :func:`mpshuffle.dask.set_index`."""
        from mpshuffle.dask.sort import set_index

        return set_index(self._df, column, **kwargs)


def register_accessor() -> None:
    """Register ``df.mpshuffle`` on ``dask.dataframe.DataFrame`` (idempotent).

    Raises
    ------
    RuntimeError
        If another package already registered an attribute named ``mpshuffle``
        that is not this accessor (Dask would only warn and overwrite it).
    """
    current = dd.DataFrame.__dict__.get(ACCESSOR_NAME)
    if current is not None:
        if getattr(current, "_accessor", None) is MPShuffleAccessor:
            return
        raise RuntimeError(
            f"dask.dataframe.DataFrame already has an attribute {ACCESSOR_NAME!r} "
            f"({current!r}); mpshuffle will not overwrite it"
        )
    register_dataframe_accessor(ACCESSOR_NAME)(MPShuffleAccessor)
