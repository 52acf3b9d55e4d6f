"""``rechunk_bench.py`` with another output partition size (``rechunk.PARTITION_BYTES``), to try it.

Not a test. The graph is built in this process (the client), so the module
constant set here decides the partitions of every mpshuffle rechunk the
benchmark runs. Run: ``python benchmarks/rechunk_partition_bytes.py MIB [rechunk_bench.py arguments]``.
"""

from __future__ import annotations

import os
import runpy
import sys

from mpshuffle.dask import rechunk

if __name__ == "__main__":
    rechunk.PARTITION_BYTES = int(float(sys.argv[1]) * 2**20)
    sys.argv = [os.path.join(os.path.dirname(__file__), "rechunk_bench.py"), *sys.argv[2:]]
    runpy.run_path(sys.argv[0], run_name="__main__")
