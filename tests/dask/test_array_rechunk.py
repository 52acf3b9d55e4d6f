"""Dask Array rechunks through mpshuffle: Dask's chunks, exact values, the engine's tasks, clean-up."""

from __future__ import annotations

import asyncio
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dask
import dask.array as da
import numpy as np
import pytest
from dask.callbacks import Callback
from distributed import Client, LocalCluster

from conftest import three_worker_client, worker_addresses, worker_state
from mpshuffle.dask import bootstrap_dask_cluster, gather_statistics, graph
from mpshuffle.dask import rechunk as rechunk_module
from mpshuffle.dask.method import UnsupportedDaskError
from mpshuffle.dask.runtime import LocalRuntime
from mpshuffle.errors import ShuffleError

MP = {"array.rechunk.method": "mpshuffle"}


class _Count(Callback):
    """Names of the executed tasks (Dask's local schedulers)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def _pretask(self, key: Any, dsk: Any, state: Any) -> None:
        self.names.append(key[0] if isinstance(key, tuple) else key)


def _check(x: da.Array, chunks: Any, scheduler: str = "sync", **kwargs: Any) -> tuple[da.Array, list[str]]:
    """Rechunk with mpshuffle and with tasks: same chunks, same values and dtype; returns the names run."""
    want = x.rechunk(chunks, method="tasks", **kwargs)
    got = x.rechunk(chunks, method="mpshuffle", **kwargs)
    assert got.chunks == want.chunks
    assert got.dtype == want.dtype
    with _Count() as counted:
        value = got.compute(scheduler=scheduler)
    expected = want.compute(scheduler="sync")
    assert value.dtype == expected.dtype and value.shape == expected.shape
    if value.dtype.hasobject:
        assert value.tolist() == expected.tolist()
    else:
        assert value.tobytes() == expected.tobytes()
    return got, counted.names


def _inserts(names: list[str], y: da.Array) -> int:
    """Insert tasks of ``y``'s rechunk among ``names``."""
    return names.count(y.name.replace("mpshuffle-rechunk-", "mpshuffle-rechunk-insert-", 1))


@pytest.mark.parametrize("scheduler", ["sync", "threads"])
def test_time_to_space_and_back(scheduler: str) -> None:
    x = da.random.default_rng(1).random((12, 20, 30), chunks=(1, 20, 30)).astype("f4")
    y, names = _check(x, (12, 5, 6), scheduler)
    assert y.name.startswith("mpshuffle-rechunk-")
    own = {k[0] for k in dict(y.dask) if isinstance(k, tuple)} | {k for k in dict(y.dask) if isinstance(k, str)}
    ours = {n for n in own if not n.startswith(("random", "astype"))}
    assert all(n.startswith("mpshuffle-rechunk-") for n in ours)
    kinds = {n.split("-")[2] if n.count("-") > 2 else "output" for n in ours}
    assert kinds == {"insert", "barrier", "extract", "output"}
    assert _inserts(names, y) == 12  # one insert per input block
    assert names.count(y.name) == 4 * 5  # one task per output block
    assert 1 < sum(n.startswith("mpshuffle-rechunk-extract-") for n in names) < 4 * 5  # partitions of blocks
    back, names = _check(y, (1, 20, 30), scheduler)
    assert _inserts(names, back) == 4 * 5


@pytest.mark.parametrize(
    ("shape", "old", "new"),
    [
        ((17,), (5, 5, 7), (3, 3, 3, 3, 3, 2)),  # irregular, 1-d
        ((7, 24), ((7,), (10, 0, 0, 9, 0, 5)), (2, 3)),  # zero-size input chunks
        ((8, 8), (4, 4), ((4, 4), (4, 0, 0, 4))),  # zero-size output chunks
        ((5, 6, 7, 3), (2, 3, 4, 1), (3, 2, 2, 3)),  # 4-d
        ((0, 10, 100), (0, 10, 10), (0, 10, 50)),  # a zero-length axis
        ((6, 6), (6, 6), (2, 3)),  # one input block: slices only
        ((6, 6), (1, 1), (6, 6)),  # one output block: one assembly
    ],
)
def test_chunkings_match_tasks(shape: tuple[int, ...], old: Any, new: Any) -> None:
    x = da.from_array(np.arange(math.prod(shape), dtype="i8").reshape(shape), chunks=old)
    _check(x, new)


def test_auto_dict_balance_and_block_size_limit() -> None:
    x = da.ones((100, 60, 20), chunks=(1, 60, 20), dtype="f8")
    _check(x, "auto", block_size_limit=64_000)
    _check(x, {0: -1, 1: "auto"}, block_size_limit=100_000)
    _check(x, {1: 7}, balance=True)
    z = da.ones(10, chunks=(5,))
    with dask.config.set({"array.chunk-size": "1B"}):
        assert z.rechunk("auto", method="mpshuffle").chunks == ((1,) * 10,)
    same = x.rechunk(x.chunks, method="mpshuffle")
    assert same is x  # nothing to do, as with Dask's own methods


@pytest.mark.parametrize(
    "dtype",
    [">i4", "bool", "c8", "M8[s]", "U4", [("a", "u1"), ("b", "f8", (2,))], "O"],
)
def test_dtypes(dtype: Any) -> None:
    values = np.arange(6 * 8).reshape(6, 8)
    if dtype == "O":
        arr = values.astype(object)
        arr[2, 3] = ("a", {"b": [1]})
    else:
        arr = values.astype(dtype)
    x = da.from_array(arr, chunks=(1, 8))
    _check(x, (6, 2))


def test_unknown_chunk_sizes_on_an_unchanged_axis() -> None:
    x = da.from_array(np.arange(60).reshape(6, 10), chunks=(2, 5))
    x = x[x[:, 0] >= 0]  # rows of unknown count per block
    assert math.isnan(x.chunks[0][0])
    with dask.config.set(MP):
        y = x.rechunk({1: 2})
    assert math.isnan(y.chunks[0][0]) and y.chunks[1] == (2,) * 5
    np.testing.assert_array_equal(y.compute(scheduler="sync"), np.arange(60).reshape(6, 10))


def test_config_line_and_xarray_path() -> None:
    x = da.arange(64, chunks=4).reshape(8, 8).rechunk((1, 8))
    with dask.config.set(MP):
        y = x.rechunk((8, 1))
        z = da.rechunk(x, (8, 1))
    assert y.name.startswith("mpshuffle-rechunk-") and z.name == y.name
    np.testing.assert_array_equal(y.compute(scheduler="sync"), np.arange(64).reshape(8, 8))
    assert x.rechunk((8, 1)).name.startswith("rechunk-")  # other methods untouched
    xr = pytest.importorskip("xarray")
    arr = xr.DataArray(x, dims=("time", "space"))
    with dask.config.set(MP):
        out = arr.chunk({"time": -1, "space": 1})
    assert out.data.name.startswith("mpshuffle-rechunk-")
    np.testing.assert_array_equal(out.values, np.arange(64).reshape(8, 8))


def test_refusals_are_clear(monkeypatch: pytest.MonkeyPatch) -> None:
    masked = da.from_array(np.ma.masked_array(np.arange(16), mask=np.arange(16) % 3 == 0), chunks=4)
    with pytest.raises(TypeError, match="numpy.ndarray blocks.*MaskedArray.*method='tasks'"):
        masked.rechunk(8, method="mpshuffle")
    for method in ("tasks", "mpshuffle"):  # Dask's checks, Dask's messages
        with pytest.raises(ValueError, match="Chunks do not add up to shape"):
            da.ones((4, 4), chunks=2).rechunk(((1, 2), (4,)), method=method)
    with pytest.raises(TypeError, match="blah"):
        da.ones((4, 4), chunks=2).rechunk({"blah": 2}, method="mpshuffle")
    monkeypatch.setattr(dask, "__version__", "2099.1.0")
    with pytest.raises(UnsupportedDaskError, match="2099.1.0"):
        da.ones((4, 4), chunks=(1, 4)).rechunk((4, 1), method="mpshuffle")
    da.ones((4, 4), chunks=(1, 4)).rechunk((4, 1), method="tasks")  # other methods unaffected


def _masked(block: np.ndarray) -> np.ndarray:
    return np.ma.masked_array(block, mask=block % 2 == 0)


@pytest.mark.parametrize("target", [(8, 8), (8, 1)], ids=["assembled-without-exchange", "exchanged"])
def test_masked_blocks_under_a_plain_meta_fail_naming_their_type(target: tuple[int, int]) -> None:
    # The meta says numpy.ndarray, so the graph is built; the blocks are masked.
    # Assembling (8, 8) from rows without an exchange returned a plain array with
    # every mask dropped; both paths now refuse the block, naming its type.
    x = da.from_array(np.arange(64).reshape(8, 8), chunks=(1, 8)).map_blocks(
        _masked, meta=np.empty((0, 0), dtype=np.int64)
    )
    with pytest.raises(ShuffleError, match="numpy.ma.MaskedArray; mpshuffle rechunks arrays whose blocks are plain"):
        x.rechunk(target, method="mpshuffle").compute(scheduler="sync")


def test_extract_tasks_are_not_fused() -> None:
    """The scheduler plugin pins extract tasks by their keys: Dask's fusion must keep them."""
    from dask.array.optimization import optimize

    x = da.ones((8, 8), chunks=(1, 8))
    y = x.rechunk((8, 1), method="mpshuffle")  # one block per partition: a fusable chain
    s = (y + 1).sum(axis=0)
    dsk = optimize(dict(s.__dask_graph__()), s.__dask_keys__())
    extracts = [k for k in dsk if isinstance(k, tuple) and k[0].startswith("mpshuffle-rechunk-extract-")]
    inserts = [k for k in dsk if isinstance(k, tuple) and k[0].startswith("mpshuffle-rechunk-insert-")]
    assert len(extracts) >= 2 and len(inserts) == 8
    assert all(dsk[k].key == k for k in extracts + inserts)  # the tasks themselves, not aliases


def test_partitions_tile_the_grid_of_output_blocks() -> None:
    """Blocks per partition move to the nearest count that tiles the output grid, at most twice the bytes' count."""
    tile = rechunk_module.aligned_per_partition
    assert tile(16, (1, 20, 20)) == 20  # 16 of a row of 20 would split rows: whole rows
    assert tile(8, (1, 20, 20)) == 10  # half rows
    assert tile(3, (1, 20, 20)) == 4
    assert tile(30, (1, 20, 20)) == 40  # two whole rows
    assert tile(16, (400, 1, 1)) == 16  # any count tiles a single axis of 400 that it divides
    assert tile(1, (1, 20, 20)) == 1
    assert tile(50, (1, 1, 1009)) == 50  # no tiling count within twice: as the bytes say


def test_partitions_spread_blocks_evenly_over_the_ranks() -> None:
    """Among tiling counts within twice the bytes' count, the one that gives no rank more blocks comes first."""
    tile = rechunk_module.aligned_per_partition
    assert tile(16, (400, 1, 1), 2) == 20  # 25 partitions of 16 are 13 and 12: 20 of 20 are 10 and 10
    assert tile(4, (1, 20, 20), 16) == 5  # 100 of 4 are 7 and 6 per rank: 80 of 5 are 5 each
    assert tile(16, (1, 20, 20), 2) == 20  # whole rows, even already
    assert tile(100, (400,), 2) == 100  # 4 partitions, 2 each: the bytes' count stays
    assert tile(16, (400, 1, 1), 1) == 16  # one rank: nothing to balance
    assert tile(1, (4,), 16) == 1  # fewer blocks than ranks: the finest
    assert tile(3, (7,), 2) == 3  # no tiling count near: as the bytes say
    # Balance looks only within BALANCE_RATIO of the bytes' count: 200 blocks (5 partitions, 3 and 2), not 500
    # (2 partitions, one per rank, each 2.5x the bytes asked for).
    assert rechunk_module.BALANCE_RATIO == 1.25
    assert tile(250, (50, 20), 2) == 200
    assert tile(250, (100, 100), 4) == 200


def test_space_to_time_partitions_are_even_over_two_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """(400, 1, 1) -> (1, 2, 2) blocks, 400 output blocks of 16 bytes in partitions of 16 by bytes: on 2
    workers 20 partitions of 20 (10 each), not 25 of 16 (13 and 12); on one, 25; exact values both."""
    x = da.arange(400 * 2 * 2, dtype="f4").reshape(400, 2, 2).rechunk((400, 1, 1))
    monkeypatch.setattr(rechunk_module, "PARTITION_BYTES", 256)
    for workers, partitions in ((2, 20), (1, 25)):
        monkeypatch.setattr(rechunk_module, "_cluster", lambda options, keys=(), w=workers: ((w, 256), {}))
        y = x.rechunk((1, 2, 2), method="mpshuffle")
        extracts = {k for k in y.__dask_graph__() if isinstance(k, tuple) and "-extract-" in k[0]}
        assert len(extracts) == partitions
        np.testing.assert_array_equal(y.compute(scheduler="sync"), x.compute())


def test_time_to_space_partitions_are_whole_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """(1, 40, 40) -> (4, 2, 2) with partitions of 16 blocks by bytes: 20 (a row of the grid), exact values."""
    x = da.arange(4 * 40 * 40, dtype="f4").reshape(4, 40, 40).rechunk((1, 40, 40))
    monkeypatch.setattr(rechunk_module, "PARTITION_BYTES", 16 * 4 * 2 * 2 * 4)  # 16 blocks of 64 bytes
    y = x.rechunk((4, 2, 2), method="mpshuffle")
    extracts = {k for k in y.__dask_graph__() if isinstance(k, tuple) and "-extract-" in k[0]}
    assert len(extracts) == 20  # 400 blocks in partitions of 20, not 25 of 16
    np.testing.assert_array_equal(y.compute(scheduler="sync"), x.compute())


def test_uninstall_restores_dask() -> None:
    module = sys.modules["dask.array.rechunk"]  # the attribute dask.array.rechunk is the function
    rechunk_module.uninstall()
    try:
        with pytest.raises(NotImplementedError, match="Unknown rechunking method 'mpshuffle'"):
            da.ones(4, chunks=1).rechunk(2, method="mpshuffle")
        assert not rechunk_module.installed()
        assert module.rechunk is da.rechunk
    finally:
        rechunk_module.install()
    assert rechunk_module.installed()


@pytest.fixture
def tiny_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalRuntime]:
    with dask.config.set({"mpshuffle.spill_host": 64 * 2**10, "mpshuffle.spill_dir": str(tmp_path)}):
        runtime = LocalRuntime()
        monkeypatch.setattr(graph, "_LOCAL", runtime)
        yield runtime
        runtime.context.close()


def test_past_the_budget_it_spills_and_cleans_up(tiny_budget: LocalRuntime, tmp_path: Path) -> None:
    x = da.random.default_rng(3).random((16, 64, 64), chunks=(1, 64, 64))  # 512 KiB, 8x the budget
    _check(x, (16, 8, 8))
    ctx = tiny_budget.context
    ((_, stats),) = list(ctx.history)
    assert stats["bytes_spilled_disk"] > 0
    assert stats["bytes_unspilled_disk"] == stats["bytes_spilled_disk"]
    assert ctx.shufflers == {}
    assert os.listdir(tmp_path) == []


def test_partitions_are_an_eighth_of_the_smallest_host_budget() -> None:
    """An output partition is sized from the workers' host budget, not a fixed 64 MiB."""
    from mpshuffle.options import Options

    small = {"memory_limit": 2**30, "metrics": {"memory": 300_000_000}}
    big = {"memory_limit": 16 * 2**30, "metrics": {"memory": 300_000_000}}
    fractions = {"distributed.worker.memory.spill": 0.7, "distributed.worker.memory.pause": 0.8}
    with dask.config.set(fractions):
        # Budget min(0.25 GiB, (0.7 GiB - 300 MB) // 2) = 225,809,638 bytes; an eighth of it.
        assert rechunk_module.partition_bytes(Options(), [big, small]) == 225_809_638 // 8
        assert rechunk_module.partition_bytes(Options(), [big]) == rechunk_module.PARTITION_BYTES
        assert rechunk_module.partition_bytes(Options(spill_host=80 * 2**20), [big]) == 10 * 2**20
        assert rechunk_module.partition_bytes(Options(spill_host=2**20), [big]) == 2**20  # 1 MiB at least
    assert rechunk_module.partition_bytes(Options(), [{"memory_limit": 0}]) == rechunk_module.PARTITION_BYTES
    assert rechunk_module.partition_bytes(Options(), []) == rechunk_module.PARTITION_BYTES


# -- on a LocalCluster ----------------------------------------------------


def test_distributed_client_and_recompute(client: Client) -> None:
    gen = bootstrap_dask_cluster(client)
    x = da.random.default_rng(5).random((10, 12, 12), chunks=(1, 12, 12))
    want = x.compute()
    with dask.config.set(MP):
        y = x.rechunk((10, 3, 4))
    np.testing.assert_array_equal(y.compute(), want)
    np.testing.assert_array_equal(y.compute(), want)  # computed again: a new run
    persisted = y.persist()
    np.testing.assert_array_equal(
        persisted.rechunk((1, 12, 12), method="mpshuffle").compute(), want
    )
    runs = [r for rs in gather_statistics(client).values() for r in rs if r["generation"] == gen.id]
    assert len({r["op_id"] for r in runs}) >= 3
    assert sum(r["bytes_sent"] for r in runs) > 0  # pieces crossed between the two workers
    state = client.run(worker_state)
    assert all(s["shufflers"] == [] and s["spill"] == [] for s in state.values()), state


def test_insert_groups_are_per_worker_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rechunk_module, "INSERT_GROUP_BYTES", 30)
    where = [0, 1, 0, None, 1, 0, 0, 1, None]
    groups = rechunk_module._insert_groups(where, [10] * len(where))
    assert groups == [[0, 2, 5], [1, 4, 7], [3], [6], [8]]
    # A block past the bytes on its own still makes a task; bytes are per worker.
    assert rechunk_module._insert_groups([0, 0, 1, 0], [40, 5, 40, 5]) == [[0], [1, 3], [2]]
    assert rechunk_module._insert_groups([], []) == []


def test_insert_batches_are_consecutive_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rechunk_module, "INSERT_BATCH_BYTES", 30)
    sizes = [10, 10, 10, 10, 25, 10, 0, 10, 40, 10]
    assert rechunk_module._insert_batches(range(10), sizes) == [[0, 1, 2], [3], [4], [5], [6], [7], [8], [9]]
    # Positions of one task, not all consecutive in the group; a block past the bytes is a batch of its own.
    assert rechunk_module._insert_batches([0, 2, 3, 5], [10, 0, 10, 10, 0, 10]) == [[0, 2, 3], [5]]
    assert rechunk_module._insert_batches([], []) == []


def test_a_batch_of_blocks_is_one_input_and_exact_on_four_ranks() -> None:
    """Blocks inserted as batches (one input index, their pieces for each rank sent together) give Dask's values,
    on a cluster of 4 workers whose blocks' bytes spread over the ranks."""
    from distributed import Client, LocalCluster, wait

    with LocalCluster(n_workers=4, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster, \
            Client(cluster):
        values = np.arange(16 * 40 * 40, dtype="f8").reshape(16, 40, 40)
        x = da.from_array(values, chunks=(1, 40, 40)).persist()
        wait(x)
        with dask.config.set(MP):
            y = x.rechunk((16, 10, 10))
        graph_ = dict(y.__dask_graph__())
        inserts = [v for k, v in graph_.items() if isinstance(k, tuple) and "-insert-" in k[0]]
        # 16 blocks of 12.8 KB on at most 4 workers: one batch (one input) per task.
        batches = [task.args[2] for task in inserts]
        assert sum(len(b) for b in batches) == len(inserts) and sum(len(b[0]) for b in batches) == 16
        np.testing.assert_array_equal(y.compute(), values)
        assert y.chunks == x.rechunk((16, 10, 10), method="tasks").chunks
        back = y.persist()
        wait(back)
        np.testing.assert_array_equal(back.rechunk((1, 40, 40), method="mpshuffle").compute(), values)


def test_inserts_take_the_blocks_one_worker_holds(client: Client) -> None:
    """A persisted input is inserted by a task per worker (each over blocks of that worker only), exact values."""
    from distributed import wait

    bootstrap_dask_cluster(client)
    values = np.arange(24 * 12 * 10, dtype="f4").reshape(24, 12, 10)
    x = da.from_array(values, chunks=(1, 12, 10)).persist()
    wait(x)
    where = client.who_has(x)
    for target, back in (((24, 3, 5), (1, 12, 10)), ((24, 12, 2), (3, 12, 10))):
        with dask.config.set(MP):
            y = x.rechunk(target)
        graph_ = dict(y.__dask_graph__())
        inserts = {k: v for k, v in graph_.items() if isinstance(k, tuple) and "-insert-" in k[0]}
        # 24 blocks of 480 bytes: one task per worker holding blocks (Dask chose where they went).
        held = {ws[0] for ws in where.values()}
        assert len(inserts) == len(held), sorted(inserts)
        holders = [{where[d][0] for d in task.dependencies} for task in inserts.values()]
        assert all(len(h) == 1 for h in holders) and set().union(*holders) == held
        assert sum(len(task.dependencies) for task in inserts.values()) == 24
        want = x.rechunk(target, method="tasks")
        got = y.persist()
        assert got.chunks == want.chunks
        np.testing.assert_array_equal(got.compute(), values)
        # And back, from an output held on both workers.
        wait(got)
        z = got.rechunk(back, method="mpshuffle")
        assert z.chunks == x.rechunk(back, method="tasks").chunks
        np.testing.assert_array_equal(z.compute(), values)
        del got
    # Blocks not in memory get a task each (Dask places them where it computes them).
    lazy = da.from_array(values, chunks=(1, 12, 10), name="not-held").rechunk((24, 3, 5), method="mpshuffle")
    inserts = [k for k in lazy.__dask_graph__() if isinstance(k, tuple) and "-insert-" in k[0]]
    assert len(inserts) == 24
    np.testing.assert_array_equal(lazy.compute(), values)
    state = client.run(worker_state)
    assert all(s["shufflers"] == [] and s["spill"] == [] for s in state.values()), state


def test_small_host_budget_makes_small_partitions(client: Client) -> None:
    """With an 8 MiB budget an 8 MiB rechunk has 1 MiB partitions (8 extracts, not 4), and exact values."""
    bootstrap_dask_cluster(client)
    x = da.random.default_rng(7).random((64, 128, 256), chunks=(1, 128, 256)).astype("f4")  # 8 MiB
    with dask.config.set({**MP, "mpshuffle.spill_host": 8 * 2**20}):
        y = x.rechunk((64, 16, 32))  # 64 output blocks of 128 KiB
    extracts = {k for k in y.__dask_graph__() if isinstance(k, tuple) and "-extract-" in k[0]}
    assert len(extracts) == 8  # 8 MiB in partitions of 8 MiB / 8, 8 blocks each
    np.testing.assert_array_equal(y.compute(), x.compute())
    state = client.run(worker_state)
    assert all(s["shufflers"] == [] and s["spill"] == [] for s in state.values()), state


def test_sizing_asks_the_scheduler_not_the_clients_shared_identity(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seen in CI: distributed's periodic identity refresh (no workers) overwrote
    the answer ``scheduler_info()`` had just fetched; a rechunk then sized its
    partitions for one worker."""
    from mpshuffle.options import Options

    def raced(self: Any, n_workers: int = -1, **kwargs: Any) -> dict[str, Any]:
        return {**self._scheduler_identity, "workers": {}}  # what the overwritten read returns

    monkeypatch.setattr(Client, "scheduler_info", raced)
    from distributed import wait

    x = da.from_array(np.zeros((4, 4)), chunks=(1, 4)).persist()
    wait(x)
    (workers, nbytes), holders = rechunk_module._cluster(
        Options(), [k for row in x.__dask_keys__() for k in row]
    )
    assert workers == len(worker_addresses(client)) == 2
    assert nbytes > 0
    held = client.who_has(x)
    names = {a: i for i, a in enumerate(sorted({min(ws) for ws in held.values()}))}
    assert holders == {k: names[min(ws)] for k, ws in held.items()}


def test_async_client(cluster: LocalCluster) -> None:
    x = da.arange(4 * 6 * 5, chunks=30).reshape(4, 6, 5).rechunk((1, 6, 5))

    async def main() -> Any:
        async with Client(cluster.scheduler_address, asynchronous=True) as c:
            return await c.compute(x.rechunk((4, 2, 5), method="mpshuffle"))

    np.testing.assert_array_equal(asyncio.run(main()), np.arange(120).reshape(4, 6, 5))


def test_suite_runner_switches_only_the_rechunk_method(tmp_path: Path) -> None:
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "dask_suite" / "run_dask_tests.py"
    spec = importlib.util.spec_from_file_location("run_dask_tests", path)
    assert spec is not None and spec.loader is not None
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    dask_dir = Path(dask.__file__).parent
    runner.prepare(dask_dir, tmp_path, "rechunk")
    (rel,) = runner.RECHUNK_MODULES
    assert (tmp_path / rel).read_text() == (dask_dir / rel).read_text()  # the module as shipped
    conftest = (tmp_path / "conftest.py").read_text()
    original = (dask_dir / "conftest.py").read_text()
    assert conftest.startswith(original)
    assert '_dask.config.set({"array.rechunk.method": _METHOD})' in conftest[len(original):]


def _hold(block: np.ndarray, event: str, block_info: Any = None) -> np.ndarray:
    """Input block that waits for ``event``, except the first (its insert starts the run)."""
    from distributed import Event, rejoin, secede

    if block_info[0]["chunk-location"][0] != 0:
        secede()
        Event(event).wait(timeout=60)
        rejoin()
    return block


def test_lost_worker_mid_insert_computes_the_rechunk_again() -> None:
    import signal
    import time
    import uuid

    from distributed import Event

    with three_worker_client() as client:
        go = f"go-{uuid.uuid4().hex[:8]}"
        values = np.arange(6 * 8 * 8, dtype="f8").reshape(6, 8, 8)
        x = da.from_array(values, chunks=(1, 8, 8)).map_blocks(_hold, go, dtype="f8")
        fut = client.compute(x.rechunk((6, 2, 4), method="mpshuffle"))
        deadline = time.monotonic() + 30

        def runs(dask_scheduler: Any) -> int:
            return len(dask_scheduler.plugins["mpshuffle"].runs)

        while not client.run_on_scheduler(runs):
            assert time.monotonic() < deadline, "the run did not start"
            time.sleep(0.05)
        victim = worker_addresses(client)[1]
        os.kill(client.run(os.getpid, workers=[victim])[victim], signal.SIGKILL)
        Event(go, client=client).set()
        np.testing.assert_array_equal(fut.result(timeout=60), values)


def test_grouped_inserts_after_their_holder_is_lost() -> None:
    """Insert tasks grouped by the worker that held their blocks at build time stay right once it is gone."""
    import signal
    import time

    from distributed import wait

    with three_worker_client() as client:
        values = np.arange(12 * 8 * 8, dtype="f8").reshape(12, 8, 8)
        x = da.from_array(values, chunks=(1, 8, 8)).persist()
        wait(x)
        y = x.rechunk((12, 2, 4), method="mpshuffle")
        inserts = [k for k in y.__dask_graph__() if isinstance(k, tuple) and "-insert-" in k[0]]
        held = {w[0] for w in client.who_has(x).values()}
        assert len(inserts) == len(held)  # one task per worker holding blocks
        victim = min(held)
        os.kill(client.run(os.getpid, workers=[victim])[victim], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while victim in worker_addresses(client):
            assert time.monotonic() < deadline, "the scheduler did not see the worker go"
            time.sleep(0.05)
        # The lost blocks are computed again elsewhere and move to their insert task.
        np.testing.assert_array_equal(y.compute(), values)



def test_a_rechunk_on_many_threads_places_every_partition(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by a breaker (session 25): 4 in 30 such rechunks failed with "received no pieces".

    The extract that took the run's last partition freed it while another
    thread's extract had taken its partition and not read it yet.
    """
    monkeypatch.setattr(rechunk_module, "PARTITION_BYTES", 2**16)  # 32 partitions of 32 blocks
    for i in range(8):
        values = np.arange(32 * 128 * 128, dtype="f4").reshape(32, 128, 128) + i
        y = da.from_array(values, chunks=(1, 128, 128)).rechunk((32, 4, 4), method="mpshuffle")
        np.testing.assert_array_equal(y.compute(scheduler="threads", num_workers=8), values)
