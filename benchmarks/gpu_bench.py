"""Per-GPU throughput of mpshuffle's device shuffle next to its practical limits.

One process per GPU (no Dask): ``python benchmarks/gpu_bench.py --gb 10``
launches ``--nranks`` ranks (``--nranks 1`` on a one-GPU machine). Each rank
holds an int64 ``key`` + 3 float64 columns of ``--gb`` GB on its GPU and
measures, in the same run:

- ``nccl``: a raw NCCL all-to-all of the same bytes (one equal share per
  peer, the own share copied on the device);
- ``partition``: a raw CuPy hash partition of the same table (hash, stable
  argsort of the partition ids, gather of every column): CuPy's sort and
  scatter of the same bytes, the limit of the next row;
- ``pack``: what a :class:`~mpshuffle.shuffler.device.DeviceRun` insert does
  to the table on its GPU (hash, rank-major stable order, one kernel packing
  every column into the pieces of one buffer), no transfer;
- ``mpshuffle``: the end-to-end baseline device shuffle, from device-resident
  input to device-resident output partitions on their owners
  (``gpu_collective.DeviceShuffle`` beside this file, one round);
- ``spill`` (with ``--spill``): that shuffle in 4 rounds under a device
  budget of half the data, so that half the received data spills to host.

Every timed repetition's output is checked after its timing, on every rank,
before the next one: the received bytes of ``nccl`` against the pattern each
sender wrote; for the others the rows in all (summed over ranks), a checksum
of every column's bits (the sum of its values as ``uint64``, modulo 2^64,
summed over ranks) against the input's, and that every row's key hashes to
the partition it is in (for ``partition``, that rows are grouped in
rank-major partition order). A rep that fails its check stops the run with
an error; each record says ``"correct": true`` per rep otherwise.

GB/s per GPU = that GPU's input bytes / wall seconds, seconds measured from
a barrier to the slowest rank's end. Results go to ``--out`` as JSON, with
the device, CuPy, NCCL and mpshuffle versions.
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


def _allgather(comm, name: str, value):  # type: ignore[no-untyped-def]
    """Every rank's ``value`` (msgpack-able), in rank order, on every rank."""
    import msgpack

    tag = ("gather", name)
    if comm.rank != 0:
        comm.send(0, tag, [msgpack.packb(value)])
        return msgpack.unpackb(bytes(comm.recv(0, tag, 120)[0]))
    values = [value] + [msgpack.unpackb(bytes(comm.recv(r, tag, 120)[0])) for r in range(1, comm.nranks)]
    for r in range(1, comm.nranks):
        comm.send(r, tag, [msgpack.packb(values)])
    return values


def checksum(columns) -> int:  # type: ignore[no-untyped-def]
    """Sum of every column's values taken as ``uint64`` bits, modulo 2^64 (order-free, exact)."""
    import cupy

    total = 0
    for c in columns:
        bits = c.view(cupy.uint64) if c.dtype.itemsize == 8 else c.astype(cupy.uint64)
        total += int(bits.sum(dtype=cupy.uint64))
    return total % 2**64


def rank_main(rank: int, nranks: int, address_file: str, args: argparse.Namespace) -> None:
    import cupy
    import numpy as np
    from gpu_collective import DeviceShuffle

    import mpshuffle
    from mpshuffle.comm.nccl import NcclTransport
    from mpshuffle.memory import BufferResource, MemoryType
    from mpshuffle.table.device import (
        DeviceAdapter,
        DeviceTable,
        pack_sorted,
        partition_order,
        rank_major_pids,
        unpack_piece,
    )

    cupy.cuda.Device(rank).use()
    comm = _connect(rank, nranks, address_file)
    transport = asyncio.run(NcclTransport.acreate(comm))
    adapter = DeviceAdapter()
    npart = args.npartitions
    results: list[dict] = []

    def table(nbytes: int, seed: int) -> DeviceTable:
        n = nbytes // 32
        rs = cupy.random.RandomState(seed * nranks + rank)
        return DeviceTable({
            "key": rs.randint(0, 2**62, size=n, dtype=cupy.int64),
            "a": rs.random_sample(n), "b": rs.random_sample(n), "c": rs.random_sample(n),
        })

    def agree(name: str, rows: int, total: int, want_rows: int, want_sum: int, membership: bool) -> bool:
        """Rows and checksums summed over ranks match the inputs', and every rank's membership held."""
        got = _allgather(comm, name, [rows, total, want_rows, want_sum, membership])
        return (sum(g[0] for g in got) == sum(g[2] for g in got)
                and sum(g[1] for g in got) % 2**64 == sum(g[3] for g in got) % 2**64
                and all(g[4] for g in got))

    def in_partition(t: DeviceTable, pid: int) -> bool:
        return bool((adapter.partition_ids(t, ["key"], npart) == pid).all())

    def run_size(gb: float, reps: int) -> None:
        nbytes = int(gb * 1e9)
        t = table(nbytes, 1)
        inbytes = t.nbytes
        in_rows, in_sum = t.nrows, checksum(t.columns.values())
        share = inbytes // nranks
        # Sender s writes the byte (s * nranks + d) % 251 + 1 into its share for d.
        buf = cupy.empty(inbytes, dtype=cupy.uint8)
        for d in range(nranks):
            buf[d * share:(d + 1) * share] = (rank * nranks + d) % 251 + 1
        rbuf = cupy.empty(inbytes, dtype=cupy.uint8)
        sends = {p: [buf[p * share:(p + 1) * share]] for p in range(nranks)}
        recvs = {p: [rbuf[p * share:(p + 1) * share]] for p in range(nranks)}
        box: dict = {}

        def nccl_prepare() -> None:
            rbuf.fill(0)

        def nccl_check(name: str) -> bool:
            ok = all(bool((rbuf[s * share:(s + 1) * share] == (s * nranks + rank) % 251 + 1).all())
                     for s in range(nranks))
            got = _allgather(comm, name, ok)
            return all(got)

        def partition() -> None:
            ids = adapter.partition_ids(t, ["key"], npart)
            order, _ = partition_order(ids, npart, nranks)
            box["out"] = {k: cupy.take(c, order) for k, c in t.columns.items()}

        def partition_check(name: str) -> bool:
            out = DeviceTable(box.pop("out"))
            ids = adapter.partition_ids(out, ["key"], npart)
            major = (ids % nranks) * npart + ids  # rank-major position of each row's partition
            grouped = bool((major[1:] >= major[:-1]).all())
            return agree(name, out.nrows, checksum(out.columns.values()), in_rows, in_sum, grouped)

        def pack() -> None:
            ids = adapter.partition_ids(t, ["key"], npart)
            order, counts = partition_order(ids, npart, nranks)
            del ids
            box["out"] = pack_sorted(t, order, counts, rank_major_pids(npart, nranks))

        def pack_check(name: str) -> bool:
            pieces = box.pop("out")
            tables = {p: unpack_piece(pk) for p, pk in pieces.items()}
            member = all(in_partition(x, p) for p, x in tables.items())
            rows = sum(x.nrows for x in tables.values())
            total = sum(checksum(x.columns.values()) for x in tables.values())
            return agree(name, rows, total, in_rows, in_sum, member)

        def e2e() -> None:
            sh = DeviceShuffle(comm, transport, npart, ["key"], op_id=1)
            sh.insert(t)
            box["out"] = {p: sh.extract(p) for p in sh.owned}
            box["stats"] = dict(sh.statistics)

        def e2e_check(name: str) -> bool:
            outs = box.pop("out")
            member = all(in_partition(x, p) for p, x in outs.items())
            rows = sum(x.nrows for x in outs.values())
            total = sum(checksum(x.columns.values()) for x in outs.values())
            return agree(name, rows, total, in_rows, in_sum, member)

        methods = (
            ("nccl", nccl_prepare, lambda: transport.exchange(sends, recvs), nccl_check),
            ("partition", None, partition, partition_check),
            ("pack", None, pack, pack_check),
            ("mpshuffle", None, e2e, e2e_check),
        )
        for method, prepare, fn, check in methods:
            times, correct = [], []
            for i in range(reps):
                if prepare is not None:
                    prepare()
                times.append(_timed(comm, f"{method}-{gb}-{i}", fn))
                ok = check(f"check-{method}-{gb}-{i}")
                if not ok:
                    raise SystemExit(f"rank {rank}: {method} at {gb} GB, rep {i}: output check failed")
                correct.append(ok)
            cupy.get_default_memory_pool().free_all_blocks()
            rec = {"method": method, "gb_per_gpu": inbytes / 1e9, "seconds": times,
                   "best_gbps": inbytes / 1e9 / min(times),
                   "median_gbps": inbytes / 1e9 / statistics.median(times), "correct": correct}
            if method == "mpshuffle":
                rec["stats"] = box.pop("stats")
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
        rounds = [table(nbytes // 4, 10 + r) for r in range(4)]
        in_rows = sum(t.nrows for t in rounds)
        in_sum = sum(checksum(t.columns.values()) for t in rounds)
        box = {}
        secs, correct = [], []
        for i in range(args.spill_reps):
            resource = BufferResource({MemoryType.DEVICE: budget})

            def spill_run(op_id: int = 2 + i, resource: BufferResource = resource) -> None:
                sh = DeviceShuffle(comm, transport, npart, ["key"], op_id=op_id, resource=resource)
                for t in rounds:
                    sh.insert(t)
                box["stats"] = dict(sh.statistics)
                box["outs"] = {p: sh.extract(p) for p in sh.owned}

            secs.append(_timed(comm, f"spill-{i}", spill_run))
            outs = box.pop("outs")
            member = all(in_partition(o, p) for p, o in outs.items())
            rows = sum(o.nrows for o in outs.values())
            total = sum(checksum(o.columns.values()) for o in outs.values())
            ok = agree(f"check-spill-{i}", rows, total, in_rows, in_sum, member)
            if not ok:
                raise SystemExit(f"rank {rank}: spill run rep {i}: output check failed")
            correct.append(ok)
            del outs
            cupy.get_default_memory_pool().free_all_blocks()
        if rank == 0:
            rec = {"method": "spill", "gb_per_gpu": in_rows * 32 / 1e9, "device_budget_bytes": budget,
                   "seconds": secs, "best_gbps": in_rows * 32 / 1e9 / min(secs), "stats": box["stats"],
                   "correct": correct}
            results.append(rec)
            print(json.dumps(rec), flush=True)
        comm.barrier("spill-done", 120)

    if rank == 0:
        meta = {"nranks": nranks, "npartitions": npart,
                "mpshuffle": mpshuffle.__version__, "numpy": np.__version__,
                "cupy": cupy.__version__, "nccl": cupy.cuda.nccl.get_version(),
                "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
                "device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                "device_memory_bytes": int(cupy.cuda.runtime.memGetInfo()[1])}
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
    ap.add_argument("--spill-reps", type=int, default=1, help="repetitions of the spill run")
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
