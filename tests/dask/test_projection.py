"""The Projection after Dask's Shuffle, absorbed into mpshuffle's shuffle.

Dask's lowering puts a Projection after every Shuffle (it drops the
``_partitions`` column); ``MPShuffle._simplify_up`` makes it the shuffle's
``output_columns``: the inserts compute the rows' partitions from the whole
frame and send only those columns, and no ``getitem`` task runs per output
partition (one that feeds a blockwise expression, a merge's, stays: Dask
fuses it into that one's tasks). These tests check the graphs (no task beyond insert, barrier and
extract), the values (row multisets, partition membership equal to the
``tasks`` method's, column order and dtypes) and that ``_partitions`` no
longer travels in a sort.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from dask.dataframe.dask_expr import new_collection

import mpshuffle.dask  # noqa: F401  (installs the method)
from mpshuffle.dask.graph import ShuffleSpec, shuffle_graph
from mpshuffle.dask.method import MPShuffle
from mpshuffle.errors import ShuffleError


def _pdf(n: int = 1200) -> pd.DataFrame:
    rng = np.random.default_rng(11)
    return pd.DataFrame({
        "k": rng.integers(0, 500, n),
        "f": rng.standard_normal(n),
        "s": pd.array([f"w{i % 53}" for i in range(n)], dtype="str"),
        "v": np.arange(n),
    })


def _kinds(collection: Any) -> Counter[str]:
    graph = collection.optimize().__dask_graph__()
    return Counter((k[0] if isinstance(k, tuple) else k).rsplit("-", 1)[0] for k in graph)


def _specs(collection: Any) -> list[ShuffleSpec]:
    """The specs of the mpshuffle shuffles in the optimized graph (the tasks as MPShuffle builds them)."""
    found = {}
    for expr in collection.optimize().expr.walk():
        if isinstance(expr, MPShuffle):
            for task in expr._layer().values():
                for arg in task[1:] if isinstance(task, tuple) else ():
                    if isinstance(arg, ShuffleSpec):
                        found[arg.token] = arg
    return list(found.values())


def _by_partition(collection: Any) -> list[pd.DataFrame]:
    return [collection.partitions[j].compute() for j in range(collection.npartitions)]


def _rows(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.sort_values("v").reset_index(drop=True)


def test_config_line_shuffle_and_merge_run_no_getitem_task() -> None:
    df = dd.from_pandas(_pdf(), npartitions=4)
    with dask.config.set({"dataframe.shuffle.method": "mpshuffle"}):
        shuffled = df.shuffle("k", npartitions=3)
        merged = df.merge(df[["k", "v"]].rename(columns={"v": "w"}), on="k", npartitions=3)
        assert _kinds(shuffled) == Counter(
            {"frompandas": 4, "mpshuffle-start": 1, "mpshuffle-insert": 4, "mpshuffle-barrier": 1,
             "mpshuffle-extract": 3}
        )
        kinds = _kinds(merged)
        # A merge's Projection stays in Dask's plan (Dask's own tests look
        # for it) and is fused into the merge's tasks: no task of its own.
        assert "getitem" not in kinds, kinds
        merges = sum(n for k, n in kinds.items() if k.endswith("blockwisemerge"))
        assert kinds["mpshuffle-extract"] == 6 and merges == 3, kinds
        (spec,) = _specs(shuffled)
        assert spec.select is None  # every column of the frame travels; _partitions is appended
        assert list(spec.meta.columns) == ["k", "f", "s", "v"]


def test_output_equals_tasks_partition_by_partition() -> None:
    pdf = _pdf()
    df = dd.from_pandas(pdf, npartitions=5)
    with dask.config.set(scheduler="sync"):
        for on in ("k", ["s", "k"]):
            tasks = _by_partition(df.shuffle(on, npartitions=6, shuffle_method="tasks"))
            ours = _by_partition(df.shuffle(on, npartitions=6, shuffle_method="mpshuffle"))
            for a, b in zip(tasks, ours, strict=True):
                assert list(b.columns) == list(pdf.columns)
                assert b.dtypes.tolist() == a.dtypes.tolist()
                pd.testing.assert_frame_equal(_rows(b), _rows(a))


def test_a_later_selection_sends_only_its_columns() -> None:
    pdf = _pdf()
    df = dd.from_pandas(pdf, npartitions=4)
    with dask.config.set(scheduler="sync"):
        tasks = df.shuffle("k", npartitions=5, shuffle_method="tasks")[["v", "f"]]
        ours = df.shuffle("k", npartitions=5, shuffle_method="mpshuffle")[["v", "f"]]
        (spec,) = _specs(ours)
        # k is hashed in the insert but does not travel.
        assert spec.select == ("f", "v")
        expected = _by_partition(tasks)
        got = _by_partition(ours)
    for a, b in zip(expected, got, strict=True):
        assert list(b.columns) == ["v", "f"]
        pd.testing.assert_frame_equal(_rows(b), _rows(a))
    series = df.shuffle("k", npartitions=5, shuffle_method="mpshuffle")["s"]
    with dask.config.set(scheduler="sync"):
        got_series = series.compute()
    assert sorted(got_series) == sorted(pdf["s"])


def test_sort_does_not_move_the_partitions_column() -> None:
    pdf = _pdf()
    df = dd.from_pandas(pdf, npartitions=4)
    with dask.config.set({"dataframe.shuffle.method": "mpshuffle"}):
        ordered = df.sort_values("f", npartitions=3)
        specs = _specs(ordered)
        with dask.config.set(scheduler="sync"):
            got = ordered.compute()
            expected = df.sort_values("f", npartitions=3, shuffle_method="tasks").compute()
    # The ranges' column is the frame's last: each extract appends it as
    # the constant it is; the Projection that drops it is fused into the
    # per-partition sort.
    assert specs and all(s.select is not None and "_partitions" not in s.select for s in specs)
    assert all("_partitions" not in s.meta.columns for s in specs)
    assert "getitem" not in _kinds(ordered)
    assert list(got.columns) == list(pdf.columns)
    pd.testing.assert_frame_equal(got, expected)
    assert got["v"].tolist() == pdf.sort_values("f")["v"].tolist()


def test_projection_keeps_its_partitions_column_when_asked() -> None:
    # A Projection that keeps _partitions: the extracts append it (as Dask's
    # AssignPartitioningIndex made it), after the selected columns.
    df = dd.from_pandas(_pdf(), npartitions=3)
    with dask.config.set({"dataframe.shuffle.method": "mpshuffle"}):
        expr = df.shuffle("k", npartitions=4).expr.lower_completely()
    shuffle = next(e for e in expr.walk() if isinstance(e, MPShuffle))
    narrowed = shuffle.with_output_columns(["v", "_partitions"])
    with dask.config.set(scheduler="sync"):
        parts = [new_collection(narrowed).partitions[j].compute() for j in range(4)]
    assert sum(map(len, parts)) == 1200
    for j, part in enumerate(parts):
        assert list(part.columns) == ["v", "_partitions"]
        assert set(part["_partitions"]) <= {j}


def test_shuffle_graph_select_checks() -> None:
    meta = _pdf().iloc[:0]
    with pytest.raises(ValueError, match="must keep the key columns"):
        shuffle_graph([("x", 0)], on=["k"], npartitions=2, meta=meta[["v"]], select=["v"])
    graph, _ = shuffle_graph(
        [("x", 0)], on=["k"], npartitions=2, meta=meta[["k", "v"]], select=["k", "v"],
        partitioner=lambda frame: np.zeros(len(frame), dtype=np.int64),
    )
    spec = next(t for k, t in graph.items() if "-start-" in str(k))[1]  # the start task: (started, spec)
    from mpshuffle.dask.graph import insert as insert_task

    lacking = _pdf(10)[["k", "f"]]
    with dask.config.set(scheduler="sync"), pytest.raises(ShuffleError, match=r"lacks the column\(s\) \['v'\]"):
        insert_task(lacking, 0, spec)
