"""Passing the wrong kind of object to shuffle/merge/sort_values/set_index names its full type and the fix."""

from __future__ import annotations

import re

import dask.dataframe as dd
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from mpshuffle.dask import merge, set_index, shuffle, sort_values
from mpshuffle.dask._checks import type_name

PDF = pd.DataFrame({"k": [1, 2, 3], "v": [1.0, 2.0, 3.0]})
DDF = dd.from_pandas(PDF, npartitions=1)
FROM_PANDAS = "; make one with dask.dataframe.from_pandas(df, npartitions=...)"


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: shuffle(PDF, "k"),
         "shuffle expects a dask DataFrame, got pandas.DataFrame" + FROM_PANDAS),
        (lambda: sort_values(PDF, "k"),
         "sort_values expects a dask DataFrame, got pandas.DataFrame" + FROM_PANDAS),
        (lambda: set_index(PDF, "k"),
         "set_index expects a dask DataFrame, got pandas.DataFrame" + FROM_PANDAS),
        (lambda: shuffle(PDF["k"], "k"),
         ("shuffle expects a dask DataFrame, got pandas.Series; "
          "make one with dask.dataframe.from_pandas(series.to_frame(), npartitions=...)")),
        (lambda: shuffle(DDF["k"], "k"),
         ("shuffle expects a dask DataFrame, got dask.dataframe.Series; "
          "a Series becomes a DataFrame with series.to_frame()")),
        (lambda: sort_values(pa.table({"k": [1]}), "k"),
         "sort_values expects a dask DataFrame, got pyarrow.Table"),
        (lambda: merge(DDF, np.zeros(3), on="k"),
         "merge: right must be a dask or pandas DataFrame, got numpy.ndarray"),
        (lambda: merge([1, 2], DDF, on="k"),
         "merge: left must be a dask or pandas DataFrame, got list"),
    ],
)
def test_message_names_the_type_and_the_fix(call: object, message: str) -> None:
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        call()  # type: ignore[operator]


def test_type_name_is_the_public_dotted_name() -> None:
    assert type_name(PDF) == "pandas.DataFrame"
    # dask-expr's class lives in dask.dataframe.dask_expr._collection.
    assert type(DDF).__module__ != "dask.dataframe"
    assert type_name(DDF) == "dask.dataframe.DataFrame"
    assert type_name(None) == "NoneType"

    class Local:
        pass

    # Exported nowhere: the full module path and qualified name.
    assert type_name(Local()) == f"{__name__}.test_type_name_is_the_public_dotted_name.<locals>.Local"
