"""Property test: shuffles of small mixed-dtype frames keep every invariant.

Frames of random length with ints, nullable ``Int64``, floats with NaN,
strings with None, categoricals, datetimes with and without a time zone and
booleans are split into a random number of input partitions and shuffled on
random key columns into a random number of output partitions, on the
``local`` communicator (no Client, Dask's sync scheduler). The checks are those
of ``tests/dask/test_edge_cases.py``: each output partition holds exactly the input rows
whose key hashes to it, in input-partition then position order (so the row
multiset and key ownership too), with the collection's dtypes; and a second
computation gives the same partitions.
"""

from __future__ import annotations

import itertools
from typing import Any

import dask
import numpy as np
import pandas as pd
import pyarrow as pa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_edge_cases import _arrow, check, shuffle_arrow, shuffle_pandas

COLUMNS = ["i", "n", "f", "s", "c", "t", "tz", "b"]


@st.composite
def frames(draw: Any) -> tuple[list[pd.DataFrame], list[str], int]:
    """Input partitions of one random frame, key columns and output partition count."""
    n = draw(st.integers(0, 40))
    ints = st.integers(-3, 3)
    small = st.lists(ints, min_size=n, max_size=n)
    col_i = draw(small)
    col_n = draw(st.lists(st.one_of(st.none(), ints), min_size=n, max_size=n))
    col_f = draw(st.lists(st.sampled_from([np.nan, 0.0, -0.0, 1.5, -2.25]), min_size=n, max_size=n))
    col_s = draw(st.lists(st.sampled_from([None, "a", "b", "é", ""]), min_size=n, max_size=n))
    col_c = draw(st.lists(st.sampled_from([None, "x", "y", "z"]), min_size=n, max_size=n))
    col_t = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    col_b = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    t = pd.to_datetime(np.array(col_t) * 3600, unit="s")
    pdf = pd.DataFrame(
        {
            "i": np.array(col_i, dtype="int64"),
            "n": pd.array(col_n, dtype="Int64"),
            "f": np.array(col_f, dtype="float64"),
            "s": pd.array(col_s, dtype="str"),
            "c": pd.Categorical(col_c, categories=["x", "y", "z"]),
            "t": t,
            "tz": t.tz_localize("UTC").tz_convert("America/New_York"),
            "b": np.array(col_b, dtype=bool),
        }
    )
    cuts = sorted(draw(st.lists(st.integers(0, n), min_size=0, max_size=4)))
    bounds = [0, *cuts, n]
    parts = [pdf.iloc[a:b] for a, b in itertools.pairwise(bounds)]
    on = draw(st.lists(st.sampled_from(COLUMNS), min_size=1, max_size=3, unique=True))
    npartitions = draw(st.integers(1, 9))
    return parts, on, npartitions


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=frames())
def test_pandas_shuffle_invariants_local(case: tuple[list[pd.DataFrame], list[str], int]) -> None:
    parts, on, npartitions = case
    with dask.config.set(scheduler="sync"):
        inputs, outputs, out = shuffle_pandas(None, parts, on, npartitions)
        check(inputs, outputs, on, out._meta, keep_index=True)
        again = list(dask.compute(*out.to_delayed()))
    for a, b in zip(outputs, again, strict=True):
        pd.testing.assert_frame_equal(a, b)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=frames())
def test_arrow_shuffle_invariants_local(case: tuple[list[pd.DataFrame], list[str], int]) -> None:
    parts, on, npartitions = case
    tables = [_arrow(p) for p in parts]
    # The schema of all rows: under pandas 2 an empty object column converts
    # to Arrow's null type, which the strings of other parts cannot be cast to.
    schema = _arrow(pd.concat(parts, ignore_index=True)).schema
    with dask.config.set(scheduler="sync"):
        outputs = shuffle_arrow(None, tables, on, npartitions, schema)
        again = shuffle_arrow(None, tables, on, npartitions, schema)
    check(tables, outputs, on, schema)
    assert all(isinstance(o, pa.Table) and o.equals(a) for o, a in zip(outputs, again, strict=True))


@settings(
    max_examples=4,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(case=frames())
def test_pandas_shuffle_invariants_cluster(
    client: Any, case: tuple[list[pd.DataFrame], list[str], int]
) -> None:
    parts, on, npartitions = case
    inputs, outputs, out = shuffle_pandas(client, parts, on, npartitions)
    check(inputs, outputs, on, out._meta, keep_index=True)
