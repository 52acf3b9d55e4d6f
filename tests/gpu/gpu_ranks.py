"""One rank of a multi-process device run, run as a subprocess by tests/gpu/test_gpu.py.

Usage: ``python tests/gpu/gpu_ranks.py RANK NRANKS ADDRESS_FILE OUTDIR [BUDGET_BYTES]``. Rank
``r`` sees only GPU ``r`` (of those visible; ``CUDA_VISIBLE_DEVICES``, as dask-cuda
gives each worker one): a :class:`~mpshuffle.shuffler.context.WorkerContext` over
a TCP host communicator (as a Dask worker holds, without Dask) runs one
:class:`~mpshuffle.shuffler.device.DeviceRun` of three deterministic input
tables per rank (rank 0 calls the barrier; NCCL moves the bytes), and writes
its inputs and owned output partitions (as NumPy) to ``OUTDIR/rank{r}.npz``
for the parent to check.
"""

from __future__ import annotations

import asyncio
import sys


def connect(rank: int, nranks: int, address_file: str):  # type: ignore[no-untyped-def]
    """Host communicator of ``nranks`` processes on this machine.

    Rank 0 listens on a free port and writes its address to ``address_file``;
    the others read it from there.
    """
    import os
    import time

    from mpshuffle.comm.tcp import TcpCommunicator

    comm = asyncio.run(
        TcpCommunicator.start(
            rank, nranks, generation="gpu-test", token="t", listen_address="tcp://127.0.0.1:0"
        )
    )
    root = None
    if rank == 0:
        with open(address_file + ".tmp", "w") as f:
            f.write(comm.addresses[0])
        os.replace(address_file + ".tmp", address_file)
    else:
        deadline = time.monotonic() + 120
        while not os.path.exists(address_file):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 wrote no address to {address_file}")
            time.sleep(0.05)
        with open(address_file) as f:
            root = f.read()
    asyncio.run(comm.rendezvous(root, 120))
    return comm


def main() -> None:
    rank, nranks, address_file, outdir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    budget = int(sys.argv[5]) if len(sys.argv) > 5 else None
    import os

    # One GPU per process, as dask-cuda gives each worker: the rank-th visible one.
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    gpus = [g for g in visible.split(",") if g.strip()] if visible else [str(r) for r in range(nranks)]
    os.environ["CUDA_VISIBLE_DEVICES"] = gpus[rank]
    import cupy
    import numpy as np

    from mpshuffle.memory import MemoryType
    from mpshuffle.options import Options
    from mpshuffle.shuffler.context import WorkerContext
    from mpshuffle.table import owned_partitions
    from mpshuffle.table.device import DeviceAdapter, DeviceTable

    cupy.cuda.Device(0).use()
    comm = connect(rank, nranks, address_file)
    total = int(cupy.cuda.runtime.memGetInfo()[1])
    options = Options(spill_device=budget / total if budget else 0.5, timeout=120)
    ctx = WorkerContext(comm, "gpu-test", options, memory_limit=2**34, local_directory=outdir)
    assert ctx.device is not None and ctx.device.device == 0, "the rank did not take the GPU it was given"
    run = ctx.shuffler(1, device=True)
    rng = np.random.default_rng(rank)
    saved = {}
    meta = None
    for rnd in range(3):
        n = 20_000 + 1000 * rank + rnd * 7  # unequal sizes on purpose; round 1 of rank 1 empty
        if rank == 1 and rnd == 1:
            n = 0
        host = {
            "k": rng.integers(-1000, 1000, n).astype(np.int64),
            "j": rng.integers(0, 3, n).astype(np.int32),
            "x": rng.normal(size=n),
            "src": np.full(n, rank * 10 + rnd, dtype=np.int16),
            "row": np.arange(n, dtype=np.int64),
        }
        for k, v in host.items():
            saved[f"in{rnd}_{k}"] = v
        table = DeviceTable({k: cupy.asarray(v) for k, v in host.items()})
        meta = table.empty_like()
        # Input partitions numbered round-major: outputs come ordered by round, then rank.
        run.insert(rnd * nranks + rank, table, ["k", "j"], 5)
    # As Dask's barrier task depends on every insert: no rank's inputs-done before all inserted.
    comm.barrier("inserted", 120)
    if rank == 0:
        run.barrier(5)
    adapter = DeviceAdapter()
    for p in owned_partitions(rank, nranks, 5):
        t = adapter.unpack(run.extract(p), meta)
        assert t.xp is cupy, "output partition is not on the device"
        assert all(isinstance(c, cupy.ndarray) for c in t.columns.values())
        for k, v in t.to_host().columns.items():
            saved[f"out{p}_{k}"] = v
    stats = dict(ctx.history[-1][1])
    saved["stats"] = np.array([stats["bytes_spilled_host"], stats["rounds"]], dtype=np.int64)
    saved["device_used_after"] = np.array([ctx.resource.used(MemoryType.DEVICE)])
    np.savez(f"{outdir}/rank{rank}.npz", **saved)
    comm.barrier("done", 120)  # no rank closes while a peer may still send it acks
    ctx.close()
    comm.close()


if __name__ == "__main__":
    main()
