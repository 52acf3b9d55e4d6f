"""The engine driven without Dask: host runs on two ranks of the TCP communicator, in one process.

Each rank has its own :class:`TcpCommunicator` (own progress thread and
sockets) and :class:`WorkerContext`; the test plays the scheduler's part:
it inserts on both ranks, runs the barrier on one and extracts every output
partition on its owner.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator

import numpy as np
import pandas as pd
import pytest

from mpshuffle.comm.tcp import TcpCommunicator
from mpshuffle.errors import ShuffleError
from mpshuffle.memory import MemoryType
from mpshuffle.options import Options
from mpshuffle.shuffler.context import WorkerContext
from mpshuffle.table import PandasAdapter, owned_partitions, partition_ids, partition_owner

NRANKS = 2


def _connect(nranks: int) -> list[TcpCommunicator]:
    async def connect() -> list[TcpCommunicator]:
        # Unique: ranks share /dev/shm with other processes on the machine.
        generation = f"g-{uuid.uuid4().hex[:8]}"
        comms = [await TcpCommunicator.start(r, nranks, generation=generation, token="secret") for r in range(nranks)]
        root = comms[0].addresses[0]
        await asyncio.gather(*(c.rendezvous(None if c.rank == 0 else root, 30) for c in comms))
        return comms

    return asyncio.run(connect())


@pytest.fixture
def contexts() -> Iterator[list[WorkerContext]]:
    comms = _connect(NRANKS)
    workers = tuple(f"w{r}" for r in range(NRANKS))
    ctxs = [WorkerContext(c, "g", Options(timeout=30, batch_bytes=4096), workers=workers) for c in comms]
    yield ctxs
    for ctx in ctxs:
        ctx.close()


def _inputs(n: int) -> list[pd.DataFrame]:
    rng = np.random.default_rng(7)
    return [
        pd.DataFrame({"k": rng.integers(0, 50, 300), "x": rng.normal(size=300), "row": np.arange(300) + 1000 * i})
        for i in range(n)
    ]


def test_a_host_run_on_two_tcp_ranks(contexts: list[WorkerContext]) -> None:
    npart, inputs, adapter = 5, _inputs(4), PandasAdapter()
    runs = [ctx.shuffler(1) for ctx in contexts]
    for i, frame in enumerate(inputs):  # inputs 0, 2 on rank 0; 1, 3 on rank 1
        runs[i % NRANKS].insert_frame(i, frame, adapter, ["k"], npart, attempt=f"a{i}")
    runs[1].barrier(npart, accepted=[f"a{i}" for i in range(len(inputs))])
    everything = pd.concat(inputs, ignore_index=True)
    ids = partition_ids(everything[["k"]], npart)
    for j in range(npart):
        owner = partition_owner(j, NRANKS)
        assert j in owned_partitions(owner, NRANKS, npart)
        out = adapter.unpack(runs[owner].extract(j), everything.iloc[:0])
        # Exactly the rows hashed to j, in input-partition then row order.
        pd.testing.assert_frame_equal(out.reset_index(drop=True), everything[ids == j].reset_index(drop=True))
    for ctx, run in zip(contexts, runs, strict=True):
        assert run.closed and ctx.shufflers == {}
        assert ctx.resource.used(MemoryType.HOST) == 0
        ((_, stats),) = list(ctx.history)
        assert stats["bytes_sent"] > 0 and stats["chunks_sent"] > 1  # batch_bytes split the sends


def test_a_peer_lost_fails_the_run_naming_its_worker(contexts: list[WorkerContext]) -> None:
    runs = [ctx.shuffler(2, batch_bytes=4 << 20) for ctx in contexts]
    runs[0].insert_frame(0, _inputs(1)[0], PandasAdapter(), ["k"], 4)
    contexts[1].comm.close()
    with pytest.raises(ShuffleError, match=r"rank 1 \(worker w1\)"):
        runs[0].barrier(4)
    # The run's buffers are freed; only the pool's idle memory stays reserved while the run is listed.
    assert contexts[0].resource.used(MemoryType.HOST) == contexts[0].pool.idle_bytes


def test_the_engine_runs_without_dask_or_distributed() -> None:
    code = textwrap.dedent(
        """
        import sys
        import pandas as pd
        from mpshuffle.comm import LocalCommunicator
        from mpshuffle.options import Options
        from mpshuffle.shuffler.context import WorkerContext
        from mpshuffle.table import PandasAdapter

        ctx = WorkerContext(LocalCommunicator(), "g", Options(timeout=10), workers=("here",))
        run = ctx.shuffler(1)
        df = pd.DataFrame({"k": range(100), "v": range(100)})
        run.insert_frame(0, df, PandasAdapter(), ["k"], 3)
        run.barrier(3)
        rows = sum(len(PandasAdapter().unpack(run.extract(j), df.iloc[:0])) for j in range(3))
        ctx.close()
        print(rows, sorted({m.split(".")[0] for m in sys.modules} & {"dask", "distributed"}))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["100", "[]"], out.stdout + out.stderr


def test_extracts_give_received_pages_back_as_they_go_and_the_run_leaves_nothing(
    contexts: list[WorkerContext],
) -> None:
    """Inputs of thousands of rows into hundreds of partitions: each received chunk holds a piece of
    every partition its rank owns, a few rows each, so pages are shared by many partitions. Extracts
    in partition order, each releasing its pieces once unpacked, give most received bytes back before
    the rank's last extract; every partition is still exact (no page another piece needed went). Once
    the run is done no postbox, chunk or piece table of it is alive."""
    import gc
    import weakref

    npart, nrows, adapter = 400, 20_000, PandasAdapter()
    rng = np.random.default_rng(3)
    inputs = [
        pd.DataFrame({"k": rng.integers(0, 2**40, nrows), "x": rng.normal(size=nrows),
                      "row": np.arange(nrows) + nrows * i})
        for i in range(6)
    ]
    runs = [ctx.shuffler(2, batch_bytes=4 << 20) for ctx in contexts]
    for i, frame in enumerate(inputs):
        runs[i % NRANKS].insert_frame(i, frame, adapter, ["k"], npart, attempt=f"a{i}")
    runs[0].barrier(npart, accepted=[f"a{i}" for i in range(len(inputs))])
    received = [run.postbox.nbytes for run in runs]
    boxes = [weakref.ref(run.postbox) for run in runs]
    everything = pd.concat(inputs, ignore_index=True)
    ids = partition_ids(everything[["k"]], npart)
    given_back = [0] * NRANKS
    for j in range(npart):
        owner = partition_owner(j, NRANKS)
        pieces = runs[owner].extract(j)
        out = adapter.unpack(pieces, everything.iloc[:0])
        assert pieces.copied  # gathered: the frame holds none of the pieces' bytes
        given_back[owner] += pieces.release_pages()
        pd.testing.assert_frame_equal(out.reset_index(drop=True), everything[ids == j].reset_index(drop=True))
    for r in range(NRANKS):
        assert given_back[r] > received[r] // 2, (given_back, received)
    del pieces, out, runs
    gc.collect()
    assert [box() for box in boxes] == [None, None]
    for ctx in contexts:
        assert ctx.shufflers == {} and ctx.resource.used(MemoryType.HOST) == 0 and ctx.pool.idle_bytes == 0
