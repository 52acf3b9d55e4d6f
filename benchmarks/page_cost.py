"""What a first touch of fresh memory costs here, by page size and by how recently the memory was freed.

Not a test. Maps ``--gb`` GB of private anonymous memory, advises it
``MADV_NOHUGEPAGE`` (4 KiB pages) or ``MADV_HUGEPAGE`` (2 MiB transparent
huge pages; the system's THP mode ``madvise`` gives them only to advised
memory, as numpy advises arrays of 4 MiB and more), writes one byte per 4 KiB
and reports the process's system CPU-seconds per GB, in two states:

* ``rested``: after ``--rest`` seconds in which this process holds no
  memory, so the kernel may have done with its free memory whatever it does
  (on a VM with free page reporting, hand it back to the hypervisor);
* ``recycled``: right after unmapping the same amount touched a moment
  before (the kernel's free lists hold pages just used).

Each state and page size ``--repeats`` times, alternated. The kernel's THP
and page-reporting settings are printed with the figures. ``--json PATH``
writes them too.

Run: ``python benchmarks/page_cost.py [--gb 1] [--rest 5] [--repeats 3]`` (Linux only).
"""

from __future__ import annotations

import argparse
import json
import mmap
import resource
import time
from pathlib import Path
from typing import Any

import numpy as np

_SETTINGS = (
    "/sys/kernel/mm/transparent_hugepage/enabled",
    "/sys/kernel/mm/transparent_hugepage/defrag",
    "/sys/module/page_reporting/parameters/page_reporting_order",
)


def _touch(nbytes: int, huge: bool) -> tuple[mmap.mmap, float]:
    """Map, advise and touch ``nbytes``; return the mapping and the system seconds it took."""
    s0 = resource.getrusage(resource.RUSAGE_SELF).ru_stime
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
    a = np.frombuffer(m, np.uint8)
    a[::4096] = 1
    del a
    return m, resource.getrusage(resource.RUSAGE_SELF).ru_stime - s0


def main() -> None:
    """Measure and print system CPU-s/GB per page size and state."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=1.0)
    p.add_argument("--rest", type=float, default=5.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    nbytes = int(args.gb * 2**30)
    settings = {}
    for path in _SETTINGS:
        try:
            settings[path] = Path(path).read_text().strip()
        except OSError:
            settings[path] = None
    print(settings)
    out: dict[str, Any] = {"settings": settings, "args": vars(args), "cpu_s_per_gb": {}}
    for _ in range(args.repeats):
        for huge in (False, True):
            page = "2MiB" if huge else "4KiB"
            time.sleep(args.rest)
            m, rested = _touch(nbytes, huge)
            m.close()
            m, recycled = _touch(nbytes, huge)
            m.close()
            for state, sec in (("rested", rested), ("recycled", recycled)):
                out["cpu_s_per_gb"].setdefault(f"{page} {state}", []).append(sec / args.gb)
            print(f"{page}: rested {rested / args.gb:.2f}, recycled {recycled / args.gb:.2f} system CPU-s/GB",
                  flush=True)
    for k, v in out["cpu_s_per_gb"].items():
        v = sorted(v)
        print(f"{k:14} min {v[0]:.2f} median {v[len(v) // 2]:.2f} max {v[-1]:.2f} CPU-s/GB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
