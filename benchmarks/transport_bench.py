"""Transport micro-benchmark: the ``tcp`` communicator against a raw-socket floor.

Not a test. Two processes on this machine, each pinned to its own core
where the machine has two or more: a sender that sends ``count`` messages
of ``size`` bytes to a receiver, with at most one message in flight (the
shuffler's back-pressure), and a receiver that drops each message once it
arrived. For every method and repeat it records the wall time from the first
send until the receiver confirmed the last byte, and each process's CPU time
(user and system, all threads, ``os.times``) over the same interval.

Methods:

* ``comm``: :class:`mpshuffle.comm.tcp.TcpCommunicator` over ``tcp://`` as a
  shuffle uses it between ranks (shared memory between the two processes
  here; each message is ``[16-byte header, data]``, the shape of one piece
  of a chunk);
* ``comm-tcp``: the same with ``shared_memory=False``: raw frames on the
  socket, received into fresh memory;
* ``comm-pool``: ``comm-tcp`` receiving into a :class:`mpshuffle.memory.pool.HostPool`
  (reused memory where the receiver dropped earlier messages; with
  ``--hold`` nothing is dropped, so it gets fresh memory too);
* ``comm-tls``: ``comm-tcp`` over ``tls://`` with ``Security.temporary()``;
* ``raw``: a plain TCP socket, 8-byte length prefix, ``sendall`` of the
  buffer and ``recv_into`` one reused buffer: the floor for a socket.

Prints MB/s (10**6 bytes per second) and CPU-s/GB (10**9 bytes) of each
side, min / median / max over the repeats, and writes them as JSON.

Run: ``python benchmarks/transport_bench.py [--sizes-mb 4 35] [--total-mb 1400]
[--repeats 5] [--methods comm raw] [-o benchmarks/results/transport.json]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import struct
import time
from typing import Any

import numpy as np

_LEN = struct.Struct("<Q")


def _pin(core: int) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        os.sched_setaffinity(0, {cpus[core % len(cpus)]})


def _cpu() -> tuple[float, float]:
    t = os.times()
    return t.user, t.system


# -- raw socket ----------------------------------------------------------------
def _raw_receiver(port_q: Any, result_q: Any, size: int, count: int, hold: bool) -> None:
    _pin(0)
    held = []
    srv = socket.create_server(("127.0.0.1", 0))
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    buf = memoryview(np.empty(size, dtype=np.uint8))
    head = bytearray(8)
    conn.recv_into(head, 8, socket.MSG_WAITALL)  # the sender's "start" mark
    u0, s0 = _cpu()
    for _ in range(count):
        got = conn.recv_into(head, 8, socket.MSG_WAITALL)
        (n,) = _LEN.unpack(head[:got])
        if hold:  # what a receiver that keeps every message must do: fresh memory each time
            buf = memoryview(np.empty(size, dtype=np.uint8))
            held.append(buf)
        view = buf[:n]
        while view.nbytes:
            k = conn.recv_into(view)
            view = view[k:]
    u1, s1 = _cpu()
    conn.sendall(b"d")
    result_q.put((u1 - u0, s1 - s0))
    conn.close()
    srv.close()


def _raw_sender(port: int, result_q: Any, size: int, count: int) -> None:
    _pin(1)
    sock = socket.create_connection(("127.0.0.1", port))
    data = np.ones(size, dtype=np.uint8)
    sock.sendall(_LEN.pack(0))
    t0 = time.perf_counter()
    u0, s0 = _cpu()
    for _ in range(count):
        sock.sendall(_LEN.pack(size))
        sock.sendall(memoryview(data))
    sock.recv(1)
    u1, s1 = _cpu()
    result_q.put((time.perf_counter() - t0, u1 - u0, s1 - s0))
    sock.close()


# -- the communicator ----------------------------------------------------------
def _security(tls: bool) -> Any:
    if not tls:
        return None
    from distributed.security import Security

    return Security.temporary()


async def _comm_rank(
    rank: int, addr_q: Any, result_q: Any, size: int, count: int, method: str, sec: Any, hold: bool
) -> None:
    from mpshuffle.comm.tcp import TcpCommunicator
    from mpshuffle.memory.pool import HostPool

    proto = "tls" if method == "comm-tls" else "tcp"
    comm = await TcpCommunicator.start(
        rank, 2, generation="bench", token="t", listen_address=f"{proto}://127.0.0.1:0", security=sec,
        shared_memory=method == "comm",
    )
    if method == "comm-pool":
        comm.set_receive_allocator(HostPool(4 * size).allocate)
    try:
        if rank == 0:
            addr_q.put(comm.addresses[0])
            await comm.rendezvous(None, 60)
            await _comm_receive(comm, result_q, count, hold)
        else:
            await comm.rendezvous(addr_q.get(), 60)
            await _comm_send(comm, result_q, size, count)
    finally:
        comm.close()


async def _comm_receive(comm: Any, result_q: Any, count: int, hold: bool) -> None:
    import threading

    held = []
    seen = [0]
    done = threading.Event()
    start = threading.Event()
    times: list[tuple[float, float]] = []

    def handler(src: int, tag: Any, frames: Any) -> None:
        if tag[1] == "start":
            times.append(_cpu())
            start.set()
            return
        seen[0] += 1
        if hold:  # a shuffle keeps every received piece until its extract
            held.append(frames)
        if seen[0] == count:
            times.append(_cpu())
            done.set()

    comm.register_handler("bench", handler)
    await comm.asend(1, ("ready",), [b""])
    await asyncio.get_running_loop().run_in_executor(None, done.wait)
    (u0, s0), (u1, s1) = times
    await comm.asend(1, ("done",), [b""])
    result_q.put((u1 - u0, s1 - s0))


async def _comm_send(comm: Any, result_q: Any, size: int, count: int) -> None:
    data = np.ones(size, dtype=np.uint8)
    header = bytes(16)
    await comm.arecv(0, ("ready",), 60)
    await comm.asend(0, ("bench", "start"), [b""])
    t0 = time.perf_counter()
    u0, s0 = _cpu()
    previous = None
    for _ in range(count):
        if previous is not None:
            await asyncio.wrap_future(previous)
        previous = comm.send_nowait(0, ("bench", "data"), [header, data])
    if previous is not None:
        await asyncio.wrap_future(previous)
    await comm.arecv(0, ("done",), 600)
    u1, s1 = _cpu()
    result_q.put((time.perf_counter() - t0, u1 - u0, s1 - s0))


def _comm_main(
    rank: int, addr_q: Any, result_q: Any, size: int, count: int, method: str, sec: Any, hold: bool
) -> None:
    _pin(1 - rank)
    asyncio.run(_comm_rank(rank, addr_q, result_q, size, count, method, sec, hold))


# -- driver --------------------------------------------------------------------
def run_once(method: str, size: int, count: int, hold: bool = False) -> dict[str, float]:
    """One transfer of ``count`` messages of ``size`` bytes; returns seconds and CPU times.

    ``hold``: the receiver keeps every message until the end (as a shuffle's
    postbox does), so its memory cannot be reused from one message to the next.
    """
    ctx = mp.get_context("spawn")
    q1, rq, sq = ctx.Queue(), ctx.Queue(), ctx.Queue()
    if method == "raw":
        recv = ctx.Process(target=_raw_receiver, args=(q1, rq, size, count, hold))
        recv.start()
        send = ctx.Process(target=_raw_sender, args=(q1.get(timeout=60), sq, size, count))
    else:
        sec = _security(method == "comm-tls")
        recv = ctx.Process(target=_comm_main, args=(0, q1, rq, size, count, method, sec, hold))
        recv.start()
        send = ctx.Process(target=_comm_main, args=(1, q1, sq, size, count, method, sec, hold))
    send.start()
    seconds, su, ss = sq.get(timeout=600)
    ru, rs = rq.get(timeout=600)
    send.join(30)
    recv.join(30)
    gb = size * count / 1e9
    return {
        "seconds": seconds,
        "mb_per_s": size * count / 1e6 / seconds,
        "send_user": su / gb, "send_sys": ss / gb,
        "recv_user": ru / gb, "recv_sys": rs / gb,
    }


def _summary(values: list[float]) -> list[float]:
    return [min(values), statistics.median(values), max(values)]


def main(argv: list[str] | None = None) -> None:
    """Run every method and message size ``repeats`` times (alternating) and print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[4, 35])
    p.add_argument("--total-mb", type=float, default=1400, help="bytes moved per transfer, in MB")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--methods", nargs="+", default=["comm", "raw"], choices=["comm", "comm-tcp", "comm-pool", "comm-tls", "raw"])
    p.add_argument(
        "--hold", action="store_true",
        help="receivers keep every message to the end (a shuffle's postbox); the raw floor "
        "then receives into a fresh buffer per message",
    )
    p.add_argument("-o", "--output", default=None)
    args = p.parse_args(argv)
    results: dict[str, Any] = {
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "node": platform.node()},
        "total_mb": args.total_mb, "hold": args.hold, "cases": [],
    }
    print(f"{'method':9} {'MB':>5} {'MB/s min/med/max':>22} {'send u+s CPU-s/GB':>20} {'recv u+s CPU-s/GB':>20}")
    for size_mb in args.sizes_mb:
        size = int(size_mb * 1e6)
        count = max(1, int(args.total_mb / size_mb))
        runs: dict[str, list[dict[str, float]]] = {m: [] for m in args.methods}
        for r in range(args.repeats):
            order = args.methods if r % 2 == 0 else list(reversed(args.methods))
            for m in order:
                runs[m].append(run_once(m, size, count, args.hold))
        for m in args.methods:
            rs = runs[m]
            case = {"method": m, "size_mb": size_mb, "count": count, "repeats": rs}
            for key in rs[0]:
                case[key] = _summary([x[key] for x in rs])
            results["cases"].append(case)
            mbs = case["mb_per_s"]
            send = _summary([x["send_user"] + x["send_sys"] for x in rs])
            recv = _summary([x["recv_user"] + x["recv_sys"] for x in rs])
            case["send_cpu"], case["recv_cpu"] = send, recv
            print(
                f"{m:9} {size_mb:5g} {mbs[0]:6.0f}/{mbs[1]:6.0f}/{mbs[2]:6.0f}   "
                f"{send[0]:.2f}/{send[1]:.2f}/{send[2]:.2f} ({case['send_user'][1]:.2f}u)   "
                f"{recv[0]:.2f}/{recv[1]:.2f}/{recv[2]:.2f} ({case['recv_user'][1]:.2f}u)"
            )
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
