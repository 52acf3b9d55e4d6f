"""What one worker's half of a time-to-space rechunk costs by three ways of getting the peer's cuts in.

Not a test, and not mpshuffle's code path: a model of it with the same
shapes, to size the step that would change the transport. Two processes,
the *receiver* (measured) and its *peer*, each holding ``--t`` input blocks
of ``(S, S)`` float32 (one time step each, ``--side`` S). The receiver
assembles the output partitions it owns (half of ``--parts``): each is a
``(blocks, 2 * t, S/parts, S/parts)`` array, every output block a pixel
column of all ``2 * t`` time steps; step ``2i`` comes from its own block
``i``, step ``2i + 1`` from the peer's. Every cut lands as runs of
``S/parts`` elements (200 bytes at the defaults), as in
``rechunk_bench.py``'s time-to-space case.

* ``shm`` (what mpshuffle does on one host): the peer writes each of its
  cuts' byte ranges (one partition's rows of one block: contiguous) into a
  fresh ``/dev/shm`` file with ``pwritev``; the receiver opens, unlinks and
  maps each file, copies it into its output (fresh pages, ``MADV_POPULATE_WRITE``),
  then gives the file's pages back (``MADV_REMOVE``), as an extract does.
* ``place``: each output partition is a ``/dev/shm`` file both processes
  map; the peer writes its cuts straight into it, the receiver its own.
  One copy per byte, no transport pages.
* ``vmread``: the receiver reads the peer's cuts out of the peer's memory
  with ``process_vm_readv`` (one call per cut range, one local run per 200
  bytes). One copy per byte, no transport pages; nothing for the peer to do.

Both processes' CPU seconds are summed (user + system, ``getrusage``).
Variants are alternated, each run after ``--rest`` seconds, ``--repeat``
rounds; min / median / max printed and written as JSON (``--out``).

Run: ``python benchmarks/rechunk_receive_paths.py [--t 200] [--side 1000] [--parts 20] [--repeat 4]``
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import resource
import statistics
import sys
import time
from typing import Any

import numpy as np

from mpshuffle.memory._pages import populate_write, small_page_empty

MADV_REMOVE = 9


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _libc() -> Any:
    lib = ctypes.CDLL(None, use_errno=True)
    lib.process_vm_readv.restype = ctypes.c_ssize_t
    lib.process_vm_readv.argtypes = [
        ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong,
    ]
    return lib


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _send(fd: int, data: bytes) -> None:
    os.write(fd, len(data).to_bytes(8, "little") + data)


def _recv(fd: int) -> bytes:
    def exactly(n: int) -> bytes:
        out = b""
        while len(out) < n:
            got = os.read(fd, n - len(out))
            if not got:
                raise EOFError("the peer process ended")
            out += got
        return out

    return exactly(int.from_bytes(exactly(8), "little"))


def _peer(a: argparse.Namespace, cmd: int, reply: int) -> None:
    """The peer's loop: hold its blocks, write what the receiver asks for, report its CPU."""
    side, parts = a.side, a.parts
    rows = side // parts
    blocks = [np.random.default_rng(t).random((side, side), dtype=np.float32) for t in range(a.t)]
    _send(reply, json.dumps([b.ctypes.data for b in blocks]).encode())
    while True:
        msg = json.loads(_recv(cmd))
        c0 = _cpu()
        if msg["op"] == "quit":
            os._exit(0)
        if msg["op"] == "shm":
            for t, b in enumerate(blocks):
                for p in msg["parts"]:
                    fd = os.open(f"{a.dir}/rrp-{os.getppid()}-{t}-{p}", os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
                    os.pwritev(fd, [memoryview(b[p * rows : (p + 1) * rows]).cast("B")], 0)
                    os.close(fd)
        elif msg["op"] == "place":
            for p, path in zip(msg["parts"], msg["paths"], strict=True):
                fd = os.open(path, os.O_RDWR)
                size = os.fstat(fd).st_size
                m = mmap.mmap(fd, size)
                os.close(fd)
                out = np.frombuffer(m, np.float32).reshape(parts, 2 * a.t, rows, rows)
                for t, b in enumerate(blocks):
                    out[:, 2 * t + 1] = b[p * rows : (p + 1) * rows].reshape(rows, parts, rows).transpose(1, 0, 2)
                del out
                m.close()
        _send(reply, json.dumps(_cpu() - c0).encode())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--t", type=int, default=200, help="input blocks per process")
    p.add_argument("--side", type=int, default=1000)
    p.add_argument("--parts", type=int, default=20, help="output partitions of both processes")
    p.add_argument("--repeat", type=int, default=4)
    p.add_argument("--rest", type=float, default=0.3, help="seconds between runs")
    p.add_argument("--dir", default="/dev/shm")
    p.add_argument("--out", default="")
    a = p.parse_args()
    side, parts = a.side, a.parts
    rows = side // parts
    mine = list(range(0, parts, 2))  # the receiver owns every other partition
    cmd_r, cmd_w = os.pipe()
    rep_r, rep_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        _peer(a, cmd_r, rep_w)
    libc = _libc()
    remote = json.loads(_recv(rep_r))
    blocks = [np.random.default_rng(10_000 + t).random((side, side), dtype=np.float32) for t in range(a.t)]
    shape = (parts, 2 * a.t, rows, rows)
    nbytes = 4 * int(np.prod(shape))

    def own(out: np.ndarray, p: int) -> None:
        for t, b in enumerate(blocks):
            out[:, 2 * t] = b[p * rows : (p + 1) * rows].reshape(rows, parts, rows).transpose(1, 0, 2)

    def shm() -> tuple[list[Any], float]:
        _send(cmd_w, json.dumps({"op": "shm", "parts": mine}).encode())
        peer = json.loads(_recv(rep_r))
        outs = []
        for p in mine:
            out = small_page_empty(nbytes).view(np.float32).reshape(shape)
            own(out, p)
            for t in range(a.t):
                path = f"{a.dir}/rrp-{os.getpid()}-{t}-{p}"
                fd = os.open(path, os.O_RDWR)
                os.unlink(path)
                m = mmap.mmap(fd, rows * side * 4)
                os.close(fd)
                cut = np.frombuffer(m, np.float32).reshape(rows, parts, rows)
                out[:, 2 * t + 1] = cut.transpose(1, 0, 2)
                del cut
                m.madvise(MADV_REMOVE)
                m.close()
            outs.append(out)
        return outs, peer

    def place() -> tuple[list[Any], float]:
        outs, paths = [], []
        for p in mine:
            path = f"{a.dir}/rrp-out-{os.getpid()}-{p}"
            fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
            os.ftruncate(fd, nbytes)
            m = mmap.mmap(fd, nbytes)
            os.close(fd)
            raw = np.frombuffer(m, np.uint8)
            populate_write(raw)
            outs.append(raw.view(np.float32).reshape(shape))
            paths.append(path)
        _send(cmd_w, json.dumps({"op": "place", "parts": mine, "paths": paths}).encode())
        for out, p in zip(outs, mine, strict=True):
            own(out, p)
        peer = json.loads(_recv(rep_r))
        for path in paths:
            os.unlink(path)
        return outs, peer

    def vmread() -> tuple[list[Any], float]:
        outs = []
        local = (_IoVec * (rows * parts))()
        far = (_IoVec * 1)()
        for p in mine:
            out = small_page_empty(nbytes).view(np.float32).reshape(shape)
            own(out, p)
            base = out.ctypes.data
            for t in range(a.t):
                k = 0
                for y in range(rows):
                    for b in range(parts):
                        local[k].base = base + (((b * 2 * a.t) + 2 * t + 1) * rows + y) * rows * 4
                        local[k].len = rows * 4
                        k += 1
                far[0].base = remote[t] + p * rows * side * 4
                far[0].len = rows * side * 4
                if libc.process_vm_readv(pid, local, k, far, 1, 0) != rows * side * 4:
                    raise OSError(ctypes.get_errno(), "process_vm_readv failed")
            outs.append(out)
        return outs, 0.0

    variants = {"shm": shm, "place": place, "vmread": vmread}
    names = list(variants)
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    reference = None
    for rnd in range(a.repeat):
        for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
            time.sleep(a.rest)
            c0, t0 = _cpu(), time.perf_counter()
            outs, peer = variants[name]()
            wall, cpu = time.perf_counter() - t0, _cpu() - c0
            digest = [float(o[:, :, 0, 0].sum()) for o in outs]
            if reference is None:
                reference = digest
            elif digest != reference:
                raise AssertionError(f"{name} assembled different output")
            del outs
            runs[name].append({"seconds": wall, "cpu_receiver": cpu, "cpu_peer": peer, "cpu_total": cpu + peer})
            print(f"round {rnd} {name:7s} {wall:6.3f} s  cpu receiver {cpu:6.3f} + peer {peer:6.3f}", flush=True)
    _send(cmd_w, json.dumps({"op": "quit"}).encode())
    os.waitpid(pid, 0)
    summary = {
        n: {k: {"min": min(r[k] for r in rs), "median": statistics.median(r[k] for r in rs), "max": max(r[k] for r in rs)}
            for k in ("seconds", "cpu_total")}
        for n, rs in runs.items()
    }
    result = {
        "args": vars(a), "bytes_per_variant": nbytes * len(mine), "runs": runs, "summary": summary,
        "python": sys.version.split()[0], "numpy": np.__version__,
    }
    print(json.dumps(summary, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
