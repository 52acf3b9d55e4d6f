"""Device buffers between two GPUs: UCXX (cuda_ipc over NVLink) next to NCCL, same run.

Two processes, one per GPU (``CUDA_VISIBLE_DEVICES`` set by the launcher).
Rank 1 listens with ``ucxx.create_listener``, rank 0 connects. For each size,
both ranks at once send ``nbytes`` of a CuPy buffer to the other and receive
as much (what a 2-rank all-to-all moves between the GPUs); then the same
exchange with one grouped NCCL send/recv (CuPy's NCCL bindings, the unique id
sent over the UCXX endpoint). Seconds: from a barrier (a 1-byte ping-pong)
until both directions are done and the device is synchronized, best of
``--reps``. GB/s per GPU = bytes sent by that GPU / seconds. The received
bytes are checked against the sender's pattern.

This decides the device transport: mpshuffle uses NCCL; UCXX is measured here
only (it is not a dependency).

Run: ``python benchmarks/gpu_ucxx_bench.py --gb 1 4 --reps 3`` (launches both ranks).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any


async def _rank(rank: int, port: int, sizes: list[int], reps: int) -> list[dict[str, Any]]:
    import cupy as cp
    import numpy as np
    import ucxx
    from cupy.cuda import nccl

    ready: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    if rank == 1:
        async def on_connect(ep: Any) -> None:
            ready.set_result(ep)

        listener = ucxx.create_listener(on_connect, port)
        ep = await ready
    else:
        listener = None
        for _ in range(200):
            try:
                ep = await ucxx.create_endpoint("127.0.0.1", port)
                break
            except Exception:  # noqa: BLE001 - the listener may not be up yet
                await asyncio.sleep(0.05)
        else:
            raise RuntimeError(f"rank 0 could not connect to port {port}")

    ping = np.zeros(1, np.uint8)

    async def barrier() -> None:
        if rank == 0:
            await ep.send(ping)
            await ep.recv(ping)
        else:
            await ep.recv(ping)
            await ep.send(ping)

    # NCCL communicator: the unique id travels over the endpoint (128 bytes;
    # CuPy gives bytes, older CuPy a tuple of ints).
    if rank == 0:
        raw = nccl.get_unique_id()
        uid = np.frombuffer(raw, np.uint8).copy() if isinstance(raw, bytes) else np.array(raw, np.int8).view(np.uint8)
        await ep.send(uid)
        uid_arg = raw
    else:
        uid = np.zeros(128, np.uint8)
        await ep.recv(uid)
        raw0 = nccl.get_unique_id()
        uid_arg = uid.tobytes() if isinstance(raw0, bytes) else tuple(int(x) for x in uid.view(np.int8))
    comm = nccl.NcclCommunicator(2, uid_arg, rank)

    rows = []
    for nbytes in sizes:
        send = cp.full(nbytes, rank + 1, dtype=cp.uint8)
        recv = cp.empty(nbytes, dtype=cp.uint8)
        cp.cuda.Device().synchronize()
        for method in ("ucxx", "nccl"):
            secs, ok = [], []
            for _ in range(reps):
                recv.fill(0)
                cp.cuda.Device().synchronize()
                await barrier()
                t0 = time.perf_counter()
                if method == "ucxx":
                    await asyncio.gather(ep.send(send), ep.recv(recv))
                else:
                    stream = cp.cuda.get_current_stream().ptr
                    nccl.groupStart()
                    comm.send(send.data.ptr, nbytes, nccl.NCCL_UINT8, 1 - rank, stream)
                    comm.recv(recv.data.ptr, nbytes, nccl.NCCL_UINT8, 1 - rank, stream)
                    nccl.groupEnd()
                cp.cuda.Device().synchronize()
                secs.append(time.perf_counter() - t0)
                ok.append(bool((recv == (2 - rank)).all()))  # every repetition's bytes checked
            rows.append({"rank": rank, "method": method, "bytes": nbytes, "seconds": secs,
                         "gbps_best": nbytes / min(secs) / 1e9, "correct": ok})
        del send, recv
    await barrier()
    comm.destroy()
    await ep.close()
    if listener is not None:
        listener.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gb", type=float, nargs="+", default=[1.0, 4.0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--port", type=int, default=13571)
    ap.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    sizes = [int(g * 1e9) for g in args.gb]
    if args.rank >= 0:
        rows = asyncio.run(_rank(args.rank, args.port, sizes, args.reps))
        print("ROWS", json.dumps(rows), flush=True)
        return
    procs = []
    for r in (1, 0):
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(r), NCCL_NVLS_ENABLE="0")
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "--rank", str(r), "--port", str(args.port), "--reps", str(args.reps),
             "--gb", *map(str, args.gb)], env=env, stdout=subprocess.PIPE, text=True,
        ))
    rows = []
    for p in procs:
        out, _ = p.communicate(timeout=300)
        for line in out.splitlines():
            if line.startswith("ROWS "):
                rows += json.loads(line[5:])
        if p.returncode:
            print(f"rank process exited with {p.returncode}", flush=True)
    for r in sorted(rows, key=lambda r: (r["bytes"], r["method"], r["rank"])):
        print(json.dumps(r), flush=True)
    with open(os.path.join(args.out, "ucxx_bench.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
