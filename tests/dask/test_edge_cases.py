"""The 14 edge cases of ``shared/cases/edge-cases.md``, each through a real shuffle.

Every case runs for both frame types the project supports:

* ``pandas``: a dask DataFrame through :func:`mpshuffle.dask.shuffle` on the
  module's 2-worker LocalCluster;
* ``arrow``: ``pyarrow.Table`` partitions through
  :func:`mpshuffle.dask.shuffle_graph` on the same cluster.

Each output partition is compared with the one computed here independently:
the rows of every input partition whose key hashes to it, in input-partition
then position order. That one comparison checks the row multiset, the
partition each key lands in, the values and the order; dtypes are compared
with the collection's meta. Cases that only exist for pandas (``object``
columns, integer column names) say so.
"""

from __future__ import annotations

import asyncio
import collections
import math
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from distributed import Client

from conftest import wait_for, worker_state
from mpshuffle.comm import Communicator
from mpshuffle.dask import bootstrap_dask_cluster, shuffle, shuffle_graph
from mpshuffle.errors import ShuffleError
from mpshuffle.table import get_adapter, partition_ids

KINDS = ["pandas", "arrow"]


# -- helpers --------------------------------------------------------------


class _Parts:
    """Picklable ``i -> parts[i]`` for ``dd.from_map`` (a copy, so no task mutates the list)."""

    def __init__(self, parts: Sequence[pd.DataFrame]) -> None:
        self.parts = list(parts)

    def __call__(self, i: int) -> pd.DataFrame:
        return self.parts[i].copy()


def _norm(v: Any) -> Any:
    """A comparable stand-in for one cell: every missing value is one sentinel."""
    if isinstance(v, (dict, list, tuple, np.ndarray)):
        return ("<obj>", type(v).__name__, repr(v))
    if v is None or v is pd.NA or v is pd.NaT or (isinstance(v, float) and math.isnan(v)):
        return "<NA>"
    return v


def _rows(frame: Any, cols: Sequence[Any] | None = None) -> list[tuple[Any, ...]]:
    """Rows of a pandas frame or Arrow table as tuples of Python values (Arrow's own, no floats)."""
    if isinstance(frame, pa.Table):
        sub = frame if cols is None else frame.select(list(cols))
        return [tuple(_norm(v) for v in row) for row in zip(*[c.to_pylist() for c in sub.columns])]
    sub = frame if cols is None else frame[list(cols)]
    return [tuple(_norm(v) for v in row) for row in sub.astype(object).itertuples(index=False)]


def _to_pandas(part: Any) -> pd.DataFrame:
    return part.to_pandas() if isinstance(part, pa.Table) else part


def check(
    inputs: Sequence[Any],
    outputs: Sequence[Any],
    on: Sequence[Any],
    meta: Any,
    *,
    keep_index: bool = False,
) -> None:
    """Assert that ``outputs`` is the shuffle of ``inputs`` on ``on``.

    ``inputs`` and ``outputs`` are the partitions as Dask computes them
    (pandas frames or Arrow tables), ``meta`` the collection's meta (pandas
    frame, or Arrow schema). Checks: every output has meta's dtypes; output
    ``j`` holds exactly the rows of the inputs whose key hashes to ``j``, in
    input-partition then position order, with their values (and index); the
    row multisets agree; each key is in exactly one output partition.
    """
    npartitions = len(outputs)
    for j, out in enumerate(outputs):
        if isinstance(meta, pa.Schema):
            assert isinstance(out, pa.Table)
            assert out.schema.equals(meta), (j, out.schema, meta)
        else:
            assert isinstance(out, pd.DataFrame)
            _check_dtypes(j, out, meta, inputs)

    # Output j, computed independently of the shuffle.
    expected: list[list[tuple[Any, ...]]] = [[] for _ in range(npartitions)]
    expected_index: list[list[Any]] = [[] for _ in range(npartitions)]
    for part in inputs:
        if not get_adapter(part).num_rows(part):
            continue
        ids = get_adapter(part).partition_ids(part, list(on), npartitions)
        for i, (pid, row) in enumerate(zip(ids, _rows(part), strict=True)):
            expected[pid].append(row)
            if keep_index:
                expected_index[pid].append(part.index[i])
    for j, out in enumerate(outputs):
        assert _rows(out) == expected[j], f"output partition {j}"
        if keep_index:
            assert list(out.index) == expected_index[j]

    # The same, without the hash: multisets and key ownership.
    all_in = [r for p in inputs for r in _rows(p)]
    all_out = [r for p in outputs for r in _rows(p)]
    assert sorted(map(repr, all_in)) == sorted(map(repr, all_out))
    owner: dict[Any, set[int]] = collections.defaultdict(set)
    for j, out in enumerate(outputs):
        for key in _rows(out, on):
            owner[key].add(j)
    assert all(len(v) == 1 for v in owner.values()), {k: v for k, v in owner.items() if len(v) > 1}


def _check_dtypes(j: int, out: pd.DataFrame, meta: pd.DataFrame, inputs: Sequence[Any]) -> None:
    """Output ``j`` has meta's dtypes, ``repr`` for repr (so a categorical's categories dtype too).

    Where the meta's categories are unknown (``astype("category")`` in Dask),
    the output's are its values' categories from the inputs, in the dtype of
    the meta's categories.
    """
    assert list(out.columns) == list(meta.columns)
    for name, want in meta.dtypes.items():
        have = out[name].dtype
        if isinstance(want, pd.CategoricalDtype) and "__UNKNOWN_CATEGORIES__" in list(
            want.categories
        ):
            assert isinstance(have, pd.CategoricalDtype), (j, name, have)
            assert have.categories.dtype == want.categories.dtype, (j, name, have, want)
            union = pd.api.types.union_categoricals([p[name] for p in inputs]).categories
            assert set(have.categories) <= set(union)
            assert set(out[name].dropna()) <= set(have.categories)
        else:
            assert repr(have) == repr(want), (j, name, have, want)


def shuffle_pandas(
    client: Client | None,
    parts: Sequence[pd.DataFrame],
    on: Any,
    npartitions: int,
    meta: pd.DataFrame | None = None,
) -> tuple[list[pd.DataFrame], list[pd.DataFrame], dd.DataFrame]:
    """Shuffle the partitions ``parts`` through :func:`mpshuffle.dask.shuffle`.

    Returns the input partitions as Dask computes them (after its own dtype
    conversions), the output partitions, and the output collection.
    """
    if meta is None:
        meta = parts[0].iloc[:0]
    df = dd.from_map(_Parts(parts), list(range(len(parts))), meta=meta, enforce_metadata=False)
    out = shuffle(df, on, npartitions=npartitions)
    if client is None:
        inputs = list(dask.compute(*df.to_delayed()))
        outputs = list(dask.compute(*out.to_delayed()))
    else:
        inputs = client.compute(df.to_delayed(), sync=True)
        outputs = client.compute(out.to_delayed(), sync=True)
    assert len(outputs) == npartitions
    return inputs, outputs, out


def shuffle_arrow(
    client: Client | None,
    tables: Sequence[pa.Table],
    on: Sequence[str],
    npartitions: int,
    schema: pa.Schema | None = None,
) -> list[pa.Table]:
    """Shuffle Arrow tables through :func:`mpshuffle.dask.shuffle_graph`."""
    schema = schema if schema is not None else tables[0].schema
    name = f"arrow-input-{uuid.uuid4().hex}"
    graph, keys = shuffle_graph(
        [(name, i) for i in range(len(tables))],
        on=on,
        npartitions=npartitions,
        meta=schema.empty_table(),
    )
    graph.update({(name, i): t for i, t in enumerate(tables)})
    outputs = list(client.get(graph, keys) if client is not None else dask.get(graph, keys))
    assert len(outputs) == npartitions
    return outputs


def _arrow(frame: pd.DataFrame) -> pa.Table:
    return pa.Table.from_pandas(frame, preserve_index=False)


def run_case(
    kind: str,
    client: Client | None,
    parts: Sequence[pd.DataFrame],
    on: list[Any],
    npartitions: int,
    *,
    meta: pd.DataFrame | None = None,
    schema: pa.Schema | None = None,
) -> tuple[list[Any], Any]:
    """Shuffle ``parts`` as ``kind`` frames, check the result, return outputs and meta."""
    if kind == "pandas":
        inputs, outputs, out = shuffle_pandas(client, parts, on, npartitions, meta)
        check(inputs, outputs, on, out._meta, keep_index=True)
        return outputs, out._meta
    tables = [_arrow(p) for p in parts]
    if schema is None:
        schema = _arrow(meta if meta is not None else parts[0]).schema
    outputs = shuffle_arrow(client, tables, on, npartitions, schema)
    check(tables, outputs, on, schema)
    return outputs, schema


def _assert_clean(client: Client) -> None:
    state = client.run(worker_state)
    assert all(s["shufflers"] == [] and s["spill"] == [] for s in state.values()), state


# -- the cases ------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_case01_categorical_keeps_categories(client: Client, kind: str) -> None:
    pdf = pd.DataFrame({"k": [1, 2, 3], "c": ["x", "y", "x"]})
    pdf["c"] = pdf["c"].astype("category")
    outputs, _ = run_case(kind, client, [pdf.iloc[:2], pdf.iloc[2:]], ["k"], 2)
    res = pd.concat([_to_pandas(o) for o in outputs]).sort_values("k")
    assert isinstance(res["c"].dtype, pd.CategoricalDtype)
    assert list(res["c"].cat.categories) == ["x", "y"]
    assert list(res["c"].astype(str)) == ["x", "y", "x"]
    assert not res["c"].isna().any()


def test_case01_categorical_cast_in_dask(client: Client) -> None:
    """pandas: ``df.c.astype('category')`` in Dask (a meta of unknown categories)."""
    df = dd.from_pandas(pd.DataFrame({"k": [1, 2, 3], "c": ["x", "y", "x"]}), npartitions=2)
    df["c"] = df["c"].astype("category")
    out = shuffle(df, "k", npartitions=2)
    inputs = client.compute(df.to_delayed(), sync=True)
    outputs = client.compute(out.to_delayed(), sync=True)
    check(inputs, outputs, ["k"], out._meta, keep_index=True)
    res = pd.concat(outputs).sort_values("k")
    assert list(res["c"]) == ["x", "y", "x"]
    assert list(res["c"].cat.categories) == ["x", "y"]


@pytest.mark.parametrize("kind", KINDS)
def test_case02_nullable_int_key_with_na(client: Client, kind: str) -> None:
    all_na = pd.DataFrame({"k": pd.array([None, None, None], dtype="Int64"), "v": [0, 1, 2]})
    mixed = pd.DataFrame({"k": pd.array([1, None, 2, 3], dtype="Int64"), "v": [3, 4, 5, 6]})
    outputs, _ = run_case(kind, client, [all_na, mixed], ["k"], 5)
    frames = [_to_pandas(o) for o in outputs]
    with_na = [j for j, f in enumerate(frames) if f["k"].isna().any()]
    assert len(with_na) == 1 and int(frames[with_na[0]]["k"].isna().sum()) == 4
    if kind == "pandas":
        assert all(f["k"].dtype == "Int64" for f in frames)
    else:
        assert all(o.schema.field("k").type == pa.int64() for o in outputs)


@pytest.mark.parametrize("kind", KINDS)
def test_case03_string_column_all_none_in_one_partition(client: Client, kind: str) -> None:
    none = pd.DataFrame({"k": [1, 2], "s": pd.Series([None, None], dtype=object)})
    text = pd.DataFrame({"k": [3, 4], "s": ["a", None]})
    if kind == "pandas":
        meta = pd.DataFrame({"k": pd.Series([], dtype="int64"), "s": pd.Series([], dtype="str")})
        outputs, out_meta = run_case(kind, client, [none, text], ["k"], 3, meta=meta)
        assert isinstance(out_meta["s"].dtype, pd.StringDtype)
    else:
        schema = pa.schema([("k", pa.int64()), ("s", pa.string())])
        assert _arrow(none).schema.field("s").type == pa.null()
        outputs, _ = run_case(kind, client, [none, text], ["k"], 3, schema=schema)
    res = pd.concat([_to_pandas(o) for o in outputs]).sort_values("k")
    assert res["s"].isna().tolist() == [True, True, False, True]
    assert res["s"].iloc[2] == "a"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("npartitions", [129, 257])
def test_case04_many_output_partitions(client: Client, kind: str, npartitions: int) -> None:
    pdf = pd.DataFrame({"k": np.arange(3000), "v": np.arange(3000) * 0.5})
    outputs, _ = run_case(kind, client, [pdf.iloc[:1500], pdf.iloc[1500:]], ["k"], npartitions)
    sizes = [len(o) if isinstance(o, pd.DataFrame) else o.num_rows for o in outputs]
    assert sum(sizes) == 3000
    # Rows really reach the partitions past 127 and 255 (no wrap-around).
    assert sum(sizes[128:]) > 0
    assert all(s > 0 for s in sizes[-3:])


def _keys_for(pids: Sequence[int], npartitions: int) -> list[int]:
    """Integer keys, one hashing to each of ``pids`` (found by scanning)."""
    want = set(pids)
    found: dict[int, int] = {}
    start = 0
    while want - set(found):
        cand = np.arange(start, start + 200_000)
        ids = partition_ids(pd.DataFrame({"k": cand}), npartitions)
        for pid in want - set(found):
            hit = np.flatnonzero(ids == pid)
            if len(hit):
                found[pid] = int(cand[hit[0]])
        start += 200_000
    return [found[p] for p in pids]


@pytest.mark.parametrize("kind", KINDS)
def test_case04_32769_partitions_at_the_shuffler_level(kind: str) -> None:
    """32769 partitions with a tiny frame on the local communicator's shuffler.

    As Dask tasks these alone take minutes; here the shuffler and the adapter
    run directly. Keys are picked to hash to ids past 2**15 (and to the last id).
    """
    from mpshuffle.dask.runtime import LocalRuntime

    n = 32769
    targets = [0, 255, 256, 32767, 32768]
    keys = _keys_for(targets, n)
    pdf = pd.DataFrame({"k": keys + keys, "v": np.arange(2 * len(keys))})
    frames = [pdf.iloc[: len(keys)], pdf.iloc[len(keys) :]]
    if kind == "arrow":
        frames = [_arrow(f) for f in frames]
    adapter = get_adapter(frames[0])
    runtime = LocalRuntime()
    ctx = runtime.context
    try:
        shuffler = ctx.shuffler(1)
        for i, frame in enumerate(frames):
            pieces = adapter.split(frame, ["k"], n)
            assert sorted(pieces) == targets
            shuffler.insert(i, pieces)
        shuffler.barrier(n)
        meta = frames[0].schema.empty_table() if kind == "arrow" else frames[0].iloc[:0]
        got = {}
        for pid in range(n):
            pieces = shuffler.extract(pid)
            if pieces:
                got[pid] = _to_pandas(adapter.unpack(pieces, meta))
        assert sorted(got) == targets
        for pid, key in zip(targets, keys, strict=True):
            assert got[pid]["k"].tolist() == [key, key]
            assert got[pid]["v"].tolist() == [targets.index(pid), targets.index(pid) + len(keys)]
        assert ctx.shufflers == {}
    finally:
        ctx.close()


_MIXED = [{"a": 1}, [1, 2], 3, {"b": [2]}, 4.5, "x", {"a": 1, "b": 2}, [3]]


def test_case05_object_column_with_dicts_and_lists(client: Client) -> None:
    """pandas only (Arrow has no ``object`` columns): Python objects travel intact."""
    with dask.config.set({"dataframe.convert-string": False}):
        pdf = pd.DataFrame({"k": np.arange(8) % 3, "o": pd.Series(_MIXED, dtype=object)})
        outputs, meta = run_case("pandas", client, [pdf.iloc[:4], pdf.iloc[4:]], ["k"], 3)
    assert meta["o"].dtype == object
    res = pd.concat(outputs).sort_index()
    for got, want in zip(res["o"], _MIXED, strict=True):
        assert type(got) is type(want) and got == want


@pytest.mark.parametrize(
    "values",
    [
        [{"a": 1}, {"b": 2}],  # Arrow would infer a struct and add the missing keys as None
        [[1, 2], [3]],  # ... a list type, and give back numpy arrays
        [1, None],  # ... int64 with nulls, and give back floats
        [1, 2.5],  # ... double, and give back 1.0
    ],
)
def test_case05_object_columns_arrow_would_change(client: Client, values: list[Any]) -> None:
    """pandas only: an ``object`` column Arrow could convert, but not back to the same objects."""
    with dask.config.set({"dataframe.convert-string": False}):
        pdf = pd.DataFrame({"k": [1] * len(values), "o": pd.Series(values, dtype=object)})
        outputs, _ = run_case("pandas", client, [pdf], ["k"], 2)
    res = pd.concat(outputs).sort_index()
    for got, want in zip(res["o"], values, strict=True):
        assert type(got) is type(want) and (got == want or (got is None and want is None))


@pytest.mark.parametrize("kind", KINDS)
def test_case06_meta_declares_a_missing_column(client: Client, kind: str) -> None:
    if kind == "pandas":
        meta = pd.DataFrame(
            {"a": pd.Series([], dtype="int64"), "ghost": pd.Series([], dtype="float64")}
        )
        parts = [pd.DataFrame({"a": [1, 2]}), pd.DataFrame({"a": [3]})]
        df = dd.from_map(_Parts(parts), [0, 1], meta=meta, enforce_metadata=False)
        with pytest.raises(ShuffleError, match="'ghost'"):
            shuffle(df, "a", npartitions=2).compute()
    else:
        schema = pa.schema([("a", pa.int64()), ("ghost", pa.float64())])
        with pytest.raises(ShuffleError, match="'ghost'"):
            shuffle_arrow(client, [pa.table({"a": [1, 2]}), pa.table({"a": [3]})], ["a"], 2, schema)
    _assert_clean(client)


@pytest.mark.parametrize("kind", KINDS)
def test_case07_empty_partitions_and_empty_frame(client: Client, kind: str) -> None:
    pdf = pd.DataFrame(
        {
            "k": np.arange(6),
            "s": pd.array(list("abcdef"), dtype="str"),
            "t": pd.date_range("2021-01-01", periods=6, tz="UTC"),
            "c": pd.Categorical(list("xyxyxy")),
        }
    )
    empty = pdf.iloc[:0]
    # The schema of the whole frame: under pandas 2 an empty object column
    # converts to Arrow's null type, which would make the empty part's schema the meta.
    schema = _arrow(pdf).schema
    outputs, _ = run_case(kind, client, [empty, pdf.iloc[:3], empty, pdf.iloc[3:]], ["k"], 4, schema=schema)
    assert sum(len(_to_pandas(o)) for o in outputs) == 6
    # 0 rows overall: every output partition has the columns and dtypes.
    outputs, _ = run_case(kind, client, [empty, empty], ["k"], 3, schema=schema)
    for o in outputs:
        frame = _to_pandas(o)
        assert len(frame) == 0 and list(frame.columns) == ["k", "s", "t", "c"]


@pytest.mark.parametrize("kind", KINDS)
def test_case08_float_key_nan_and_signed_zero(client: Client, kind: str) -> None:
    a = pd.DataFrame({"k": [np.nan, 0.0, 1.5, -0.0], "v": [0, 1, 2, 3]})
    b = pd.DataFrame({"k": [-0.0, np.nan, 0.0, 2.5, np.nan], "v": [4, 5, 6, 7, 8]})
    outputs, _ = run_case(kind, client, [a, b], ["k"], 7)
    frames = [_to_pandas(o) for o in outputs]
    nan_parts = [j for j, f in enumerate(frames) if f["k"].isna().any()]
    zero_parts = [j for j, f in enumerate(frames) if (f["k"] == 0).any()]
    assert len(nan_parts) == 1 and int(frames[nan_parts[0]]["k"].isna().sum()) == 3
    assert len(zero_parts) == 1
    zeros = frames[zero_parts[0]]["k"][frames[zero_parts[0]]["k"] == 0]
    assert sorted(np.signbit(zeros).tolist()) == [False, False, True, True]  # -0.0 kept as -0.0


@pytest.mark.parametrize("kind", KINDS)
def test_case09_timezone_aware_datetimes(client: Client, kind: str) -> None:
    t = pd.date_range(
        "2021-03-28 00:30", periods=8, freq="30min", tz="Europe/Berlin"
    )  # crosses DST
    pdf = pd.DataFrame({"k": np.arange(8) % 3, "t": t})
    outputs, _ = run_case(kind, client, [pdf.iloc[:5], pdf.iloc[5:]], ["t"], 3)
    res = pd.concat([_to_pandas(o) for o in outputs]).sort_values("t")
    assert str(res["t"].dt.tz) == "Europe/Berlin"
    assert res["t"].tolist() == t.tolist()
    if kind == "arrow":
        assert all(
            o.schema.field("t").type == pa.timestamp("ns", tz="Europe/Berlin") for o in outputs
        ) or all(o.schema.field("t").type.tz == "Europe/Berlin" for o in outputs)


def test_case10_integer_column_names(client: Client) -> None:
    """pandas only (Arrow field names are always strings)."""
    pdf = pd.DataFrame({0: np.arange(9) % 4, 1: [f"s{i}" for i in range(9)], 2: np.arange(9) * 1.5})
    outputs, meta = run_case("pandas", client, [pdf.iloc[:4], pdf.iloc[4:]], [0], 3)
    assert list(meta.columns) == [0, 1, 2]
    assert all(list(o.columns) == [0, 1, 2] for o in outputs)
    # Two keys, one of them integer-named.
    run_case("pandas", client, [pdf.iloc[:4], pdf.iloc[4:]], [1, 0], 2)


def test_case10_labels_arrow_cannot_name(client: Client) -> None:
    """pandas only: labels whose strings collide, a ``Timestamp`` and a ``None`` (NaN) label, and an index named
    ``0`` beside a column ``"0"`` travel pickled (session 24's breaker: refused, or failed at extract)."""
    pdf = pd.DataFrame({0: np.arange(9) % 4, "0": [f"s{i}" for i in range(9)], 2: np.arange(9) * 1.5})
    pdf.columns = pd.Index([0, "0", pd.Timestamp("2020-01-01")], dtype=object)
    outputs, _ = run_case("pandas", client, [pdf.iloc[:4], pdf.iloc[4:]], [0], 3)
    assert all(list(o.columns) == list(pdf.columns) for o in outputs)
    nan_label = pd.DataFrame({"k": np.arange(9) % 4, None: np.arange(9) * 2})
    run_case("pandas", client, [nan_label.iloc[:4], nan_label.iloc[4:]], ["k"], 2)
    named = pd.DataFrame({"k": np.arange(12) % 5, "0": np.arange(12.0)}, index=pd.Index(np.arange(12) * 7, name=0))
    with dask.config.set({"dataframe.shuffle.method": "mpshuffle"}):
        got = dd.from_pandas(named, npartitions=3).shuffle("k", npartitions=2).compute()
    assert got.index.name == 0 and list(got.columns) == ["k", "0"]
    pd.testing.assert_frame_equal(got.sort_index(), named, check_exact=True)


@pytest.mark.parametrize("kind", KINDS)
def test_case11_string_and_integer_key(client: Client, kind: str) -> None:
    rng = np.random.default_rng(11)
    pdf = pd.DataFrame(
        {
            "s": pd.array(rng.choice(["a", "b", "c", None], 60).tolist(), dtype="str"),
            "i": rng.integers(0, 3, 60),
            "v": np.arange(60),
        }
    )
    outputs, _ = run_case(
        kind, client, [pdf.iloc[:20], pdf.iloc[20:45], pdf.iloc[45:]], ["s", "i"], 5
    )
    assert sum(1 for o in outputs if len(_to_pandas(o))) > 1


@pytest.mark.parametrize("kind", KINDS)
def test_case12_order_is_input_partition_then_position(client: Client, kind: str) -> None:
    rng = np.random.default_rng(12)
    parts = [
        pd.DataFrame({"k": rng.integers(0, 4, 50), "pos": np.arange(50) + 100 * i})
        for i in range(4)
    ]
    first, _ = run_case(kind, client, parts, ["k"], 3)  # check() asserts the exact order
    for _ in range(2):
        again, _ = run_case(kind, client, parts, ["k"], 3)
        for a, b in zip(first, again, strict=True):
            assert _to_pandas(a)["pos"].tolist() == _to_pandas(b)["pos"].tolist()
    for out in first:
        pos = _to_pandas(out)["pos"].tolist()
        assert pos == sorted(pos)  # input partition i holds 100*i .. 100*i+49


@pytest.mark.parametrize("kind", KINDS)
def test_case13_total_skew_under_a_small_budget(client: Client, kind: str, tmp_path: Any) -> None:
    from mpshuffle.dask import gather_statistics

    rng = np.random.default_rng(13)
    n = 40_000
    parts = [
        pd.DataFrame(
            {
                "k": np.full(n // 4, 7),
                "x": rng.random(n // 4),
                "s": [f"r{i}" for i in range(n // 4)],
            }
        )
        for _ in range(4)
    ]
    gen = bootstrap_dask_cluster(client, spill_host=256 * 2**10)
    try:
        outputs, _ = run_case(kind, client, parts, ["k"], 4)
        stats = gather_statistics(client)
    finally:
        bootstrap_dask_cluster(client)  # a new generation with the default options
    sizes = [len(_to_pandas(o)) for o in outputs]
    assert sorted(sizes) == [0, 0, 0, n]
    runs = [r for per in stats.values() for r in per if r["generation"] == gen.id]
    last = max(r["op_id"] for r in runs)
    mine = [r for r in runs if r["op_id"] == last]
    assert sum(r["bytes_spilled_disk"] for r in mine) > 0
    assert all(r["bytes_unspilled_disk"] == r["bytes_spilled_disk"] for r in mine)
    _assert_clean(client)


@pytest.mark.parametrize("kind", KINDS)
def test_case14_recompute_and_concurrent_shuffles(client: Client, kind: str) -> None:
    rng = np.random.default_rng(14)
    pdf = pd.DataFrame({"k": rng.integers(0, 40, 2000), "v": np.arange(2000)})
    parts = [pdf.iloc[i * 500 : (i + 1) * 500] for i in range(4)]
    if kind == "pandas":
        df = dd.from_map(_Parts(parts), range(4))
        a = shuffle(df, "k", npartitions=5)
        b = shuffle(df, "k", npartitions=3)

        def compute(coll: Any) -> list[pd.DataFrame]:
            return list(client.compute(coll.to_delayed(), sync=True))

        jobs: list[Callable[[], list[Any]]] = [lambda: compute(a), lambda: compute(b)]

        def both() -> list[Any]:
            return list(client.gather(client.compute([a, b])))

        def whole(parts: list[Any]) -> Any:
            return pd.concat(parts)

        graphs = [dict(coll.optimize().__dask_graph__()) for coll in (a, b)]
    else:
        tables = [_arrow(p) for p in parts]
        name = f"arrow-input-{uuid.uuid4().hex}"
        ga, ka = shuffle_graph(
            [(name, i) for i in range(4)], on=["k"], npartitions=5, meta=tables[0].schema
        )
        gb, kb = shuffle_graph(
            [(name, i) for i in range(4)], on=["k"], npartitions=3, meta=tables[0].schema
        )
        graph = {**ga, **gb, **{(name, i): t for i, t in enumerate(tables)}}
        jobs = [lambda: list(client.get(graph, ka)), lambda: list(client.get(graph, kb))]

        def both() -> list[Any]:
            return [list(x) for x in client.get(graph, [ka, kb])]

        def whole(parts: list[Any]) -> Any:
            return parts

        graphs = [ga, gb]
    barriers = [k for g in graphs for k in g if isinstance(k, str) and k.startswith("mpshuffle-barrier-")]
    assert len(barriers) == 2, barriers
    ref = [jobs[0](), jobs[1]()]
    assert _same(jobs[0](), ref[0])  # the same collection computed twice
    # Two shuffles of one collection at once, from one call...
    ra, rb = both()
    assert _same_frames(ra, whole(ref[0])) and _same_frames(rb, whole(ref[1]))
    # ... and from two threads.
    results: dict[int, Any] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            results[i] = jobs[i]()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a concurrent shuffle hung"
    assert not errors, errors
    assert _same(results[0], ref[0]) and _same(results[1], ref[1])
    _assert_clean(client)
    # The scheduler forgets a run when the result's keys are released, a
    # message that can trail the result (later still on older distributed).
    # Only this test's runs are waited for: a run that an earlier test's late
    # insert made after its graph was released is ended by the orphan rule
    # after its ``timeout`` (SchedulerPlugin.end_orphans), not here.
    ours = set(barriers)

    def runs_left(dask_scheduler: Any) -> list[tuple[str, str, float | None]]:
        tasks = dask_scheduler.tasks
        return [
            (r.barrier_key, tasks[r.barrier_key].state if r.barrier_key in tasks else "absent", r.orphaned_since)
            for r in dask_scheduler.plugins["mpshuffle"].runs.values()
            if r.barrier_key in ours
        ]

    try:
        wait_for(lambda: not client.run_on_scheduler(runs_left), "the scheduler to forget both runs", timeout=30)
    except AssertionError as e:
        left = client.run_on_scheduler(runs_left)
        raise AssertionError(f"{e}; runs left (barrier, its state, orphaned since): {left}") from None


def _same(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Partition by partition, equal values in equal order (and equal dtypes)."""
    return len(a) == len(b) and all(_same_frames(x, y) for x, y in zip(a, b, strict=True))


def _same_frames(x: Any, y: Any) -> bool:
    if isinstance(x, pa.Table):
        return bool(x.equals(y))
    if isinstance(x, list):
        return _same(x, y)
    try:
        pd.testing.assert_frame_equal(x, y)
    except AssertionError:
        return False
    return True


# -- dtypes reconciled with the meta --------------------------------------

_BIG = 2**53 + 1  # the first integer float64 cannot hold


def test_lossless_casts_toward_the_meta_pandas(client: Client) -> None:
    """int64 pieces and Int64 pieces with <NA> in one output: exact Int64, never via float64."""
    a = pd.DataFrame({"k": [1, 1, 1], "v": np.array([_BIG, _BIG + 2, 5], dtype="int64"), "s": None})
    b = pd.DataFrame(
        {"k": [1, 1, 1], "v": pd.array([_BIG + 4, None, 7], dtype="Int64"), "s": ["x", None, "y"]}
    )
    meta = pd.DataFrame(
        {
            "k": pd.Series([], dtype="int64"),
            "v": pd.Series([], dtype="Int64"),
            "s": pd.Series([], dtype="str"),
        }
    )
    outputs, _ = run_case("pandas", client, [a, b], ["k"], 2, meta=meta)
    res = pd.concat(outputs)
    assert res["v"].dtype == "Int64"
    assert res["v"].tolist() == [_BIG, _BIG + 2, 5, _BIG + 4, pd.NA, 7]
    assert res["s"].isna().tolist() == [True, True, True, False, True, False]


def test_lossless_casts_toward_the_meta_arrow(client: Client) -> None:
    """Pieces of narrower or null types are cast to the schema's types."""
    a = pa.table(
        {"k": pa.array([1, 1], pa.int64()), "v": pa.array([1, 2], pa.int32()), "s": pa.nulls(2)}
    )
    b = pa.table(
        {
            "k": pa.array([1, 1], pa.int64()),
            "v": pa.array([_BIG, None], pa.int64()),
            "s": ["x", None],
        }
    )
    schema = pa.schema([("k", pa.int64()), ("v", pa.int64()), ("s", pa.string())])
    outputs = shuffle_arrow(client, [a, b], ["k"], 2, schema)
    check([a, b], outputs, ["k"], schema)
    res = pa.concat_tables(outputs)
    assert res.column("v").to_pylist() == [1, 2, _BIG, None]
    assert res.column("s").to_pylist() == [None, None, "x", None]


@pytest.mark.parametrize("kind", KINDS)
def test_irreconcilable_partition_names_the_column(client: Client, kind: str) -> None:
    """A partition whose values the meta's dtype cannot hold: an error naming the column."""
    good = pd.DataFrame({"k": [1, 2], "num": [1, 2]})
    bad = pd.DataFrame({"k": [1, 2], "num": [1.5, 2.0]})
    if kind == "pandas":
        meta = good.iloc[:0]
        df = dd.from_map(_Parts([good, bad]), [0, 1], meta=meta, enforce_metadata=False)
        with pytest.raises(ShuffleError, match=r"column 'num'.*float64.*int64"):
            shuffle(df, "k", npartitions=1).compute()
    else:
        with pytest.raises(ShuffleError, match=r"column 'num'.*double.*int64"):
            shuffle_arrow(client, [_arrow(good), _arrow(bad)], ["k"], 1, _arrow(good).schema)
    _assert_clean(client)


class _PairComm(Communicator):
    """One of two in-process ranks, each with its own progress thread (for shuffler tests)."""

    def __init__(self, rank: int, peers: list[_PairComm]) -> None:
        super().__init__(rank, 2)
        self.peers = peers
        self.addresses = ["pair://0", "pair://1"]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    async def _send(self, dest: int, tag: Any, frames: Any) -> None:
        self.peers[dest].loop.call_soon_threadsafe(
            self.peers[dest]._deliver, self.rank, tag, frames
        )

    def close(self) -> None:
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            self._loop.close()


@pytest.mark.parametrize("barrier_rank", [0, 1])
def test_fewer_output_partitions_than_ranks(barrier_rank: int) -> None:
    """npartitions=1 on 2 ranks, the barrier on the rank that owns no partition.

    That rank used to close its run on the barrier's own ``inputs-done`` and
    then drop the acks the barrier waited for: a hang until the timeout.
    """
    from mpshuffle.config import resolve_options
    from mpshuffle.shuffler.context import WorkerContext

    peers: list[_PairComm] = []
    peers.extend([_PairComm(0, peers), _PairComm(1, peers)])
    ctxs = [WorkerContext(c, "pair", resolve_options(timeout=5), workers=("a", "b")) for c in peers]
    try:
        table = pa.table({"k": np.arange(20) % 3, "v": np.arange(20)})
        adapter = get_adapter(table)
        for rank in (0, 1):
            ctxs[rank].shuffler(1).insert_frame(rank, table, adapter, ["k"], 1)
        ctxs[barrier_rank].shuffler(1).barrier(1)  # raised ShuffleError after 5 s
        out = adapter.unpack(ctxs[0].shuffler(1).extract(0), table.schema)
        assert out.column("v").to_pylist() == list(range(20)) * 2
        assert ctxs[0].shufflers == {} and ctxs[1].shufflers == {}
    finally:
        for ctx in ctxs:
            ctx.close()


@pytest.mark.parametrize(
    "column",
    [
        pd.Series([[1, 2], [3]] * 3, dtype=pd.ArrowDtype(pa.list_(pa.int64()))),
        pd.Series([{"a": 1}, {"a": 2}] * 3, dtype=pd.ArrowDtype(pa.struct([("a", pa.int64())]))),
        pd.Series(["a", "b"] * 3, dtype=pd.ArrowDtype(pa.dictionary(pa.int32(), pa.string()))),
        pd.Series([1, 2] * 3, dtype=pd.ArrowDtype(pa.decimal128(10, 2))),
        pd.Series(pd.date_range("2020", periods=6, tz="UTC"), dtype=pd.ArrowDtype(pa.timestamp("us", "UTC"))),
    ],
    ids=["list", "struct", "dictionary", "decimal", "timestamp-tz"],
)
def test_arrow_dtype_columns_round_trip(column: pd.Series) -> None:
    """pandas ArrowDtype columns (read_parquet(dtype_backend="pyarrow")), nested ones included."""
    pdf = pd.DataFrame({"k": range(6), "x": column})
    with dask.config.set(scheduler="sync"):
        out = shuffle(dd.from_pandas(pdf, npartitions=2), on="k", npartitions=3).compute()
    assert out["x"].dtype == pdf["x"].dtype
    pd.testing.assert_frame_equal(out.sort_values("k").reset_index(drop=True), pdf)


def test_unhashable_key_column_is_named() -> None:
    pdf = pd.DataFrame({"k": range(4), "x": pd.Series([[1], [2]] * 2, dtype=pd.ArrowDtype(pa.list_(pa.int64())))})
    with (
        dask.config.set(scheduler="sync"),
        pytest.raises(ShuffleError, match="key column 'x' of dtype list<item: int64>.* cannot be hashed"),
    ):
        shuffle(dd.from_pandas(pdf, npartitions=2), on="x", npartitions=2).compute()
