"""Device shuffles through Dask: the device run path, and a 2-GPU cluster.

The first test drives :class:`mpshuffle.shuffler.device.DeviceRun` on one rank with
NumPy device tables (the host twin), so its outbox, spilling and extract run
on CPU machines too. The cluster tests need CuPy and two GPUs: one worker
process per GPU (``CUDA_VISIBLE_DEVICES`` per nanny, as dask-cuda does),
:func:`mpshuffle.dask.bootstrap_dask_cluster` with ``pool_size`` and
``spill_device``, and a shuffle of ``DeviceTable`` partitions through
:func:`mpshuffle.dask.shuffle_graph`; they skip elsewhere.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from conftest import check_device_output as _check_output
from conftest import host_table as _host_table
from conftest import worker_addresses
from mpshuffle.comm import LocalCommunicator
from mpshuffle.memory import BufferResource, MemoryType
from mpshuffle.shuffler.device import DeviceRun
from mpshuffle.table.device import DeviceAdapter, DeviceTable

try:
    import cupy

    _NDEV = int(cupy.cuda.runtime.getDeviceCount())
except Exception:  # noqa: BLE001 - no CuPy, no driver or no device
    cupy = None
    _NDEV = 0

needs_2_gpus = pytest.mark.skipif(_NDEV < 2, reason="needs CuPy and two CUDA devices")


def test_device_run_one_rank_spills_and_extracts() -> None:
    comm = LocalCommunicator()
    # A "device" budget of 40 kB for ~100 kB of packed tables: the run must spill.
    resource = BufferResource({MemoryType.DEVICE: 40_000})
    done: list[int] = []
    run = DeviceRun(comm, 7, resource=resource, state=None, key="g", timeout=10, on_done=done.append)
    comm.register_handler("mpsd", run.receive)
    try:
        inputs = [_host_table(i, 1000) for i in range(4)]
        for i, t in enumerate(inputs):
            run.insert(i, DeviceTable(t), ["key"], 5)
        assert resource.used(MemoryType.HOST) > 0  # oldest outbox buffers went to host
        run.barrier(5)
        assert run.statistics["rounds"] == 4
        parts = []
        for j in range(5):
            pieces = run.extract(j)
            parts.append(DeviceAdapter().unpack(pieces, DeviceTable(inputs[0]).empty_like()).columns)
        _check_output(parts, inputs, 5)
        assert run.statistics["bytes_spilled_host"] > 0
        assert done == [7] and run.closed
        assert resource.used(MemoryType.DEVICE) == 0 and resource.used(MemoryType.HOST) == 0
        assert not [t for t in threading.enumerate() if t.name.startswith("mpshuffle-device")]
        with pytest.raises(Exception, match="already extracted"):
            run.extract(0)
    finally:
        comm.close()


# -- two GPUs, one worker per GPU ------------------------------------------------


def _make(i: int, n: int) -> DeviceTable:
    import cupy as cp

    return DeviceTable({k: cp.asarray(v) for k, v in _host_table(i, n).items()})


def _to_host(t: DeviceTable) -> dict[str, np.ndarray]:
    return {k: v.get() for k, v in t.columns.items()}


def _gpu_cluster() -> Any:
    from distributed import Nanny, Scheduler, SpecCluster

    workers = {
        f"gpu{i}": {
            "cls": Nanny,
            "options": {
                "nthreads": 1,
                "env": {"CUDA_VISIBLE_DEVICES": str(i), "NCCL_NVLS_ENABLE": "0"},
            },
        }
        for i in range(2)
    }
    sched = {"cls": Scheduler, "options": {"dashboard_address": ":0"}}
    return SpecCluster(workers=workers, scheduler=sched)


@pytest.fixture(scope="module")
def gpu_client() -> Any:
    from distributed import Client

    with _gpu_cluster() as cluster, Client(cluster) as client:
        client.wait_for_workers(2)
        yield client


def _shuffle_layer(
    client: Any, seeds: list[int], nrows: int, npart: int
) -> tuple[dict[Any, Any], list[Any], list[Any]]:
    """A device shuffle of tables ``_host_table(seed, nrows)`` made on the GPUs.

    Returns the graph (inserts take the input futures), the keys of its
    outputs copied to host, and the inputs as host tables.
    """
    import cupy as cp

    from mpshuffle.dask import shuffle_graph

    workers = worker_addresses(client)
    futs = [client.submit(_make, s, nrows, workers=[workers[i % 2]], pure=False) for i, s in enumerate(seeds)]
    meta = DeviceTable({k: cp.asarray(v[:0]) for k, v in _host_table(0, 1).items()})
    graph, keys = shuffle_graph([f.key for f in futs], on=["key"], npartitions=npart, meta=meta)
    for k, task in list(graph.items()):
        if isinstance(k, tuple) and "insert" in k[0]:
            graph[k] = (task[0], futs[task[2]], *task[2:])
    host_keys = [(f"to-host-{keys[0][0]}", j) for j in range(npart)]
    for hk, k in zip(host_keys, keys, strict=True):
        graph[hk] = (_to_host, k)
    return graph, host_keys, [_host_table(s, nrows) for s in seeds]


def _run_shuffle(client: Any, nin: int, nrows: int, npart: int) -> tuple[list[Any], list[Any]]:
    graph, host_keys, inputs = _shuffle_layer(client, list(range(nin)), nrows, npart)
    return client.get(graph, host_keys), inputs


def _contexts(client: Any) -> dict[str, Any]:
    def probe(dask_worker: Any) -> dict[str, Any]:
        import cupy as cp

        from mpshuffle.dask.worker import PLUGIN_NAME

        plugin = dask_worker.plugins[PLUGIN_NAME]
        out = {}
        for gen, ctx in plugin.contexts.items():
            dev = ctx.device
            out[gen] = {
                "device": None if dev is None else dev.device,
                "budget": None if dev is None else dev.budget,
                "pool": int(cp.get_default_memory_pool().total_bytes()),
                "total": int(cp.cuda.runtime.memGetInfo()[1]),
                "limit": ctx.resource.limit(MemoryType.DEVICE),
                "runs": len(ctx.shufflers),
                "used": [ctx.resource.used(m) for m in (MemoryType.DEVICE, MemoryType.HOST)],
                "peak": [ctx.resource.peak(m) for m in (MemoryType.DEVICE, MemoryType.HOST)],
                "history": [s for _, s in ctx.history],
                "pci": cp.cuda.Device(dev.device).pci_bus_id if dev is not None else None,
            }
        out["threads"] = [t.name for t in threading.enumerate() if t.name.startswith("mpshuffle-device")]
        return out

    return client.run(probe)


def _wait_clean(client: Any, gen: str) -> dict[str, Any]:
    deadline = time.monotonic() + 15
    while True:
        info = _contexts(client)
        clean = all(
            w[gen]["runs"] == 0 and w[gen]["used"] == [0, 0] and not w["threads"] for w in info.values()
        )
        if clean or time.monotonic() > deadline:
            return info
        time.sleep(0.2)


@needs_2_gpus
def test_bootstrap_pool_and_device_budget(gpu_client: Any) -> None:
    from mpshuffle.dask import bootstrap_dask_cluster

    gen = bootstrap_dask_cluster(gpu_client, pool_size=0.1, spill_device=0.25)
    info = _contexts(gpu_client)
    pcis = set()
    for w in info.values():
        c = w[gen.id]
        assert c["device"] == 0  # each worker sees only its own GPU
        assert c["pool"] >= int(0.1 * c["total"]) // 2**20 * 2**20
        assert c["budget"] == int(0.25 * c["total"]) == c["limit"]
        pcis.add(c["pci"])
    assert len(pcis) == 2  # two different physical GPUs


@needs_2_gpus
def test_device_shuffle_through_dask(gpu_client: Any) -> None:
    from mpshuffle.dask import bootstrap_dask_cluster

    gen = bootstrap_dask_cluster(gpu_client, pool_size=0.1, spill_device=0.25)
    parts, inputs = _run_shuffle(gpu_client, nin=6, nrows=200_000, npart=8)
    _check_output(parts, inputs, 8)
    info = _wait_clean(gpu_client, gen.id)
    sent = 0
    for w in info.values():
        c = w[gen.id]
        assert c["runs"] == 0 and c["used"] == [0, 0] and not w["threads"]
        assert c["peak"][0] > 0 and c["peak"][1] == 0  # device buffers only; nothing staged on host
        stats = c["history"][-1]
        assert stats["bytes_spilled_host"] == 0
        sent += stats["bytes_sent"]
    assert sent > 0  # bytes crossed between the GPUs (over NCCL)


@needs_2_gpus
def test_two_device_shuffles_at_once(gpu_client: Any) -> None:
    """Two shuffles whose barriers race (as both sides of a join do): each rank runs the
    exchanges in rank 0's order, so neither waits on the other, and both are right."""
    from mpshuffle.dask import bootstrap_dask_cluster

    gen = bootstrap_dask_cluster(gpu_client, spill_device=0.25)
    for _ in range(3):
        ga, ka, ia = _shuffle_layer(gpu_client, [0, 1, 2, 3], 100_000, 8)
        gb, kb, ib = _shuffle_layer(gpu_client, [10, 11, 12, 13, 14], 80_000, 6)
        out = gpu_client.get({**ga, **gb}, ka + kb)
        _check_output(out[:8], ia, 8)
        _check_output(out[8:], ib, 6)
    info = _wait_clean(gpu_client, gen.id)
    for w in info.values():
        assert w[gen.id]["runs"] == 0 and w[gen.id]["used"] == [0, 0] and not w["threads"]


@needs_2_gpus
def test_device_shuffle_twice_the_budget_spills(gpu_client: Any) -> None:
    from mpshuffle.dask import bootstrap_dask_cluster

    # Per GPU 6 inputs x 1 M rows x 26 B = 156 MB inserted (and about as much
    # received); a budget of 78 MB is half of that.
    total = int(cupy.cuda.runtime.memGetInfo()[1])
    frac = 78e6 / total
    gen = bootstrap_dask_cluster(gpu_client, spill_device=frac)
    parts, inputs = _run_shuffle(gpu_client, nin=12, nrows=1_000_000, npart=8)
    _check_output(parts, inputs, 8)
    info = _wait_clean(gpu_client, gen.id)
    for w in info.values():
        c = w[gen.id]
        assert c["runs"] == 0 and c["used"] == [0, 0] and not w["threads"]
        stats = c["history"][-1]
        assert stats["bytes_spilled_host"] > 0 and c["peak"][1] > 0
        assert stats["bytes_inserted"] >= 2 * c["budget"]
