"""End-to-end shuffles of dask collections on a LocalCluster and in one process."""

from __future__ import annotations

import functools
import itertools

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from distributed import Client, wait

from conftest import wait_for, worker_state
from mpshuffle.dask import shuffle, shuffle_graph
from mpshuffle.errors import ShuffleError
from mpshuffle.table import partition_ids


def _sorted(df: pd.DataFrame) -> pd.DataFrame:
    return df.sort_values(list(df.columns)).reset_index(drop=True)


def _check(inp: pd.DataFrame, parts: list[pd.DataFrame], on: list[str]) -> None:
    """Same row multiset; each key in exactly one partition, the one its hash names."""
    out = pd.concat(parts, ignore_index=True)
    pd.testing.assert_frame_equal(_sorted(out), _sorted(inp.reset_index(drop=True)))
    keysets = [set(map(tuple, p[on].itertuples(index=False))) for p in parts]
    for a, b in itertools.combinations(keysets, 2):
        assert not (a & b)
    for j, p in enumerate(parts):
        if len(p):
            assert set(partition_ids(p[on], len(parts))) == {j}


def test_seed_example_timeseries(client: Client) -> None:
    """The seed's own example on CPU: timeseries shuffled on name."""
    df = dask.datasets.timeseries(end="2000-01-05", freq="10s", seed=1).reset_index(drop=True)
    out = shuffle(df, ["name"])
    parts = [p for p in client.compute(out.to_delayed(), sync=True)]
    assert len(parts) == df.npartitions
    _check(df.compute(), parts, ["name"])
    assert all(s["shufflers"] == [] for s in client.run(worker_state).values())


def test_keeps_index_and_dtypes(client: Client) -> None:
    pdf = pd.DataFrame(
        {
            "k": np.arange(1000) % 37,
            "f": np.linspace(0, 1, 1000),
            "s": pd.array([f"v{i % 11}" for i in range(1000)], dtype="str"),
            "c": pd.Categorical(["a", "b", "c", "d"] * 250),
        },
        index=pd.Index(np.arange(1000) * 3, name="idx"),
    )
    df = dd.from_pandas(pdf, npartitions=5)
    out = shuffle(df, "k", npartitions=3)
    res = out.compute()
    expected = df.compute()  # Dask's own dtypes (it turns str into string[pyarrow])
    assert list(res.dtypes) == list(expected.dtypes) == list(out._meta.dtypes)
    assert res.index.name == "idx"
    pd.testing.assert_frame_equal(res.sort_index(), expected)


def _slice(frame: pd.DataFrame, n: int, i: int) -> pd.DataFrame:
    """Part ``i`` of ``n`` of ``frame``, by position."""
    step = -(-len(frame) // n)
    return frame.iloc[i * step : (i + 1) * step].copy()


@pytest.mark.parametrize("dtype", ["Int64", "string"])
def test_an_extension_index_keeps_its_dtype_and_values_through_the_config_line(client: Client, dtype: str) -> None:
    # Found by a session's breaker: the kept index came back float64 (NA as NaN,
    # 2**53 + 1 rounded) or as pandas' default str, unlike Dask's meta and tasks.
    values = [2**53 + i if i % 9 else None for i in range(400)] if dtype == "Int64" else [
        f"r{i}" if i % 9 else None for i in range(400)
    ]
    pdf = pd.DataFrame({"k": np.arange(400) % 13, "v": np.arange(400.0)},
                       index=pd.Index(pd.array(values, dtype=dtype), name="ix"))
    # from_map: from_pandas refuses an index with nulls that it does not call numeric.
    left = dd.from_map(functools.partial(_slice, pdf, 4), range(4))
    results = {}
    for method in ("tasks", "mpshuffle"):
        with dask.config.set({"dataframe.shuffle.method": method}):
            out = left.shuffle("k", npartitions=3)
            parts = client.compute(out.to_delayed(), sync=True)
        assert all(p.index.dtype == out._meta.index.dtype == pdf.index.dtype for p in parts)
        results[method] = pd.concat(parts).sort_values("v")
    pd.testing.assert_frame_equal(results["mpshuffle"], results["tasks"], check_exact=True)
    pd.testing.assert_frame_equal(results["mpshuffle"], pdf, check_exact=True)
    # A join on such an index (a merge on the index) through the same line.
    right = dd.from_map(functools.partial(_slice, pd.DataFrame({"w": np.arange(400) * 2}, index=pdf.index), 3), range(3))
    with dask.config.set({"dataframe.shuffle.method": "mpshuffle"}):
        joined = left.merge(right, left_index=True, right_index=True, how="inner").compute()
    expected = pdf.merge(pdf[[]].assign(w=np.arange(400) * 2), left_index=True, right_index=True, how="inner")
    assert joined.index.dtype == pdf.index.dtype
    pd.testing.assert_frame_equal(joined.sort_values(["v", "w"]), expected.sort_values(["v", "w"]), check_exact=True)


def test_ignore_index_and_more_partitions(client: Client) -> None:
    pdf = pd.DataFrame({"a": np.arange(300) % 7, "b": np.arange(300)})
    df = dd.from_pandas(pdf, npartitions=3)
    out = shuffle(df, ["a"], npartitions=11, ignore_index=True)
    parts = client.compute(out.to_delayed(), sync=True)
    assert len(parts) == 11
    _check(pdf, parts, ["a"])


def test_output_order_is_input_partition_then_position(client: Client) -> None:
    pdf = pd.DataFrame({"k": [1, 2, 1, 2, 1, 2, 1, 2], "pos": range(8)})
    df = dd.from_pandas(pdf, npartitions=4, sort=False)
    out = shuffle(df, "k", npartitions=2, ignore_index=True)
    for part in client.compute(out.to_delayed(), sync=True):
        for _k, g in part.groupby("k"):
            assert list(g["pos"]) == sorted(g["pos"])
    # and the same on a second computation
    first = out.compute()
    second = out.compute()
    pd.testing.assert_frame_equal(first, second)


def test_extracts_run_on_owner_and_state_is_freed(client: Client) -> None:
    pdf = pd.DataFrame({"k": np.arange(500) % 13, "v": np.arange(500)})
    df = dd.from_pandas(pdf, npartitions=4)
    out = shuffle(df, "k", npartitions=6).persist()
    wait(out)
    who = client.who_has(out)
    ranks = client.run(lambda dask_worker: dask_worker.plugins["mpshuffle"].context.rank)
    owner_of = {r: w for w, r in ranks.items()}
    for key, workers in who.items():
        j = key[1] if isinstance(key, tuple) else None
        if j is not None:
            assert list(workers) == [owner_of[j % len(ranks)]]
    del out
    state = client.run(worker_state)
    assert all(s["shufflers"] == [] for s in state.values())
    assert client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.plugins["mpshuffle"].runs)) == 0


def _live_run_state(dask_worker) -> dict:  # type: ignore[no-untyped-def]
    """The run objects alive on a worker (after a collection) and what its context still holds."""
    import gc

    from mpshuffle.memory.packed import PieceTable
    from mpshuffle.memory.postbox import Chunk, Postbox, _Segment
    from mpshuffle.memory.resource import MemoryType
    from mpshuffle.shuffler.host import Shuffler

    gc.collect()
    kinds = (Shuffler, Postbox, Chunk, PieceTable, _Segment)
    live = sorted(type(o).__name__ for o in gc.get_objects() if isinstance(o, kinds))
    plugin = dask_worker.plugins["mpshuffle"]
    ctx = plugin.context
    return {"live": live, "shufflers": dict(ctx.shufflers), "runs": dict(plugin.runs),
            "host": ctx.resource.used(MemoryType.HOST), "pool": ctx.pool.idle_bytes}


def test_a_finished_shuffle_leaves_none_of_its_state_on_the_workers(client: Client) -> None:
    """Through the config line, many partitions of small pieces: once the output is computed and released,
    no run, postbox, chunk, piece table or filed segment of it is alive on any worker, and nothing is
    reserved or pooled."""
    pdf = pd.DataFrame({"k": np.arange(40_000) * 7919 % 10_007, "v": np.arange(40_000)})
    df = dd.from_pandas(pdf, npartitions=40)
    with dask.config.set({"dataframe.shuffle.method": "mpshuffle"}):
        out = df.shuffle("k", npartitions=200).persist()
    wait(out)
    got = out.compute()
    pd.testing.assert_frame_equal(got.sort_index(), pdf)
    del out, got
    wait_for(lambda: all(not s["runs"] and not s["live"] for s in client.run(_live_run_state).values()),
             "the run's state to go")
    for state in client.run(_live_run_state).values():
        assert state == {"live": [], "shufflers": {}, "runs": {}, "host": 0, "pool": 0}


def test_pyarrow_collection_through_shuffle_graph(client: Client) -> None:
    def make(i: int) -> pa.Table:
        return pa.table({"key": pa.array(np.arange(i * 100, i * 100 + 100) % 17), "val": pa.array(np.arange(100) * 1.0)})

    tables = [make(i) for i in range(4)]
    inputs = [dask.delayed(make)(i) for i in range(4)]
    graph, keys = shuffle_graph(
        [d.key for d in inputs], on=["key"], npartitions=5, meta=tables[0].schema.empty_table()
    )
    for d in inputs:
        graph.update(d.__dask_graph__())
    parts = client.get(graph, keys)
    assert all(isinstance(p, pa.Table) for p in parts)
    inp = pa.concat_tables(tables).to_pandas()
    _check(inp, [p.to_pandas() for p in parts], ["key"])


def test_bad_input_is_rejected_at_graph_build_time() -> None:
    df = dd.from_pandas(pd.DataFrame({"a": [1, 2], "b": [3, 4]}), npartitions=1)
    with pytest.raises(KeyError, match="'nope'"):
        shuffle(df, "nope")
    with pytest.raises(KeyError, match="'zz'"):
        shuffle(df, ["a", "zz"])
    with pytest.raises(ValueError, match="at least one key column"):
        shuffle(df, [])
    with pytest.raises(ValueError, match="npartitions"):
        shuffle(df, "a", npartitions=0)
    for bad in (2.7, True, "3"):
        with pytest.raises(TypeError, match="npartitions must be an integer"):
            shuffle(df, "a", npartitions=bad)


def test_local_scheduler_without_client() -> None:
    pdf = pd.DataFrame({"k": np.arange(400) % 9, "v": np.arange(400)})
    df = dd.from_pandas(pdf, npartitions=4)
    for scheduler in ("sync", "threads"):
        with dask.config.set(scheduler=scheduler):
            out = shuffle(df, "k", npartitions=3, ignore_index=True)
            parts = list(dask.compute(*out.to_delayed()))
            _check(pdf, parts, ["k"])
            again = out.compute()
            pd.testing.assert_frame_equal(_sorted(again), _sorted(pdf))


def test_extracts_on_many_threads_lose_no_rows() -> None:
    """Found by a breaker (session 25): the extract that took a rank's last partition freed the run while
    another thread's extract had taken its own and not read it yet (an empty partition, no error)."""
    pdf = pd.DataFrame({"k": np.arange(6000) % 997, "v": np.arange(6000)})
    df = dd.from_pandas(pdf, npartitions=24)
    for _ in range(6):
        out = shuffle(df, "k", npartitions=48, ignore_index=True)
        parts = list(dask.compute(*out.to_delayed(), scheduler="threads", num_workers=8))
        _check(pdf, parts, ["k"])


def test_a_run_that_failed_keeps_its_first_reason() -> None:
    # Found by a breaker (session 24): each task that failed after the first
    # (two computations of one graph at once on a local scheduler) nested the
    # run's error into a new reason, so the message held the first failure
    # four or more times.
    from mpshuffle.dask.runtime import LocalRuntime
    from mpshuffle.options import Options

    runtime = LocalRuntime()
    try:
        run = runtime.get_run("token-first-reason", 2, options=Options())
        ctx = runtime.context_for(run)
        with pytest.raises(ShuffleError, match="the first failure"), runtime.guard("insert", run, ctx):
            raise ValueError("the first failure")
        with pytest.raises(ShuffleError), runtime.guard("extract", run, ctx):
            raise ShuffleError(f"shuffle op {run.op_id} failed: {ctx._failed[run.op_id]}")
        reason = str(ctx._failed[run.op_id])
        assert reason.count("the first failure") == 1 and "extract" not in reason, reason
    finally:
        runtime.close()


def test_multiprocessing_scheduler_is_refused() -> None:
    df = dd.from_pandas(pd.DataFrame({"a": [1, 2]}), npartitions=1)
    with dask.config.set(scheduler="processes"), pytest.raises(ValueError, match="multiprocessing"):
        shuffle(df, "a")


def test_local_partial_compute_then_full_compute() -> None:
    """Computing one output partition, then all, starts a fresh run and frees the first."""
    from mpshuffle.dask.graph import _LOCAL

    def live() -> set[int]:  # runs held by any of the process's contexts
        return {op for ctx in _LOCAL.contexts for op in ctx.shufflers}

    before = live()
    pdf = pd.DataFrame({"k": np.arange(200) % 7, "v": np.arange(200)})
    df = dd.from_pandas(pdf, npartitions=4)
    with dask.config.set(scheduler="sync"):
        out = shuffle(df, "k", npartitions=3, ignore_index=True)
        first = out.partitions[0].compute()
        assert set(partition_ids(first[["k"]], 3)) <= {0}
        parts = list(dask.compute(*out.to_delayed()))
        _check(pdf, parts, ["k"])
        pd.testing.assert_frame_equal(parts[0], first)
    assert live() <= before  # both of this graph's runs were freed
