"""Workers of one host exchange chunks through shared memory; with the option off, over TCP."""

from __future__ import annotations

import os

import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from distributed import Client

from conftest import worker_state
from mpshuffle.dask import bootstrap_dask_cluster, shuffle
from mpshuffle.table import partition_ids


def _comm_bytes(dask_worker) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    ctx = dask_worker.plugins["mpshuffle"].context
    return ctx.comm.bytes_sent, ctx.comm.bytes_sent_shared


def _frame(n: int) -> pd.DataFrame:
    rng = np.random.default_rng(7)
    keys = rng.integers(0, 10**6, n)
    return pd.DataFrame({"k": keys, "x": rng.random(n), "s": pd.array([f"v{k}" for k in keys], dtype="str")})


@pytest.mark.skipif(not os.access("/dev/shm", os.W_OK), reason="no writable /dev/shm")
@pytest.mark.parametrize("shared_memory", [True, False])
def test_chunks_between_workers_of_one_host(client: Client, shared_memory: bool) -> None:
    bootstrap_dask_cluster(client, shared_memory=shared_memory)
    before = client.run(_comm_bytes)
    inp = _frame(400_000)  # ~12 MB: chunks of batch_bytes (4 MiB), far above the shared-memory minimum
    ddf = dd.from_pandas(inp, npartitions=4)
    parts = client.compute(shuffle(ddf, "k", npartitions=6, ignore_index=True).to_delayed(), sync=True)
    out = pd.concat(parts, ignore_index=True)
    inp = ddf.compute()  # with Dask's own conversions (string dtypes), as the meta has them
    pd.testing.assert_frame_equal(
        out.sort_values(["k", "x"]).reset_index(drop=True), inp.sort_values(["k", "x"]).reset_index(drop=True)
    )
    for j, p in enumerate(parts):
        assert set(partition_ids(p[["k"]], 6)) <= {j}
    after = client.run(_comm_bytes)
    sent = {w: after[w][0] - before[w][0] for w in after}
    shared = {w: after[w][1] - before[w][1] for w in after}
    assert all(v > 1_000_000 for v in sent.values())
    if shared_memory:
        assert all(v > 0.9 * sent[w] for w, v in shared.items())
    else:
        assert all(v == 0 for v in shared.values())
    state = client.run(worker_state)
    assert all(s["shufflers"] == [] for s in state.values())
    # Every message file was taken (and unlinked) by its receiver.
    for generation in set(client.run(_generation).values()):
        assert [f for f in os.listdir("/dev/shm") if f.startswith(f"mpshuffle-{generation}-")] == []


def _generation(dask_worker) -> str:  # type: ignore[no-untyped-def]
    return dask_worker.plugins["mpshuffle"].context.generation
