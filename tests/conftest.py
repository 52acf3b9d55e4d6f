"""Shared fixtures: one LocalCluster of 2 single-threaded worker processes per module."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from distributed import Client, LocalCluster

from mpshuffle.comm import LocalCommunicator


@pytest.fixture(autouse=True)
def _restore_mpshuffle_config() -> Iterator[None]:
    """``bootstrap_dask_cluster(client, **options)`` sets its options into this
    process's dask.config for good (as the user's next graphs must see them):
    each test starts from the configuration it found."""
    import copy

    import dask.config

    saved = copy.deepcopy(dask.config.config.get("mpshuffle"))
    yield
    if saved is None:
        dask.config.config.pop("mpshuffle", None)
    else:
        dask.config.config["mpshuffle"] = saved


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """A LocalCluster of 2 worker processes × 1 thread, shared by a test module."""
    with LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0", memory_limit="4GiB"
    ) as c:
        yield c


@pytest.fixture
def client(cluster: LocalCluster) -> Iterator[Client]:
    """A synchronous client of the module's cluster, closed after the test."""
    with Client(cluster) as c:
        yield c


@pytest.fixture
def comm() -> Iterator[LocalCommunicator]:
    """A single-rank communicator, closed after the test (device runs without a cluster)."""
    c = LocalCommunicator()
    yield c
    c.close()


def worker_state(dask_worker) -> dict:  # type: ignore[no-untyped-def]
    """What mpshuffle holds on a worker: live shufflers and spill directories (for client.run)."""
    import os
    import threading

    plugin = dask_worker.plugins.get("mpshuffle")
    ctx = getattr(plugin, "context", None)
    spill = []
    if ctx is not None and ctx.resource.spill_dir and os.path.isdir(ctx.resource.spill_dir):
        spill = [n for n in os.listdir(ctx.resource.spill_dir) if n.startswith("mpshuffle")]
    return {
        "shufflers": sorted(ctx.shufflers) if ctx is not None else [],
        "spill": spill,
        # The kernels' preload thread is left out: it ends once they are loaded, and a
        # client's connect starts it (mpshuffle.dask.client_preload), not a run.
        "threads": sorted(t.name for t in threading.enumerate()
                          if t.name.startswith("mpshuffle") and t.name != "mpshuffle-preload"),
    }


def host_table(i: int, n: int) -> dict[str, np.ndarray]:
    """Columns of input partition ``i`` for device-run tests: ``n`` rows, a unique ``row`` id."""
    rng = np.random.default_rng(i)
    return {
        "key": rng.integers(0, 2**40, n),
        "x": rng.normal(size=n),
        "s": rng.integers(0, 100, n).astype(np.int16),
        "row": np.arange(n, dtype=np.int64) + i * 10**9,
    }


def check_device_output(
    parts: list[dict[str, np.ndarray]], inputs: list[dict[str, np.ndarray]], npart: int
) -> None:
    """Output partition j holds exactly the input rows whose key hashes to j, dtypes kept."""
    from mpshuffle.table.device import DeviceAdapter, DeviceTable

    got = {k: np.concatenate([p[k] for p in parts]) for k in inputs[0]}
    want = {k: np.concatenate([t[k] for t in inputs]) for k in inputs[0]}
    order_g, order_w = np.argsort(got["row"]), np.argsort(want["row"])
    for k, w in want.items():
        assert got[k].dtype == w.dtype
        np.testing.assert_array_equal(got[k][order_g], w[order_w])
    adapter = DeviceAdapter()
    for j, p in enumerate(parts):
        if len(p["key"]):
            ids = adapter.partition_ids(DeviceTable(p), ["key"], npart)
            assert set(np.unique(ids).tolist()) == {j}


def wait_for(predicate: Callable[[], Any], what: str, timeout: float = 30) -> Any:
    """Poll ``predicate`` every 50 ms until it returns something true, and return that.

    Raises ``AssertionError`` naming ``what`` after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def worker_addresses(client: Client) -> list[str]:
    """The addresses of the workers the scheduler has now, sorted.

    Asks the scheduler and reads its answer, rather than
    ``client.scheduler_info()["workers"]``: that returns the client's shared
    ``_scheduler_identity``, which distributed's periodic refresh (every 2 s,
    without workers since 2026.x) can overwrite between the fetch and the
    read, so a test saw no worker at all.
    """
    return sorted(client.sync(client.scheduler.identity, n_workers=-1)["workers"])


@contextlib.contextmanager
def three_worker_client() -> Iterator[Client]:
    """A client of a fresh, bootstrapped LocalCluster of 3 worker processes (one to lose, two to go on).

    Each worker runs under a nanny, which may restart a killed worker.
    """
    from mpshuffle.dask import bootstrap_dask_cluster

    with LocalCluster(
        n_workers=3, threads_per_worker=1, processes=True, dashboard_address=":0", memory_limit="2GiB"
    ) as cluster, Client(cluster) as client:
        client.wait_for_workers(3, timeout=60)
        bootstrap_dask_cluster(client, timeout=10)
        yield client
