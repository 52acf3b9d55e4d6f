"""Device-to-host and host-to-device copy speed by kind of host memory, on one GPU.

What a device spill's copy to host costs, and what page-locked memory would
change (results: ``benchmarks/results/gpu/README.md``): a copy of ``--gb`` GB
of a CuPy buffer

- ``get_fresh``: ``get()`` into fresh pageable memory (what a device spill does);
- ``prefault_{1,8}threads``: touching fresh pageable memory first, with 1 or
  8 threads; then ``get_into_prefaulted_k`` and ``h2d_from_pageable_k``;
- ``pinned_alloc_fresh``, ``get_into_pinned``, ``h2d_from_pinned``: a
  page-locked block from CuPy (``cudaHostAlloc``), the copies into and out of it;
- ``host_register_fresh``, ``get_into_registered``: pinning fresh pageable
  memory with ``cudaHostRegister``, then the copy.

Every copy is checked after its timing: the sum of the data as ``uint64``
(modulo 2^64) on both sides must agree. Prints GB/s and seconds (one run each).

Run: ``python benchmarks/gpu_copy_bench.py --gb 4.29``.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gb", type=float, default=4.29)
    args = ap.parse_args()
    import cupy as cp
    import numpy as np

    n = int(args.gb * 1e9) // 8 * 8
    d = cp.random.randint(0, 2**62, n // 8, dtype=cp.int64).view(cp.uint8)
    want = int(d.view(cp.uint64).sum(dtype=cp.uint64))
    sync = cp.cuda.Device().synchronize

    def timed(f: Any) -> tuple[float, Any]:
        sync()
        t0 = time.perf_counter()
        r = f()
        sync()
        return time.perf_counter() - t0, r

    def check(what: str, a: Any) -> None:
        got = int(a.view(np.uint64).sum(dtype=np.uint64)) if isinstance(a, np.ndarray) else int(
            a.view(cp.uint64).sum(dtype=cp.uint64))
        if got != want:
            raise SystemExit(f"{what}: the copied bytes differ from the source")

    res: dict[str, float] = {}
    res["get_fresh"], a = timed(lambda: d.get())
    check("get_fresh", a)
    del a

    def prefault(k: int) -> Any:
        a = np.empty(n, np.uint8)
        step = n // k
        ths = [threading.Thread(target=lambda i=i: a[i * step : n if i == k - 1 else (i + 1) * step].fill(0))
               for i in range(k)]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        return a

    for k in (1, 8):
        res[f"prefault_{k}threads"], a = timed(lambda k=k: prefault(k))
        res[f"get_into_prefaulted_{k}"], _ = timed(lambda a=a: d.get(out=a))
        check("get_into_prefaulted", a)
        res[f"h2d_from_pageable_{k}"], back = timed(lambda a=a: cp.asarray(a))
        check("h2d_from_pageable", back)
        del a, back
    res["pinned_alloc_fresh"], m = timed(lambda: cp.cuda.PinnedMemoryPointer(cp.cuda.PinnedMemory(n), 0))
    a = np.frombuffer(m, np.uint8, n)
    res["get_into_pinned"], _ = timed(lambda: d.get(out=a))
    check("get_into_pinned", a)
    dd = cp.empty(n, cp.uint8)
    res["h2d_from_pinned"], _ = timed(lambda: dd.set(a))
    check("h2d_from_pinned", dd)
    del a, m
    dd = None
    a = np.empty(n, np.uint8)
    res["host_register_fresh"], _ = timed(lambda: cp.cuda.runtime.hostRegister(a.ctypes.data, n, 0))
    res["get_into_registered"], _ = timed(lambda: d.get(out=a))
    check("get_into_registered", a)
    cp.cuda.runtime.hostUnregister(a.ctypes.data)
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        thp = f.read().strip()
    print(json.dumps({"bytes": n, "transparent_hugepage": thp, "correct": True,
                      "gbps": {k: round(n / 1e9 / v, 2) for k, v in res.items() if v > 0},
                      "seconds": {k: round(v, 4) for k, v in res.items()}}))


if __name__ == "__main__":
    main()
