"""Type errors of the dask functions that name the type given and what to do instead."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["frame_type_error", "type_name"]


def type_name(obj: Any) -> str:
    """The public dotted name of ``obj``'s type, as users import it.

    The shortest package prefix of the type's module that exports the type
    under its name is used, so ``pandas.core.frame.DataFrame`` reads
    ``pandas.DataFrame`` and the dask-expr collections ``dask.dataframe.Series``;
    a name exported nowhere above its module is given in full, a builtin bare.

    Parameters
    ----------
    obj
        Any object.

    Returns
    -------
    str
    """
    t = type(obj)
    module, name = t.__module__, t.__qualname__
    if module == "builtins":
        return name
    parts = module.split(".")
    for i in range(1, len(parts)):
        prefix = ".".join(parts[:i])
        if getattr(sys.modules.get(prefix), name, None) is t:
            return f"{prefix}.{name}"
    return f"{module}.{name}"


def frame_type_error(head: str, obj: Any) -> TypeError:
    """The error for ``obj`` given where a dataframe collection was needed.

    The message is ``head``, then ``obj``'s full type (:func:`type_name`),
    then, for a pandas DataFrame or Series, how to make a dask DataFrame of
    it, and for another Series (dask's), how to make it a DataFrame.

    Parameters
    ----------
    head
        What was expected, for example ``"shuffle expects a dask DataFrame"``.
    obj
        The object given.

    Returns
    -------
    TypeError
        To be raised by the caller.
    """
    message = f"{head}, got {type_name(obj)}"
    pandas = sys.modules.get("pandas")
    if pandas is not None and isinstance(obj, pandas.DataFrame):
        message += "; make one with dask.dataframe.from_pandas(df, npartitions=...)"
    elif pandas is not None and isinstance(obj, pandas.Series):
        message += "; make one with dask.dataframe.from_pandas(series.to_frame(), npartitions=...)"
    elif type(obj).__name__ == "Series":
        message += "; a Series becomes a DataFrame with series.to_frame()"
    return TypeError(message)
