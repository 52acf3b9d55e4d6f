"""Device shuffles on dask-cuda's LocalCUDACluster, and of dask_cudf collections.

Needs CuPy, two GPUs and dask-cuda (one worker per GPU); the cudf tests also
need cudf and dask_cudf. They skip elsewhere. The first test on CPUs checks
how cudf frames are recognized and that their index is refused.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pandas as pd
import pytest

from conftest import worker_addresses
from mpshuffle.memory import MemoryType
from mpshuffle.shuffler.device import is_device_meta
from mpshuffle.table.cudf import is_cudf_frame
from mpshuffle.table.device import DeviceTable

try:
    import cupy

    _NDEV = int(cupy.cuda.runtime.getDeviceCount())
except Exception:  # noqa: BLE001 - no CuPy, no driver or no device
    cupy = None
    _NDEV = 0

try:
    import dask_cuda  # noqa: F401

    _HAVE_DASK_CUDA = True
except Exception:  # noqa: BLE001 - an install without CUDA raises more than ImportError
    _HAVE_DASK_CUDA = False

try:
    import cudf  # noqa: F401
    import dask_cudf  # noqa: F401

    _HAVE_CUDF = True
except Exception:  # noqa: BLE001 - as above
    _HAVE_CUDF = False

needs_cuda_cluster = pytest.mark.skipif(
    _NDEV < 2 or not _HAVE_DASK_CUDA, reason="needs CuPy, two CUDA devices and dask-cuda"
)
needs_cudf = pytest.mark.skipif(not _HAVE_CUDF, reason="needs cudf and dask_cudf")


class DataFrame:
    """Stands in for ``cudf.DataFrame``'s type identity (module and name) on CPU machines."""

    __module__ = "cudf.core.dataframe"


def test_cudf_frames_take_the_device_path_and_refuse_the_index() -> None:
    from mpshuffle.dask import shuffle_graph

    fake = DataFrame()
    assert is_cudf_frame(fake) and is_device_meta(fake)
    assert not is_cudf_frame(pd.DataFrame()) and not is_device_meta(pd.DataFrame())
    # NumPy-backed device tables (the host twin) stay on the host path.
    assert not is_device_meta(DeviceTable({"k": np.zeros(0, np.int64)}))
    with pytest.raises(ValueError, match="ignore_index=True"):
        shuffle_graph(["a"], on=["k"], npartitions=2, meta=fake, keep_index=True)


# -- LocalCUDACluster ------------------------------------------------------------


@pytest.fixture(scope="module")
def cuda_client() -> Any:
    from dask_cuda import LocalCUDACluster
    from distributed import Client

    with LocalCUDACluster(
        n_workers=2, CUDA_VISIBLE_DEVICES="0,1", threads_per_worker=1, dashboard_address=":0",
    ) as cluster, Client(cluster) as client:
        client.wait_for_workers(2)
        yield client


def _make_table(i: int, n: int) -> DeviceTable:
    import cupy as cp

    rs = cp.random.RandomState(i)
    return DeviceTable({
        "key": rs.randint(0, 2**40, n, dtype=cp.int64),
        "x": rs.random_sample(n),
        "row": cp.arange(n, dtype=cp.int64) + i * 10**9,
    })


def _table_to_pandas(t: DeviceTable) -> pd.DataFrame:
    return pd.DataFrame({k: v.get() for k, v in t.columns.items()})


def _check_rows_and_membership(outputs: list[pd.DataFrame], inputs: pd.DataFrame, on: str) -> None:
    from mpshuffle.table.hashing import partition_ids

    got = pd.concat(outputs, ignore_index=True).sort_values("row", ignore_index=True)
    want = inputs.sort_values("row", ignore_index=True)
    pd.testing.assert_frame_equal(got, want)  # same rows, values and dtypes
    for j, part in enumerate(outputs):
        if len(part):
            ids = partition_ids(part[[on]], len(outputs))
            assert set(np.unique(ids).tolist()) == {j}


def _wait_no_runs(client: Any) -> dict[str, Any]:
    def probe(dask_worker: Any) -> dict[str, Any]:
        from mpshuffle.dask.worker import PLUGIN_NAME

        plugin = dask_worker.plugins[PLUGIN_NAME]
        return {
            g: (len(c.shufflers), sum(c.resource.used(m) for m in MemoryType)) for g, c in plugin.contexts.items()
        }

    deadline = time.monotonic() + 15
    while True:
        info = client.run(probe)
        if all(v == (0, 0) for w in info.values() for v in w.values()) or time.monotonic() > deadline:
            return info
        time.sleep(0.2)


@needs_cuda_cluster
def test_bootstrap_and_device_table_shuffle_on_local_cuda_cluster(cuda_client: Any) -> None:
    from mpshuffle.dask import bootstrap_dask_cluster, shuffle_graph

    gen = bootstrap_dask_cluster(cuda_client, pool_size=0.1, spill_device=0.25)
    assert gen.nranks == 2

    def where(dask_worker: Any) -> tuple[str, int, int]:
        import cupy as cp

        from mpshuffle.dask.worker import PLUGIN_NAME

        ctx = dask_worker.plugins[PLUGIN_NAME].context
        total = int(cp.cuda.runtime.memGetInfo()[1])
        return cp.cuda.Device(ctx.device.device).pci_bus_id, ctx.device.budget, total

    info = cuda_client.run(where)
    assert len({pci for pci, _, _ in info.values()}) == 2  # one worker per physical GPU
    assert all(budget == int(0.25 * total) for _, budget, total in info.values())

    workers = worker_addresses(cuda_client)
    nin, n, npart = 6, 100_000, 8
    futs = [cuda_client.submit(_make_table, i, n, workers=[workers[i % 2]], pure=False) for i in range(nin)]
    meta = _make_table(0, 0)
    graph, keys = shuffle_graph([f.key for f in futs], on=["key"], npartitions=npart, meta=meta)
    for k, task in list(graph.items()):
        if isinstance(k, tuple) and "insert" in k[0]:
            graph[k] = (task[0], futs[task[2]], *task[2:])
    host_keys = [("to-pandas", j) for j in range(npart)]
    for hk, k in zip(host_keys, keys, strict=True):
        graph[hk] = (_table_to_pandas, k)
    outputs = cuda_client.get(graph, host_keys)
    inputs = pd.concat([_table_to_pandas(_make_table(i, n)) for i in range(nin)], ignore_index=True)
    _check_rows_and_membership(outputs, inputs, "key")
    assert all(v == (0, 0) for w in _wait_no_runs(cuda_client).values() for v in w.values())


def _make_cudf(i: int, n: int) -> Any:
    import cudf

    t = _make_table(i, n)
    return cudf.DataFrame(dict(t.columns))


@needs_cuda_cluster
@needs_cudf
def test_dask_cudf_collection_shuffles_on_the_gpus(cuda_client: Any) -> None:
    import cudf
    import dask.dataframe as dd

    from mpshuffle.dask import shuffle

    workers = worker_addresses(cuda_client)
    nin, n = 6, 50_000
    futs = [cuda_client.submit(_make_cudf, i, n, workers=[workers[i % 2]], pure=False) for i in range(nin)]
    meta = _make_cudf(0, 0)
    ddf = dd.from_delayed(futs, meta=meta, verify_meta=False)
    with pytest.raises(ValueError, match="ignore_index=True"):
        shuffle(ddf, on="key")
    out = shuffle(ddf, on="key", npartitions=5, ignore_index=True)
    assert isinstance(out._meta, cudf.DataFrame)
    parts = [p.to_pandas() for p in cuda_client.compute(out.to_delayed(), sync=True)]
    inputs = pd.concat([_make_cudf(i, n).to_pandas() for i in range(nin)], ignore_index=True)
    _check_rows_and_membership(parts, inputs, "key")
    assert all(v == (0, 0) for w in _wait_no_runs(cuda_client).values() for v in w.values())
