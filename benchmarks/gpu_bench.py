"""Per-GPU throughput of mpshuffle's device shuffle next to its practical limits.

One process per GPU (no Dask): ``python benchmarks/gpu_bench.py --gb 10``
launches ``--nranks`` ranks. Each rank holds an int64 ``key`` + 3 float64
columns of ``--gb`` GB on its GPU and measures, in the same run:

- ``nccl``: a raw NCCL all-to-all of the same bytes (one equal share per
  peer, the own share copied on the device);
- ``partition``: a raw CuPy hash partition of the same table (hash, stable
  argsort of the partition ids, gather of every column);
- ``mpshuffle``: the end-to-end device shuffle, from device-resident input to
  device-resident output partitions on their owners
  (:class:`mpshuffle.shuffler.collective.DeviceShuffle`, one round);
- ``spill`` (with ``--spill``): the device shuffle in 4 rounds under a device
  budget of half the data, so that half the received data spills to host;
  its result is checked (row count and column sums per rank, partition of
  every key).

GB/s per GPU = that GPU's input bytes / wall seconds, seconds measured from
a barrier to the slowest rank's end. Results go to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time


def _connect(rank: int, nranks: int, address_file: str):  # type: ignore[no-untyped-def]
    """Host communicator of ``nranks`` processes on this machine.

    Rank 0 listens on a free port and writes its address to ``address_file``;
    the others read it from there.
    """
    import os
    import time

    from mpshuffle.comm.tcp import TcpCommunicator

    comm = asyncio.run(
        TcpCommunicator.start(
            rank, nranks, generation="gpu", token="t", listen_address="tcp://127.0.0.1:0"
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




def _timed(comm, name: str, fn) -> float:  # type: ignore[no-untyped-def]
    """Seconds of ``fn`` on the slowest rank, from a common barrier."""
    import cupy
    import msgpack

    cupy.cuda.Device().synchronize()
    comm.barrier(("start", name), 120)
    t0 = time.perf_counter()
    fn()
    cupy.cuda.Device().synchronize()
    dt = time.perf_counter() - t0
    tag = ("time", name)
    if comm.rank != 0:
        comm.send(0, tag, [msgpack.packb(dt)])
        return float(msgpack.unpackb(bytes(comm.recv(0, tag, 120)[0])))
    worst = max([dt] + [msgpack.unpackb(bytes(comm.recv(r, tag, 120)[0])) for r in range(1, comm.nranks)])
    for r in range(1, comm.nranks):
        comm.send(r, tag, [msgpack.packb(worst)])
    return float(worst)


def rank_main(rank: int, nranks: int, address_file: str, args: argparse.Namespace) -> None:
    import cupy
    import numpy as np

    from mpshuffle.comm.nccl import NcclTransport
    from mpshuffle.shuffler.collective import DeviceShuffle
    from mpshuffle.memory import BufferResource, MemoryType
    from mpshuffle.table.device import DeviceAdapter, DeviceTable, partition_order

    cupy.cuda.Device(rank).use()
    comm = _connect(rank, nranks, address_file)
    transport = asyncio.run(NcclTransport.acreate(comm))
    adapter = DeviceAdapter()
    results: list[dict] = []

    def table(nbytes: int, seed: int) -> DeviceTable:
        n = nbytes // 32
        rs = cupy.random.RandomState(seed * nranks + rank)
        return DeviceTable({
            "key": rs.randint(0, 2**62, size=n, dtype=cupy.int64),
            "a": rs.random_sample(n), "b": rs.random_sample(n), "c": rs.random_sample(n),
        })

    def run_size(gb: float, reps: int) -> None:
        nbytes = int(gb * 1e9)
        t = table(nbytes, 1)
        inbytes = t.nbytes
        buf = cupy.empty(inbytes, dtype=cupy.uint8)
        rbuf = cupy.empty(inbytes, dtype=cupy.uint8)
        share = inbytes // nranks
        sends = {p: [buf[p * share:(p + 1) * share]] for p in range(nranks)}
        recvs = {p: [rbuf[p * share:(p + 1) * share]] for p in range(nranks)}

        def partition() -> None:
            ids = adapter.partition_ids(t, ["key"], args.npartitions)
            order, _ = partition_order(ids, args.npartitions, nranks)
            {k: cupy.take(c, order) for k, c in t.columns.items()}

        def e2e() -> None:
            sh = DeviceShuffle(comm, transport, args.npartitions, ["key"], op_id=1)
            sh.insert(t)
            outs = [sh.extract(p) for p in sh.owned]
            e2e.rows = sum(o.nrows for o in outs)  # type: ignore[attr-defined]
            e2e.stats = dict(sh.statistics)  # type: ignore[attr-defined]

        for method, fn in (("nccl", lambda: transport.exchange(sends, recvs)),
                           ("partition", partition), ("mpshuffle", e2e)):
            times = [_timed(comm, f"{method}-{gb}-{i}", fn) for i in range(reps)]
            cupy.get_default_memory_pool().free_all_blocks()
            rec = {"method": method, "gb_per_gpu": inbytes / 1e9, "seconds": times,
                   "best_gbps": inbytes / 1e9 / min(times),
                   "median_gbps": inbytes / 1e9 / statistics.median(times)}
            if method == "mpshuffle":
                rec["stats"] = e2e.stats  # type: ignore[attr-defined]
            results.append(rec)
            if rank == 0:
                print(json.dumps(rec), flush=True)

    run_size(0.5, 1)  # warm-up: kernels compiled, NCCL connections made
    results.clear()
    for gb in args.gb:
        run_size(gb, args.reps)
        cupy.get_default_memory_pool().free_all_blocks()

    if args.spill:
        gb = args.spill
        nbytes = int(gb * 1e9)
        budget = nbytes // 2
        resource = BufferResource({MemoryType.DEVICE: budget})
        rounds = [table(nbytes // 4, 10 + r) for r in range(4)]
        in_sums = np.array([[float(t.columns[k].sum()) for k in ("a", "b", "c")] for t in rounds]).sum(0)
        in_rows = sum(t.nrows for t in rounds)
        box = {}

        def spill_run() -> None:
            sh = DeviceShuffle(comm, transport, args.npartitions, ["key"], op_id=2, resource=resource)
            for t in rounds:
                sh.insert(t)
            box["stats"] = dict(sh.statistics)
            box["outs"] = {p: sh.extract(p) for p in sh.owned}

        secs = _timed(comm, "spill", spill_run)
        outs = box["outs"]
        ok = all(
            bool((adapter.partition_ids(o, ["key"], args.npartitions) == p).all())
            for p, o in outs.items()
        )
        out_sums = np.array([[float(o.columns[k].sum()) for k in ("a", "b", "c")] for o in outs.values()]).sum(0)
        out_rows = sum(o.nrows for o in outs.values())
        import msgpack
        mine = msgpack.packb([in_rows, out_rows, list(in_sums), list(out_sums), ok])
        if rank != 0:
            comm.send(0, ("check",), [mine])
        else:
            got = [msgpack.unpackb(mine)] + [msgpack.unpackb(bytes(comm.recv(r, ("check",), 120)[0])) for r in range(1, nranks)]
            rows_ok = sum(g[0] for g in got) == sum(g[1] for g in got)
            sums_ok = np.allclose(np.sum([g[2] for g in got], 0), np.sum([g[3] for g in got], 0))
            rec = {"method": "spill", "gb_per_gpu": in_rows * 32 / 1e9, "device_budget_bytes": budget,
                   "seconds": [secs], "best_gbps": in_rows * 32 / 1e9 / secs, "stats": box["stats"],
                   "correct": bool(rows_ok and sums_ok and all(g[4] for g in got))}
            results.append(rec)
            print(json.dumps(rec), flush=True)
        comm.barrier("spill-done", 120)

    if rank == 0:
        meta = {"nranks": nranks, "npartitions": args.npartitions,
                "cupy": cupy.__version__, "nccl": cupy.cuda.nccl.get_version(),
                "device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    comm.barrier("end", 120)
    transport.close()
    comm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gb", type=float, nargs="+", default=[10.0], help="GB of input per GPU")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--nranks", type=int, default=2)
    ap.add_argument("--npartitions", type=int, default=16)
    ap.add_argument("--spill", type=float, default=0.0, help="GB per GPU of the spill run (0: none)")
    ap.add_argument("--out", default="gpu_bench.json")
    ap.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--address-file", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank >= 0:
        rank_main(args.rank, args.nranks, args.address_file, args)
        return
    import tempfile

    address_file = os.path.join(tempfile.mkdtemp(prefix="mpshuffle-bench-"), "root-address")
    procs = [
        subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--rank", str(r), "--address-file", address_file],
                         env=dict(os.environ))
        for r in range(args.nranks)
    ]
    codes = [p.wait() for p in procs]
    if any(codes):
        sys.exit(f"rank exit codes {codes}")


if __name__ == "__main__":
    main()
