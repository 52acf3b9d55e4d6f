"""Reading spilled ranges back: mapped (``SpillDirectory.map_ranges``) against read (``read_ranges``), by range size.

Not a test. Sizes :data:`mpshuffle.memory.store.MAP_MIN_BYTES`. One spill
file of ``--mb`` MB of ranges of each size (written once, so read from the
page cache, as an extract mostly does), read back in a random order in
batches of 1000 ranges (an extract's pop), each range copied once into a
destination (as the extract copies a piece into its output). A second
thread of the process keeps the other core busy in NumPy without the GIL,
as a worker's event loop and progress thread do: ``munmap`` of a mapping
then has to interrupt that core (TLB shootdown), which a process with one
running thread never pays. Seconds are wall time; CPU seconds are the
reading thread's own (``RUSAGE_THREAD``). Methods alternate, ``--repeat``
rounds; min / median / max printed and written as JSON (``--out``).

Run: ``python benchmarks/spill_read_paths.py [--mb 300] [--sizes 20480,65536,204800,524288,1048576]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import threading
import time

import numpy as np

from mpshuffle.memory.spill import SpillDirectory


def _thread_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_THREAD)
    return r.ru_utime + r.ru_stime


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=float, default=300)
    p.add_argument("--sizes", default="20480,65536,204800,524288,1048576")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--out", default="")
    a = p.parse_args()
    stop = threading.Event()
    x = np.random.default_rng(0).random(1 << 18)
    y = np.empty_like(x)

    def busy() -> None:
        while not stop.is_set():
            np.multiply(x, 1.0001, out=y)

    spinner = threading.Thread(target=busy, daemon=True)
    spinner.start()
    rows = []
    try:
        for size in (int(s) for s in a.sizes.split(",")):
            n = max(1, int(a.mb * 1e6 / size))
            with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
                d = SpillDirectory(os.path.join(tmp, "spill"))
                record = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
                offsets = [d.append([record])[0] for _ in range(n)]
                order = np.random.default_rng(2).permutation(n).tolist()
                ranges = [(offsets[i], size) for i in order]
                out = np.empty(size, np.uint8)
                for rnd in range(a.repeat):
                    for method in ("map", "read") if rnd % 2 == 0 else ("read", "map"):
                        c0, t0 = _thread_cpu(), time.perf_counter()
                        for k in range(0, n, 1000):
                            batch = ranges[k : k + 1000]
                            if method == "map":
                                views = d.map_ranges(batch)
                                if views is None:
                                    raise SystemExit("this system cannot map the spill file")
                                for buf, at in views:
                                    out[:] = buf[at : at + size]
                                del views, buf
                            else:
                                whole, positions = d.read_ranges(batch)
                                for at in positions:
                                    out[:] = whole[at : at + size]
                                del whole
                        row = {"size": size, "ranges": n, "method": method, "round": rnd,
                               "seconds": time.perf_counter() - t0, "thread_cpu_seconds": _thread_cpu() - c0}
                        rows.append(row)
                        print(f"{size:9d} B x {n:6d} {method:4s} {row['seconds']:6.3f} s  "
                              f"cpu {row['thread_cpu_seconds']:6.3f} s", flush=True)
                d.remove()
    finally:
        stop.set()
        spinner.join()
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for r in rows:
        summary.setdefault(str(r["size"]), {}).setdefault(r["method"], {"seconds": [], "cpu": []})  # type: ignore[arg-type]
        summary[str(r["size"])][r["method"]]["seconds"].append(r["seconds"])  # type: ignore[attr-defined]
        summary[str(r["size"])][r["method"]]["cpu"].append(r["thread_cpu_seconds"])  # type: ignore[attr-defined]
    table = {
        size: {m: {k: [min(v), statistics.median(v), max(v)] for k, v in d.items()} for m, d in by.items()}
        for size, by in summary.items()
    }
    print(json.dumps(table, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "rows": rows, "min_median_max": table, "python": sys.version.split()[0],
                       "machine": platform.platform(), "cpus": os.cpu_count()}, f, indent=1)


if __name__ == "__main__":
    main()
