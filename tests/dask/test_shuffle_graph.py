"""Edge cases of shuffle()'s graph: persisted inputs, alias chains, outputs used twice.

``shuffle`` makes the inserts read the targets of pure alias input tasks (a
persisted collection aliases its keys once optimized) and names the output
collection after the extract keys. These tests check, on a LocalCluster and
on Dask's local schedulers, that the results stay right (row multisets,
partition membership, order) wherever that graph is reused, combined or
recomputed, and that the scheduler runs no task beyond the shuffle's own.
"""

from __future__ import annotations

import contextlib
import itertools
from collections import Counter
from collections.abc import Iterator
from typing import Any

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from dask._task_spec import Alias
from dask.core import keys_in_tasks
from distributed import Client, get_task_stream, wait

from conftest import worker_addresses, worker_state
from mpshuffle.dask import merge, shuffle, sort_values
from mpshuffle.table import partition_ids


def _pdf(n: int = 240, mod: int = 17) -> pd.DataFrame:
    return pd.DataFrame(
        {"k": np.arange(n) % mod, "v": np.arange(n), "f": np.arange(n) * 0.5},
        index=pd.Index(np.arange(n) * 2, name="idx"),
    )


def _sorted(df: pd.DataFrame) -> pd.DataFrame:
    return df.sort_values(list(df.columns)).reset_index(drop=True)


def _check(
    expected: pd.DataFrame, parts: list[pd.DataFrame], on: list[str], npartitions: int
) -> None:
    """Same row multiset as ``expected``; every key in exactly the partition its hash names."""
    assert len(parts) == npartitions
    out = pd.concat(parts)
    pd.testing.assert_frame_equal(
        _sorted(out.reset_index(drop=True)), _sorted(expected.reset_index(drop=True))
    )
    keysets = [set(map(tuple, p[on].itertuples(index=False))) for p in parts]
    for a, b in itertools.combinations(keysets, 2):
        assert not (a & b)
    for j, p in enumerate(parts):
        if len(p):
            assert set(partition_ids(p[on], npartitions)) == {j}


def _prefix(key: Any) -> str:
    name = key[0] if isinstance(key, tuple) else key
    return name.rsplit("-", 1)[0]


def _aliases(coll: Any) -> list[Any]:
    """The alias tasks that computing ``coll`` needs.

    Dask's own graph of ``a.partitions[[3, 1]]`` holds aliases of all four of
    ``a``'s partitions; those nothing reads are culled, never run.
    """
    graph = dict(coll.__dask_graph__())
    needed, todo = set(), list(coll.__dask_keys__())
    while todo:
        k = todo.pop()
        if k in needed or k not in graph:
            continue
        needed.add(k)
        todo.extend(keys_in_tasks(graph, [graph[k]]))
    return [k for k in needed if isinstance(graph[k], Alias)]


def _persisted(client: Client, pdf: pd.DataFrame, npartitions: int) -> dd.DataFrame:
    a = dd.from_pandas(pdf, npartitions=npartitions, sort=False).persist()
    wait(a)
    return a


@contextlib.contextmanager
def _tasks_run(client: Client) -> Iterator[list[dict[str, Any]]]:
    """The task-stream records of the tasks that ran within the block (filled on exit).

    Records the task stream already held before the block do not count: its
    window (a bisection on stop times, which the scheduler shifts by each
    worker's estimated clock offset) can also return the tasks of a persist
    that ended just before, as seen on the oldest distributed. A task run
    again (a lost key recomputed) has new start and stop times, so it counts.
    """
    before = {_record_id(t) for t in client.get_task_stream(start=0)}
    ran: list[dict[str, Any]] = []
    with get_task_stream(client) as ts:
        yield ran
    ran.extend(t for t in ts.data if _record_id(t) not in before)


def _record_id(record: dict[str, Any]) -> tuple[Any, ...]:
    """A task-stream record's key and its start/stop times: one execution of one task."""
    return (record["key"], *((s["action"], s["start"], s["stop"]) for s in record["startstops"]))


def _run_counted(client: Client, out: dd.DataFrame) -> tuple[list[pd.DataFrame], Counter[str]]:
    """The output partitions, and how many tasks of each key prefix ran (see :func:`_tasks_run`)."""
    with _tasks_run(client) as ran:
        parts = client.compute(out.to_delayed(), sync=True)
    return parts, Counter(_prefix(t["key"]) for t in ran)


def _shuffle_tasks(counts: Counter[str]) -> dict[str, int]:
    return {p: n for p, n in counts.items() if p.startswith("mpshuffle-")}


def _no_shuffle_task_ran(stream: list[dict[str, Any]], out: dd.DataFrame) -> None:
    """Neither an insert, the barrier nor an extract of ``out`` ran (a persisted
    output's own aliases are named ``mpshuffle-extract-<other token>``)."""
    token = out._name.rsplit("-", 1)[1]
    ran = {
        _prefix(t["key"])
        + "-"
        + str(t["key"][0] if isinstance(t["key"], tuple) else t["key"]).rsplit("-", 1)[1]
        for t in stream
    }
    assert not {n for n in ran if n.endswith(token)}, ran
    assert not {n for n in ran if n.startswith(("mpshuffle-insert", "mpshuffle-barrier"))}, ran


def _no_state_left(client: Client) -> None:
    assert all(s["shufflers"] == [] for s in client.run(worker_state).values())


# -- persisted inputs on a cluster -------------------------------------------


@pytest.mark.parametrize("nout", [1, 3, 4, 9])
def test_persisted_input_runs_only_the_shuffle(client: Client, nout: int) -> None:
    """No alias task in the graph, none run: inserts read the persisted keys."""
    pdf = _pdf()
    a = _persisted(client, pdf, 4)
    assert len(_aliases(a.optimize())) == 4  # what the change removes
    out = shuffle(a, "k", npartitions=nout)
    graph = dict(out.__dask_graph__())
    assert _aliases(out) == []
    persisted = {k for k in graph if _prefix(k).startswith("frompandas")}
    assert len(persisted) == 4
    assert len(graph) == 4 + 1 + 4 + 1 + nout  # futures, start, inserts, barrier, extracts
    assert out.__dask_keys__() == [(out._name, j) for j in range(nout)]
    assert out._name.startswith("mpshuffle-extract-")
    parts, counts = _run_counted(client, out)
    assert counts == Counter(
        {"mpshuffle-start": 1, "mpshuffle-insert": 4, "mpshuffle-barrier": 1, "mpshuffle-extract": nout}
    )
    _check(pdf, parts, ["k"], nout)
    _no_state_left(client)


def test_config_line_on_a_persisted_input_runs_no_alias_task(client: Client) -> None:
    """Through Dask's ``df.shuffle`` with the method set, the inserts read the persisted keys.

    Dask's expression of a persisted frame (``FromGraph``) names its
    partitions anew and points to the held ones through an ``Alias`` task
    each; with the inserts reading the held keys, no alias is needed, and
    none runs. The output is Dask's (its hash decides the partitions).
    """
    from dask.dataframe.shuffle import partitioning_index

    pdf = _pdf()
    a = _persisted(client, pdf, 4)
    with dask.config.set({"dataframe.shuffle.method": "mpshuffle"}):
        out = a.shuffle("k", npartitions=3).optimize()
    assert _aliases(out) == []
    parts, counts = _run_counted(client, out)
    assert counts == Counter(
        {"mpshuffle-start": 1, "mpshuffle-insert": 4, "mpshuffle-barrier": 1, "mpshuffle-extract": 3}
    )
    assert len(parts) == 3
    pd.testing.assert_frame_equal(
        _sorted(pd.concat(parts).reset_index(drop=True)), _sorted(pdf.reset_index(drop=True))
    )
    for j, p in enumerate(parts):
        if len(p):
            ids = partitioning_index(p[["k"]].astype(np.float64), 3, cast_dtype=None)
            assert set(np.asarray(ids).tolist()) == {j}
    _no_state_left(client)


def test_alias_chain_and_reordered_partitions(client: Client) -> None:
    """``a.partitions[[3, 1]]`` aliases aliases of futures; order follows the selection."""
    pdf = _pdf()
    a = _persisted(client, pdf, 4)
    sel = a.partitions[[3, 1]]
    assert len(_aliases(sel.optimize())) > 2  # alias -> alias -> future
    out = shuffle(sel, "k", npartitions=2)
    assert _aliases(out) == []
    parts, counts = _run_counted(client, out)
    assert _shuffle_tasks(counts) == {
        "mpshuffle-start": 1,
        "mpshuffle-insert": 2,
        "mpshuffle-barrier": 1,
        "mpshuffle-extract": 2,
    }
    assert set(counts) == set(_shuffle_tasks(counts))
    expected = pd.concat([a.partitions[3].compute(), a.partitions[1].compute()])
    _check(expected, parts, ["k"], 2)
    # Rows of input partition 3 come before those of partition 1 in every output.
    first = set(a.partitions[3].compute()["v"])
    for p in parts:
        origin = [v in first for v in p["v"]]
        assert origin == sorted(origin, reverse=True)


def test_duplicate_and_persist_of_persist(client: Client) -> None:
    pdf = _pdf()
    a = _persisted(client, pdf, 3)
    twice = a.partitions[[0, 0, 2]]
    parts, _ = _run_counted(client, shuffle(twice, "k", npartitions=4))
    expected = pd.concat([pdf.iloc[:80], pdf.iloc[:80], pdf.iloc[160:]])
    _check(expected, parts, ["k"], 4)
    b = a.persist()
    wait(b)
    out = shuffle(b, "k", npartitions=2)
    assert _aliases(out) == []
    parts, counts = _run_counted(client, out)
    assert set(counts) == {"mpshuffle-start", "mpshuffle-insert", "mpshuffle-barrier", "mpshuffle-extract"}
    _check(pdf, parts, ["k"], 2)


def test_partially_persisted_input(client: Client) -> None:
    """Some partitions persisted, the others computed in the same graph."""
    pdf = _pdf()
    a = _persisted(client, pdf, 4)
    lazy = dd.from_pandas(pdf, npartitions=4, sort=False).assign(v=lambda d: d.v + 1000)
    mixed = dd.concat([a.partitions[:2], lazy.partitions[2:]])
    out = shuffle(mixed, ["k"], npartitions=3)
    parts, _ = _run_counted(client, out)
    expected = pd.concat([pdf.iloc[:120], pdf.iloc[120:].assign(v=pdf.v.iloc[120:] + 1000)])
    _check(expected, parts, ["k"], 3)
    _no_state_left(client)


def test_from_delayed_futures_and_chains_around(client: Client) -> None:
    pdf = _pdf()
    futures = client.compute(dd.from_pandas(pdf, npartitions=3, sort=False).to_delayed())
    df = dd.from_delayed(futures, meta=pdf.iloc[:0])
    df = df[df.v % 5 != 0].assign(w=lambda d: d.k * 10).map_partitions(lambda d: d.iloc[::-1])
    out = shuffle(df, ["k", "w"], npartitions=5)
    after = out[out.f > 10].assign(z=lambda d: d.v - d.k).map_partitions(lambda d: d.head(1000))
    parts = client.compute(after.to_delayed(), sync=True)
    base = pdf[pdf.v % 5 != 0].assign(w=lambda d: d.k * 10)
    expected = base[base.f > 10].assign(z=lambda d: d.v - d.k)
    _check(expected, parts, ["k", "w"], 5)


def test_read_parquet_input(client: Client, tmp_path: Any) -> None:
    pdf = _pdf(300).reset_index(drop=True)
    for i in range(3):
        pdf.iloc[i * 100 : (i + 1) * 100].to_parquet(tmp_path / f"part{i}.parquet")
    df = dd.read_parquet(str(tmp_path), columns=["k", "v"])
    out = shuffle(df, "k", npartitions=4, ignore_index=True)
    parts, _ = _run_counted(client, out)
    _check(pdf[["k", "v"]], parts, ["k"], 4)
    # Persisted first: still correct, still no alias task.
    p = df.persist()
    wait(p)
    out2 = shuffle(p, "k", npartitions=4, ignore_index=True)
    assert _aliases(out2) == []
    parts2, counts = _run_counted(client, out2)
    assert set(counts) == {"mpshuffle-start", "mpshuffle-insert", "mpshuffle-barrier", "mpshuffle-extract"}
    for x, y in zip(parts, parts2, strict=True):
        pd.testing.assert_frame_equal(x, y)


def test_empty_collections(client: Client) -> None:
    pdf = _pdf()
    a = _persisted(client, pdf, 3)
    empty = a[a.v < 0].persist()
    out = shuffle(empty, "k", npartitions=4)
    res = out.compute()
    assert len(res) == 0 and list(res.columns) == ["k", "v", "f"] and res.index.name == "idx"
    assert list(res.dtypes) == list(pdf.dtypes)
    one = shuffle(dd.from_pandas(pdf.iloc[:0], npartitions=1), "k", npartitions=2)
    assert len(one.compute()) == 0
    some = a[a.v < 20]  # two of three inputs empty
    parts, _ = _run_counted(client, shuffle(some, "k", npartitions=3))
    _check(pdf[pdf.v < 20], parts, ["k"], 3)
    _no_state_left(client)


# -- the same collection or output used more than once ----------------------


def test_same_shuffle_twice_in_one_compute(client: Client) -> None:
    pdf = _pdf()
    a = _persisted(client, pdf, 4)
    s1, s2 = shuffle(a, "k", npartitions=3), shuffle(a, "k", npartitions=3)
    assert s1._name == s2._name  # the same graph: one shuffle, run once
    with _tasks_run(client) as ran:
        r1, r2 = dask.compute(s1, s2)
    assert Counter(_prefix(t["key"]) for t in ran)["mpshuffle-barrier"] == 1
    pd.testing.assert_frame_equal(r1, r2)
    pd.testing.assert_frame_equal(r1.sort_index(), pdf)
    both = dd.concat([s1, s2])
    assert both.npartitions == 6
    parts = client.compute(both.to_delayed(), sync=True)
    for j in range(3):
        pd.testing.assert_frame_equal(parts[j], parts[j + 3])
    _check(pdf, parts[:3], ["k"], 3)
    _no_state_left(client)


def test_two_shuffles_of_one_input_in_one_compute(client: Client) -> None:
    """Different keys and sizes over the same persisted input: two runs, both right."""
    pdf = _pdf()
    a = _persisted(client, pdf, 4)
    by_k = shuffle(a, "k", npartitions=3)
    by_v = shuffle(a, "v", npartitions=5, ignore_index=True)
    d1, d2 = by_k.to_delayed(), by_v.to_delayed()
    with _tasks_run(client) as ran:
        r1, r2 = dask.compute(d1, d2)
    assert Counter(_prefix(t["key"]) for t in ran)["mpshuffle-barrier"] == 2
    _check(pdf, list(r1), ["k"], 3)
    _check(pdf.reset_index(drop=True), list(r2), ["v"], 5)
    _no_state_left(client)


def test_input_keys_also_used_outside_the_shuffle(client: Client) -> None:
    """The persisted input appears next to its shuffle in one graph."""
    pdf = _pdf()
    a = _persisted(client, pdf, 4)
    out = shuffle(a, "k", npartitions=3)
    both = dd.concat([a, out])
    assert both.npartitions == 7
    parts = client.compute(both.to_delayed(), sync=True)
    for i in range(4):
        pd.testing.assert_frame_equal(parts[i], pdf.iloc[i * 60 : (i + 1) * 60])
    _check(pdf, parts[4:], ["k"], 3)
    lazy = dd.from_pandas(pdf, npartitions=4, sort=False)
    both = dd.concat([lazy, shuffle(lazy, "k", npartitions=2)])
    parts = client.compute(both.to_delayed(), sync=True)
    _check(pdf, parts[4:], ["k"], 2)
    assert pd.concat(parts[:4]).equals(pdf)
    # Dask's own merge of the input with its shuffle.
    res = a.merge(out, on="v", suffixes=("_a", "_s")).compute()
    assert len(res) == len(pdf)
    assert (res.k_a == res.k_s).all() and (res.f_a == res.f_s).all()
    _no_state_left(client)


def test_output_persisted_then_used_twice(client: Client) -> None:
    pdf = _pdf()
    a = _persisted(client, pdf, 4)
    out = shuffle(a, "k", npartitions=3)
    p = out.persist()
    wait(p)
    with _tasks_run(client) as ran:
        total = p.v.sum().compute()
        n = len(p)
        parts = client.compute(p.to_delayed(), sync=True)
    assert total == pdf.v.sum() and n == len(pdf)
    _no_shuffle_task_ran(ran, out)
    _check(pdf, parts, ["k"], 3)
    # The un-persisted output again: its keys are the persisted extract keys.
    parts2 = client.compute(out.to_delayed(), sync=True)
    for x, y in zip(parts, parts2, strict=True):
        pd.testing.assert_frame_equal(x, y)
    # A shuffle of the persisted output.
    again = shuffle(p, "v", npartitions=2)
    assert _aliases(again) == []
    parts3, counts = _run_counted(client, again)
    assert set(counts) == {"mpshuffle-start", "mpshuffle-insert", "mpshuffle-barrier", "mpshuffle-extract"}
    _check(pdf, parts3, ["v"], 2)
    del p
    _no_state_left(client)


def test_client_persist_then_client_compute(client: Client) -> None:
    pdf = _pdf()
    out = shuffle(dd.from_pandas(pdf, npartitions=4), "k", npartitions=3)
    p = client.persist(out)
    wait(p)
    with _tasks_run(client) as ran:
        s = client.compute(p.v.sum(), sync=True)
        parts = client.compute(p.to_delayed(), sync=True)
    assert s == pdf.v.sum()
    _no_shuffle_task_ran(ran, out)
    _check(pdf, parts, ["k"], 3)
    _no_state_left(client)


def test_output_collection_methods(client: Client) -> None:
    pdf = _pdf()
    a = _persisted(client, pdf, 4)
    out = shuffle(a, "k", npartitions=5)
    assert out.npartitions == 5 and out.divisions == (None,) * 6
    opt = out.optimize()
    assert opt.__dask_keys__() == out.__dask_keys__()
    full = client.compute(out.to_delayed(), sync=True)
    _check(pdf, full, ["k"], 5)
    pd.testing.assert_frame_equal(out.partitions[3].compute(), full[3])
    pd.testing.assert_frame_equal(out.partitions[[4, 0]].compute(), pd.concat([full[4], full[0]]))
    pd.testing.assert_frame_equal(out.head(3, npartitions=1), full[0].head(3))
    pd.testing.assert_frame_equal(out.head(1000, npartitions=-1), pd.concat(full))
    rep = out.repartition(npartitions=2)
    assert rep.npartitions == 2
    pd.testing.assert_frame_equal(rep.compute(), pd.concat(full))
    pd.testing.assert_frame_equal(opt.compute(), pd.concat(full))
    pd.testing.assert_frame_equal(out[["k"]].compute(), pd.concat(full)[["k"]])
    g = out.groupby("k").v.sum().compute().sort_index()
    pd.testing.assert_series_equal(g, pdf.groupby("k").v.sum())
    _no_state_left(client)


def test_recompute_after_worker_restart(client: Client) -> None:
    """The same output collection, computed again after a worker restarted."""
    pdf = _pdf()
    df = dd.from_pandas(pdf, npartitions=4).map_partitions(lambda d: d.assign(v=d.v * 2))
    out = shuffle(df, "k", npartitions=3)
    first = client.compute(out.to_delayed(), sync=True)
    # One worker process restarted (a new address, so a new generation); both
    # would cost twice the time for nothing more.
    before = set(worker_addresses(client))
    client.restart_workers([min(before)])
    assert set(worker_addresses(client)) != before
    second = client.compute(out.to_delayed(), sync=True)
    _check(pdf.assign(v=pdf.v * 2), second, ["k"], 3)
    for x, y in zip(first, second, strict=True):
        pd.testing.assert_frame_equal(x, y)
    _no_state_left(client)


# -- what is built on shuffle() -------------------------------------------


def test_join_sort_and_accessor_on_persisted_inputs(client: Client) -> None:
    import mpshuffle  # noqa: F401  (registers df.mpshuffle)

    pdf = _pdf()
    a = _persisted(client, pdf, 4)
    right = pd.DataFrame({"k": np.arange(0, 34, 2), "r": np.arange(17) * 3})
    b = dd.from_pandas(right, npartitions=2).persist()
    wait(b)
    for how in ["inner", "left"]:
        res = merge(a, b, on="k", how=how).compute()
        exp = pdf.reset_index(drop=True).merge(right, on="k", how=how)
        pd.testing.assert_frame_equal(
            _sorted(res.reset_index(drop=True)), _sorted(exp), check_dtype=False
        )
    # A self join of one persisted collection: both sides are the same shuffle.
    res = merge(a, a, on="k").compute()
    exp = pdf.reset_index(drop=True).merge(pdf.reset_index(drop=True), on="k")
    pd.testing.assert_frame_equal(_sorted(res.reset_index(drop=True)), _sorted(exp))
    # Joined with its own shuffle.
    res = merge(a, shuffle(a, "k", npartitions=3), on="v").compute()
    assert len(res) == len(pdf) and (res.k_x == res.k_y).all()
    s = sort_values(a.partitions[[2, 0]], "f", ascending=False).compute()
    exp = pd.concat([pdf.iloc[120:180], pdf.iloc[:60]]).sort_values("f", ascending=False)
    pd.testing.assert_frame_equal(s, exp)
    via = a.mpshuffle.shuffle("k", npartitions=2)
    assert _aliases(via) == []
    _check(pdf, client.compute(via.to_delayed(), sync=True), ["k"], 2)
    srt = a.mpshuffle.shuffle("k").mpshuffle.sort_values("v").compute()
    pd.testing.assert_frame_equal(srt, pdf)
    idx = shuffle(a, "k", npartitions=3).mpshuffle.set_index("v").compute()
    pd.testing.assert_frame_equal(idx, pdf.reset_index(drop=True).set_index("v"))
    _no_state_left(client)


# -- local schedulers ---------------------------------------------------------


@pytest.mark.parametrize("scheduler", ["sync", "threads"])
def test_local_persisted_input(scheduler: str) -> None:
    pdf = _pdf()
    with dask.config.set(scheduler=scheduler):
        a = dd.from_pandas(pdf, npartitions=4, sort=False).persist()
        out = shuffle(a, "k", npartitions=3)
        assert _aliases(out) == []
        parts = list(dask.compute(*out.to_delayed()))
        _check(pdf, parts, ["k"], 3)
        chain = shuffle(a.partitions[[3, 1]], "k", npartitions=2)
        assert _aliases(chain) == []
        _check(
            pd.concat([pdf.iloc[180:], pdf.iloc[60:120]]),
            list(dask.compute(*chain.to_delayed())),
            ["k"],
            2,
        )
        r1, r2 = dask.compute(out, shuffle(a, "v", npartitions=2))
        pd.testing.assert_frame_equal(r1.sort_index(), pdf)
        pd.testing.assert_frame_equal(r2.sort_index(), pdf)
        p = out.persist()
        assert p.v.sum().compute() == pdf.v.sum() and len(p) == len(pdf)


@pytest.mark.parametrize("column", ["dependencies", "key", "target"])
def test_local_persisted_frame_with_task_attribute_column(column: str) -> None:
    """A persisted partition is a frame in the graph; its column names are no task's attributes."""
    pdf = pd.DataFrame({"k": np.arange(50) % 7, column: np.arange(50)})
    with dask.config.set(scheduler="sync"):
        a = dd.from_pandas(pdf, npartitions=3, sort=False).persist()
        out = shuffle(a, "k", npartitions=2)
        assert _aliases(out) == []
        _check(pdf, list(dask.compute(*out.to_delayed())), ["k"], 2)


def test_shuffle_of_a_shuffle_and_of_a_pickled_output(client: Client) -> None:
    """The output's keys (the extract keys) as the next shuffle's inputs, also after pickling."""
    import pickle

    pdf = _pdf()
    a = _persisted(client, pdf, 4)
    first = shuffle(a, "k", npartitions=3)
    second = shuffle(first, "k", npartitions=3)  # same hash, same partitions
    third = shuffle(first, "v", npartitions=2, ignore_index=True)
    with _tasks_run(client) as ran:
        r1, r2, r3 = dask.compute(first.to_delayed(), second.to_delayed(), third.to_delayed())
    counts = Counter(_prefix(t["key"]) for t in ran)
    assert counts == Counter(
        {"mpshuffle-start": 3, "mpshuffle-insert": 4 + 3 + 3, "mpshuffle-barrier": 3,
         "mpshuffle-extract": 3 + 3 + 2}
    )
    _check(pdf, list(r1), ["k"], 3)
    for x, y in zip(r1, r2, strict=True):
        pd.testing.assert_frame_equal(x, y)
    _check(pdf.reset_index(drop=True), list(r3), ["v"], 2)
    again = pickle.loads(pickle.dumps(second))
    assert again.__dask_keys__() == second.__dask_keys__()
    for x, y in zip(client.compute(again.to_delayed(), sync=True), r2, strict=True):
        pd.testing.assert_frame_equal(x, y)
    _no_state_left(client)


def test_skip_aliases_keeps_what_other_tasks_read() -> None:
    """Only aliases nothing else reads leave the graph, whatever kind of task reads them."""
    from dask._task_spec import Task, TaskRef

    from mpshuffle.dask.dataframe import _skip_aliases

    frame = pd.DataFrame({"dependencies": [1, 2], "target": [3, 4]})
    graph: dict[Any, Any] = {
        "t0": frame,
        "t1": frame,
        ("a", 0): Alias(("a", 0), "mid0"),  # input -> alias -> value
        "mid0": Alias("mid0", "t0"),
        ("a", 1): Alias(("a", 1), "mid1"),
        "mid1": Alias("mid1", "t1"),
        ("a", 2): Alias(("a", 2), "t1"),
        "legacy": (len, ("a", 2)),  # a legacy tuple task reads input 2's alias
        "new": Task("new", len, TaskRef("mid1")),  # a Task reads the middle of chain 1
    }
    resolved = _skip_aliases(graph, [("a", 0), ("a", 1), ("a", 2)])
    assert resolved == ["t0", "t1", "t1"]
    assert set(graph) == {"t0", "t1", "mid1", ("a", 2), "legacy", "new"}
    assert graph["t0"] is frame


def test_merge_and_sorts_of_persisted_inputs_run_no_alias_task(client: Client) -> None:
    """Merges and sorts take the persisted keys and name their outputs after their own tasks."""
    from mpshuffle.dask import set_index

    pdf = _pdf()
    a = _persisted(client, pdf, 4)
    b = _persisted(client, pdf.rename(columns={"v": "w"}), 3)
    m = merge(a, b, on="k", npartitions=5)
    assert _aliases(m) == []
    parts, counts = _run_counted(client, m)
    assert counts == Counter({"mpshuffle-start": 2, "mpshuffle-insert": 7, "mpshuffle-barrier": 2,
                              "mpshuffle-extract": 10,
                              "mpshuffle-merge": 5})
    pd.testing.assert_frame_equal(
        pd.concat(parts).sort_values(["k", "v", "w"], ignore_index=True),
        pdf.merge(pdf.rename(columns={"v": "w"}), on="k").sort_values(["k", "v", "w"], ignore_index=True),
        check_dtype=False,
    )
    s = sort_values(a, "v", npartitions=3)  # the boundaries are sampled here, before the stream
    assert _aliases(s) == []
    parts, counts = _run_counted(client, s)
    assert counts == Counter({"mpshuffle-range-start": 1, "mpshuffle-range-insert": 4, "mpshuffle-range-barrier": 1,
                              "mpshuffle-range-extract": 3, "mpshuffle-sort": 3})
    assert pd.concat(parts)["v"].tolist() == sorted(pdf["v"].tolist())
    i = set_index(a, "v", npartitions=3)
    assert _aliases(i) == [] and i.known_divisions
    parts, counts = _run_counted(client, i)
    assert set(counts) == {"mpshuffle-range-start", "mpshuffle-range-insert", "mpshuffle-range-barrier",
                           "mpshuffle-range-extract", "mpshuffle-set-index"}
    assert pd.concat(parts).index.tolist() == sorted(pdf["v"].tolist())


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (lambda df: np.full(len(df), 3), r"must lie in \[0, 3\), got values from 3 to 3"),
        (lambda df: np.zeros(len(df) + 1, dtype=np.int64), r"must have shape \(10,\), got \(11,\)"),
    ],
)
def test_a_partitioner_returning_bad_ids_fails_naming_it(bad: Any, match: str) -> None:
    """shuffle_graph's partitioner is checked by the adapters' one rule (check_ids), named in the error."""
    from dask.core import get as dask_get

    from mpshuffle.dask import shuffle_graph
    from mpshuffle.errors import ShuffleError

    frame = pd.DataFrame({"k": np.arange(10), "v": np.arange(10.0)})
    graph, keys = shuffle_graph(["in"], on=["k"], npartitions=3, meta=frame.iloc[:0], partitioner=bad)
    graph["in"] = frame
    with pytest.raises(ShuffleError, match=rf"the partitioner .* returned bad ids: .*{match}"):
        dask_get(graph, keys)  # the synchronous scheduler: the local runtime


def _spec_of_graph(partitioner: Any = None) -> Any:
    from mpshuffle.dask.graph import shuffle_graph

    meta = _pdf().iloc[:0]
    graph, keys = shuffle_graph([("in", i) for i in range(3)], on=["k"], npartitions=4, meta=meta,
                                partitioner=partitioner)
    return graph[keys[0]][3]  # (extract, barrier, j, spec)


@pytest.mark.parametrize("partitioner", [None, "lambda"])
def test_spec_pickles_its_fields_once_and_unpickles_to_one_object(partitioner: Any) -> None:
    import pickle

    import cloudpickle

    from mpshuffle.dask import graph as graph_module

    def by_k(frame: pd.DataFrame) -> np.ndarray:
        return frame["k"].to_numpy() % 4

    spec = _spec_of_graph(by_k if partitioner == "lambda" else None)
    # A partitioner local to this function needs cloudpickle, as Dask's pickling falls back to it.
    blob = cloudpickle.dumps(spec) if partitioner else pickle.dumps(spec)
    assert spec.__dict__["_pickled"] is not None
    graph_module._spec_of.cache_clear()
    first, second = pickle.loads(blob), pickle.loads(blob)
    assert first is second  # the tasks of one shuffle share one spec in a worker
    for field in ("token", "on", "npartitions", "insert_name", "barrier_name", "extract_name",
                  "keep_index", "device", "on_lossy_cast", "options", "select"):
        assert getattr(first, field) == getattr(spec, field)
    pd.testing.assert_frame_equal(first.meta, spec.meta)
    frame = _pdf()
    if partitioner:
        np.testing.assert_array_equal(first.partitioner(frame), by_k(frame))
    else:
        assert first.partitioner is None
    # Pickled again (a worker handing the task on), it gives the same bytes.
    assert pickle.dumps(first) == pickle.dumps(spec)


def test_unpickled_specs_are_bounded() -> None:
    import pickle

    from mpshuffle.dask import graph as graph_module

    graph_module._spec_of.cache_clear()
    meta = _pdf().iloc[:0]
    from mpshuffle.dask.graph import shuffle_graph

    bound = graph_module._spec_of.cache_info().maxsize
    for n in range(bound + 5):
        graph, keys = shuffle_graph([("in", 0)], on=["k"], npartitions=n + 1, meta=meta)
        spec = graph[keys[0]][3]
        assert pickle.loads(pickle.dumps(spec)).npartitions == n + 1
    assert graph_module._spec_of.cache_info().currsize == bound
