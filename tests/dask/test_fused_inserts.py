"""The inserts run inside their input's tasks where Dask fuses them (``MPInsert``), with the exact result.

A ``from_map`` input is blockwise, so Dask's blockwise fusion puts each
insert into the task that makes its partition; ``from_pandas`` is never
fused, so its graph keeps ``mpshuffle-insert`` tasks. Either way the rows,
their partitions (Dask's hash) and the extract tasks' placement hold.
"""

from __future__ import annotations

from typing import Any

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from dask.core import get_deps
from distributed import Client

import mpshuffle.dask  # noqa: F401  (installs the method)
from mpshuffle.dask.method import MPInsert, MPShuffle

MP = {"dataframe.shuffle.method": "mpshuffle"}


def make(i: int) -> pd.DataFrame:
    rng = np.random.default_rng(i)
    return pd.DataFrame({"k": rng.integers(0, 1000, 200), "v": rng.random(200), "i": i})


def _names(collection: Any) -> set[str]:
    return {(k[0] if isinstance(k, tuple) else k).rsplit("-", 1)[0] for k in dict(collection.dask)}


def _tasks_keys(df: Any, n: int) -> list[set[int]]:
    """The keys in each output partition of Dask's own ``tasks`` shuffle (the partitions mpshuffle must match)."""
    with dask.config.set(scheduler="sync"):
        out = df.shuffle("k", npartitions=n, shuffle_method="tasks")
        return [set(out.partitions[j].compute()["k"]) for j in range(n)]


def _check(parts: list[pd.DataFrame], expected: pd.DataFrame, keys: list[set[int]]) -> None:
    got = pd.concat(parts)
    cols = ["k", "v", "i"]
    pd.testing.assert_frame_equal(
        got[cols].sort_values(cols).reset_index(drop=True), expected[cols].sort_values(cols).reset_index(drop=True)
    )
    for j, part in enumerate(parts):
        assert set(part["k"]) == keys[j], j


def test_from_map_inserts_are_fused() -> None:
    n = 5
    df = dd.from_map(make, range(8))
    expected = pd.concat([make(i) for i in range(8)])
    with dask.config.set({**MP, "scheduler": "sync"}):
        out = df.shuffle("k", npartitions=n)
        optimized = out.optimize()
        names = _names(optimized)
        parts = [out.partitions[j].compute() for j in range(n)]
    assert not any(name.startswith("mpshuffle-insert") for name in names), names
    assert any(name.endswith("-mpshuffle") for name in names), names  # Dask's name for the fused task
    graph = dict(optimized.dask)
    # Fused inserts, the start task, the barrier, the extracts.
    assert len(graph) == 8 + 1 + 1 + n
    # One root: every fused insert depends on the start task (dask.order walks
    # every root's outputs, so n roots cost n^2 to order).
    deps, _ = get_deps(graph)
    roots = [k for k, d in deps.items() if not d]
    assert len(roots) == 1 and str(roots[0]).startswith("mpshuffle-start-"), roots
    shuffle = next(e for e in optimized.expr.walk() if isinstance(e, MPShuffle))
    assert isinstance(shuffle._inserts, MPInsert) and shuffle.frame is not shuffle._inserts
    _check(parts, expected, _tasks_keys(df, n))


def test_from_pandas_inserts_stay_tasks() -> None:
    expected = pd.concat([make(i) for i in range(4)], ignore_index=True)
    df = dd.from_pandas(expected, npartitions=4)
    with dask.config.set({**MP, "scheduler": "sync"}):
        out = df.shuffle("k", npartitions=3)
        names = _names(out.optimize())
        parts = [out.partitions[j].compute() for j in range(3)]
    assert "mpshuffle-insert" in names, names
    _check(parts, expected, _tasks_keys(df, 3))


@pytest.mark.parametrize("partitions", [None, [2, 0]])
def test_fused_on_a_cluster(client: Client, partitions: list[int] | None) -> None:
    """On workers the scheduler plugin finds the extracts by the barrier's dependents and pins them."""
    n = 4
    df = dd.from_map(make, range(6)).map_partitions(lambda d: d.assign(v=d.v * 2))
    expected = pd.concat([make(i).assign(v=lambda d: d.v * 2) for i in range(6)])
    with dask.config.set(MP):
        out = df.shuffle("k", npartitions=n)
        assert not any(name.startswith("mpshuffle-insert") for name in _names(out.optimize()))
        wanted = list(range(n)) if partitions is None else partitions
        parts = client.gather(client.compute([out.partitions[j] for j in wanted]))
    keys = _tasks_keys(df, n)
    for j, part in zip(wanted, parts, strict=True):
        assert set(part["k"]) == keys[j], j
    if partitions is None:
        _check(parts, expected, keys)
