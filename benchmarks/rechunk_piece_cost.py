"""What cutting a block and assembling a partition cost per piece, in one process: ``split_for`` and ``unpack``.

Not a test, and no cluster: the rechunk's two per-piece stages on the
time-to-space geometry of ``--workers`` ranks, without transport or Dask.
Blocks ``(1, S, S)`` of a ``(T, S, S)`` float32 array to blocks
``(T, s, s)``, ``--per-partition`` output blocks per partition (the 16-worker
run of the lent host: ``T`` 1600, ``S`` 1000, ``s`` 50, 4 blocks, 16
ranks). Every block is cut as its owner (rank ``t % ranks``) cuts it, into
pooled buffers released before the next (as a sent chunk's are); then the
pieces of partition 0 (one per block, the owner's copies) are assembled
``--repeat`` times. CPU seconds of this process (user + system), per block,
per partition and per piece, beside one copy of the partition's bytes into
warm memory (the floor of the assembly, which also faults in fresh output).

Run: ``python benchmarks/rechunk_piece_cost.py [--t 1600 --side 1000 --cut 50 --per-partition 4 --workers 16]``
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
from pathlib import Path

import numpy as np
import pyarrow as pa

from mpshuffle.memory.packed import PackedData
from mpshuffle.memory.pool import HostPool
from mpshuffle.table.ndarray import VIEW, BlockPlan, NDArrayAdapter

RESULTS = Path(__file__).resolve().parent / "results"


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--t", type=int, default=1600)
    p.add_argument("--side", type=int, default=1000)
    p.add_argument("--cut", type=int, default=50)
    p.add_argument("--per-partition", type=int, default=4)
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--name", default="")
    a = p.parse_args()
    n = a.side // a.cut
    side_cuts = (tuple((j, j * a.cut, (j + 1) * a.cut, 0) for j in range(n)),)
    plan = BlockPlan(cuts=(tuple(((0, 0, 1, t),) for t in range(a.t)), side_cuts, side_cuts), nout=(1, n, n),
                     per_partition=a.per_partition)
    pool = HostPool(1 << 30)
    rng = np.random.default_rng(0)
    blocks = [rng.random((1, a.side, a.side), dtype=np.float32) for _ in range(min(a.t, 32))]

    def split(t: int) -> dict[int, PackedData]:
        adapter = NDArrayAdapter(np.float32, plan, (t, 0, 0), views=True)
        return adapter.split_for(blocks[t % len(blocks)], [], plan.npartitions, None,
                                 rank=t % a.workers, nranks=a.workers, pool=pool)

    for t in range(min(a.t, 50)):  # warm: the pool's blocks, the layouts
        split(t)
    splits = []
    for _ in range(a.repeat):
        c0 = _cpu()
        for t in range(a.t):
            split(t)
        splits.append((_cpu() - c0) / a.t)
    got = []
    for t in range(a.t):
        piece = split(t)[0]
        data = piece.data if piece.metadata[0] == VIEW else pa.py_buffer(bytes(memoryview(piece.data)))
        got.append(PackedData(piece.metadata, data, piece.nrows))
    out = NDArrayAdapter(np.float32, plan, partition=0)
    unpacks = []
    for _ in range(a.repeat):
        c0 = _cpu()
        res = out.unpack(got, None)
        unpacks.append(_cpu() - c0)
        nbytes = sum(v.nbytes for v in res.values())
        del res
    dst = np.empty(nbytes // 4, np.float32)
    src = rng.random(nbytes // 4, dtype=np.float32)
    dst[:] = 0
    floors = []
    for _ in range(a.repeat):
        c0 = _cpu()
        np.copyto(dst, src)
        floors.append(_cpu() - c0)

    def mmm(values: list[float], scale: float) -> list[float]:
        return [round(min(values) * scale, 3), round(statistics.median(values) * scale, 3),
                round(max(values) * scale, 3)]

    row = {
        "t": a.t, "side": a.side, "cut": a.cut, "per_partition": a.per_partition, "ranks": a.workers,
        "pieces_per_block": plan.npartitions, "pieces_per_partition": len(got), "partition_mib": nbytes / 2**20,
        "split_ms_per_block": mmm(splits, 1e3), "split_us_per_piece": mmm(splits, 1e6 / plan.npartitions),
        "unpack_ms_per_partition": mmm(unpacks, 1e3), "unpack_us_per_piece": mmm(unpacks, 1e6 / len(got)),
        "copy_floor_ms_per_partition": mmm(floors, 1e3),
    }
    print(json.dumps(row, indent=1))
    if a.name:
        (RESULTS / f"{a.name}.json").write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
