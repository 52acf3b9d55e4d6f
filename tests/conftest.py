"""Shared fixtures: one LocalCluster of 2 single-threaded worker processes per module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from distributed import Client, LocalCluster

from mpshuffle.comm import LocalCommunicator


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
        "threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("mpshuffle")),
    }
