"""Shuffles under a tiny host budget: correct, they spill, and leave no spill file behind."""

from __future__ import annotations

import collections
import errno
import os
from collections.abc import Iterator
from typing import Any

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest

from conftest import worker_addresses, worker_state
from mpshuffle.config import resolve_options
from mpshuffle.dask import bootstrap_dask_cluster, gather_statistics, graph, shuffle
from mpshuffle.dask.runtime import LocalRuntime
from mpshuffle.errors import ShuffleError, SpillError
from mpshuffle.shuffler.run import STATISTICS

NROWS = 60_000


def _frame(nrows: int = NROWS) -> pd.DataFrame:
    rng = np.random.default_rng(42)
    return pd.DataFrame(
        {
            "k": rng.integers(0, 5_000, nrows),
            "x": rng.random(nrows),
            "s": [f"row-{i}" for i in range(nrows)],
        }
    )


def _check_shuffled(parts: list[pd.DataFrame], pdf: pd.DataFrame) -> None:
    """Same multiset of rows (and dtypes) as ``pdf``, and every key in exactly one partition."""
    out = pd.concat(parts, ignore_index=True)
    cols = list(pdf.columns)
    assert len(out) == len(pdf)
    assert out.dtypes.to_dict() == pdf.dtypes.to_dict()
    a = out.sort_values(cols).reset_index(drop=True)
    b = pdf.sort_values(cols).reset_index(drop=True)
    pd.testing.assert_frame_equal(a, b)
    owners: dict[Any, set[int]] = collections.defaultdict(set)
    for i, part in enumerate(parts):
        for k in part["k"].unique():
            owners[k].add(i)
    assert all(len(v) == 1 for v in owners.values())
    assert sum(1 for p in parts if len(p)) > 1


# -- local (no distributed Client) ---------------------------------------


@pytest.fixture
def local_runtime(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalRuntime]:
    """A fresh single-process runtime with a 64 KiB host budget spilling into tmp_path."""
    with dask.config.set(
        {"scheduler": "sync", "mpshuffle.spill_host": 64 * 2**10, "mpshuffle.spill_dir": str(tmp_path)}
    ):
        runtime = LocalRuntime()
        monkeypatch.setattr(graph, "_LOCAL", runtime)
        yield runtime
        runtime.close()


def test_local_shuffle_with_tiny_budget_spills_and_is_correct(local_runtime: LocalRuntime, tmp_path: Any) -> None:
    pdf = _frame()
    df = dd.from_pandas(pdf, npartitions=6)
    out = shuffle(df, "k", npartitions=5)
    parts = list(dask.compute(*out.to_delayed()))
    _check_shuffled(parts, df.compute())
    ctx = local_runtime.context
    ((_, stats),) = list(ctx.history)
    assert stats["bytes_spilled_disk"] > 0
    assert stats["bytes_unspilled_disk"] == stats["bytes_spilled_disk"]
    assert stats["bytes_received"] == stats["bytes_inserted"] > stats["bytes_spilled_disk"] * 0.5
    assert ctx.shufflers == {}
    assert os.listdir(tmp_path) == []


def test_local_disk_full_raises_spill_error_and_removes_files(
    local_runtime: LocalRuntime, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mpshuffle.memory import spill as spill_module

    real = spill_module._pwritev_all
    calls = {"n": 0}

    def fills_up(fd: int, parts: Any, at: int, want: int) -> None:
        # The first spills succeed, then the disk is full.
        calls["n"] += 1
        if calls["n"] > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, parts, at, want)

    monkeypatch.setattr(spill_module, "_pwritev_all", fills_up)
    df = dd.from_pandas(_frame(), npartitions=6)
    with pytest.raises(SpillError) as info:
        shuffle(df, "k", npartitions=5).compute()
    msg = str(info.value)
    assert "disk is full" in msg
    assert "rank 0 (worker local)" in msg
    assert str(tmp_path) in msg
    assert calls["n"] == 4
    assert os.listdir(tmp_path) == []


# -- on a LocalCluster ----------------------------------------------------


def _all_spill_dirs(client: Any) -> dict[str, list[str]]:
    return {w: s["spill"] for w, s in client.run(worker_state).items()}


def test_cluster_shuffle_with_1mib_budget_spills_and_cleans_up(client: Any) -> None:
    gen = bootstrap_dask_cluster(client, spill_host=2**20)
    pdf = _frame(200_000)
    df = dd.from_pandas(pdf, npartitions=8)
    out = shuffle(df, "k", npartitions=6)
    parts = client.gather(client.compute(out.to_delayed()))
    _check_shuffled(parts, df.compute())

    stats = gather_statistics(client)
    assert sorted(stats) == sorted(gen.ranks)
    runs = [run for per_worker in stats.values() for run in per_worker if run["generation"] == gen.id]
    last = max(run["op_id"] for run in runs)
    mine = [run for run in runs if run["op_id"] == last]
    assert sorted(run["rank"] for run in mine) == [0, 1]
    assert sum(run["bytes_spilled_disk"] for run in mine) > 0
    assert all(run["bytes_unspilled_disk"] == run["bytes_spilled_disk"] for run in mine)
    # One statistics type for both kinds: a host run reports every key, the
    # device-only mechanisms (spill to host, rounds, consolidation) at 0.
    assert all(set(run) == {"op_id", "generation", "rank", "options", *STATISTICS} for run in mine)
    assert all(run["chunks_received"] > 0 and run["seconds_extract"] > 0 for run in mine)
    assert all(run["rounds"] == run["bytes_spilled_host"] == run["bytes_consolidated"] == 0 for run in mine)
    # What every rank inserted was received somewhere.
    assert sum(r["bytes_inserted"] for r in mine) == sum(r["bytes_received"] for r in mine)

    state = client.run(worker_state)
    assert all(s["spill"] == [] and s["shufflers"] == [] for s in state.values()), state


def _inject_disk_full(dask_worker: Any) -> None:
    from mpshuffle.memory import spill as spill_module

    def full(fd: int, parts: Any, at: int, want: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    spill_module._real_pwritev_all = spill_module._pwritev_all  # type: ignore[attr-defined]
    spill_module._pwritev_all = full


def _restore_disk(dask_worker: Any) -> None:
    from mpshuffle.memory import spill as spill_module

    spill_module._pwritev_all = spill_module._real_pwritev_all  # type: ignore[attr-defined]


def test_cluster_disk_full_names_worker_and_directory(client: Any) -> None:
    bootstrap_dask_cluster(client, spill_host=2**20)
    client.run(_inject_disk_full)
    try:
        df = dd.from_pandas(_frame(200_000), npartitions=8)
        with pytest.raises(ShuffleError) as info:
            shuffle(df, "k", npartitions=6).compute()
    finally:
        client.run(_restore_disk)
    msg = str(info.value)
    assert "disk is full" in msg
    assert any(f"(worker {w})" in msg for w in worker_addresses(client)), msg
    assert "mpshuffle-" in msg
    # The failed run's files and state are gone on every worker.
    state = client.run(worker_state)
    assert all(s["spill"] == [] for s in state.values()), state


def test_closing_the_worker_context_removes_spill_files_of_running_shuffles(tmp_path: Any) -> None:
    from mpshuffle.comm import LocalCommunicator
    from mpshuffle.shuffler.context import WorkerContext
    from mpshuffle.table import get_adapter

    options = resolve_options(spill_host=1024, spill_dir=str(tmp_path))
    ctx = WorkerContext(LocalCommunicator(), "gen1", options, workers=("w0",))
    pdf = _frame(5_000)
    pieces = get_adapter(pdf).split(pdf, ["k"], 3)
    s = ctx.shuffler(4)
    s.insert(0, pieces)  # inserted, never extracted: the run is still open
    assert sorted(os.listdir(tmp_path)) == ["mpshuffle-gen1-op4-r0", "mpshuffle-gen1-op4-r0.lock"]
    assert s.postbox.nbytes_spilled > 0
    ctx.close()  # what the worker plugin's teardown does when the worker closes
    assert os.listdir(tmp_path) == []
    assert ctx.shufflers == {} and s.closed


def test_dasks_ceiling_is_the_lower_of_its_spill_and_pause_fractions() -> None:
    from types import SimpleNamespace

    from mpshuffle.dask.worker import _dask_ceiling

    assert _dask_ceiling(SimpleNamespace(memory_spill_fraction=0.7, memory_pause_fraction=0.8)) == 0.7
    assert _dask_ceiling(SimpleNamespace(memory_spill_fraction=False, memory_pause_fraction=0.8)) == 0.8
    assert _dask_ceiling(SimpleNamespace(memory_spill_fraction=False, memory_pause_fraction=False)) is None


def test_a_paused_worker_moves_its_runs_memory_to_disk(tmp_path: Any) -> None:
    """Dask starts no task on a paused worker: the plugin moves what the runs hold in memory to disk."""
    import asyncio
    import types

    from distributed.core import Status

    from mpshuffle.comm import LocalCommunicator
    from mpshuffle.dask.worker import ShuffleWorkerPlugin
    from mpshuffle.memory.resource import MemoryType
    from mpshuffle.shuffler.context import WorkerContext
    from mpshuffle.table.ndarray import BlockPlan, NDArrayAdapter

    options = resolve_options(spill_host=2**20, spill_dir=str(tmp_path))
    ctx = WorkerContext(LocalCommunicator(), "gen", options, workers=("w0",))
    plugin = ShuffleWorkerPlugin()
    plugin.worker = types.SimpleNamespace(status=Status.running, address="w0")  # type: ignore[assignment]
    plugin.contexts, plugin.current, plugin._moving = {"gen": ctx}, "gen", False
    try:
        full = np.arange(4 * 8 * 8, dtype="f8").reshape(4, 8, 8)
        halves = (((0, 0, 4, 0), (1, 4, 8, 0)),)  # one input block per axis, cut in two
        plan = BlockPlan(cuts=(tuple(((0, 0, 1, t),) for t in range(4)), halves, halves), nout=(1, 2, 2))
        run = ctx.shuffler(1)
        for t in range(4):
            run.insert_frame(t, full[t : t + 1], NDArrayAdapter(full.dtype, plan, (t, 0, 0)), (), 4)
        run.barrier(4)
        held = ctx.resource.used(MemoryType.HOST)
        assert held > 0 and run.statistics["bytes_spilled_disk"] == 0
        asyncio.run(plugin._when_paused())  # running: nothing moves
        assert ctx.resource.used(MemoryType.HOST) == held
        plugin.worker.status = Status.paused  # type: ignore[union-attr]
        asyncio.run(plugin._when_paused())
        assert ctx.resource.used(MemoryType.HOST) == 0
        assert run.statistics["bytes_spilled_disk"] == ctx.resource.used(MemoryType.DISK) > 0
        out = NDArrayAdapter(full.dtype)
        got = {b: a for pid in range(4) for b, a in out.unpack(run.extract(pid), None).items()}
        for b in range(4):
            j1, j2 = divmod(b, 2)
            np.testing.assert_array_equal(got[b], full[:, 4 * j1 : 4 * j1 + 4, 4 * j2 : 4 * j2 + 4])
        assert run.statistics["bytes_unspilled_disk"] == run.statistics["bytes_spilled_disk"]
        assert run.closed and ctx.shufflers == {}
    finally:
        ctx.close()
    assert os.listdir(tmp_path) == []
