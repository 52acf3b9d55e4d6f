"""One rank of a multi-GPU device-shuffle check, run as a subprocess by tests/gpu/test_gpu.py.

Usage: ``python tests/gpu/gpu_ranks.py RANK NRANKS ADDRESS_FILE OUTDIR [BUDGET_BYTES]``. Rank
``r`` uses GPU ``r``, builds its deterministic input rounds, shuffles them
with :class:`mpshuffle.shuffler.collective.DeviceShuffle` and writes its input
and output partitions (as NumPy) to ``OUTDIR/rank{r}.npz`` for the parent to check.
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
    import cupy
    import numpy as np

    from mpshuffle.comm.nccl import NcclTransport
    from mpshuffle.memory import BufferResource, MemoryType
    from mpshuffle.shuffler.collective import DeviceShuffle
    from mpshuffle.table.device import DeviceTable

    cupy.cuda.Device(rank).use()
    comm = connect(rank, nranks, address_file)
    transport = asyncio.run(NcclTransport.acreate(comm))
    resource = BufferResource({MemoryType.DEVICE: budget})
    sh = DeviceShuffle(comm, transport, npartitions=5, on=["k", "j"], resource=resource)
    rng = np.random.default_rng(rank)
    saved = {}
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
        sh.insert(DeviceTable({k: cupy.asarray(v) for k, v in host.items()}))
    stats = dict(sh.statistics)
    for p in sh.owned:
        t = sh.extract(p)
        assert t.xp is cupy, "output partition is not on the device"
        assert all(isinstance(c, cupy.ndarray) for c in t.columns.values())
        for k, v in t.to_host().columns.items():
            saved[f"out{p}_{k}"] = v
    saved["stats"] = np.array([stats["bytes_spilled"], stats["rounds"]], dtype=np.int64)
    saved["device_used_after"] = np.array([resource.used(MemoryType.DEVICE)])
    np.savez(f"{outdir}/rank{rank}.npz", **saved)
    transport.close()
    comm.close()


if __name__ == "__main__":
    main()
