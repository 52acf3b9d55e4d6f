"""The engine's stages alone (no Dask, no transport): CPU-seconds per GB, next to a memcpy floor.

Not a test. One process shuffles nothing: it builds the benchmark's input
partition (``mpshuffle.bench.make_synthetic``: int64 key, two float64, an
11-character ``str``; 800,000 rows, about 35 MB in memory by default) and
times each stage of the insert and the extract on it, ``--repeats`` times:

* ``memcpy warm`` / ``memcpy fresh``: copying the partition's size of bytes
  into a buffer allocated once / allocated for each copy (the second pays the
  page faults of fresh memory): the floor a stage is compared with;
* ``hash``: key column -> partition ids, ranks and counts (the fused pass);
* ``to buffers``: the frame's columns as buffers (``Schema.from_pandas`` and
  pointing at the column memory);
* ``scatter+pack``: every column scattered once into the pieces' buffer,
  piece metadata included (there is no separate pack: pieces are slices);
* ``insert``: the adapter's whole ``split`` (the three above), in fresh memory;
* ``insert pooled``: the same through ``split_for`` with a
  :class:`~mpshuffle.memory.pool.HostPool` (rank 0 of 2) that keeps every
  block, its pieces dropped at once: all memory reused, the best case (a
  worker reuses the sent pieces' block at once, the kept pieces' blocks only
  after their extract);
* ``read pieces``: rebuilding the pieces as zero-copy Arrow tables;
* ``extract``: the adapter's whole ``unpack`` of the ``--partitions`` pieces
  as one output partition (concatenate, ``to_pandas``, cast to the meta).

Each figure is CPU time of the process (user + system, all threads, from
``getrusage``) divided by the partition's in-memory size in GB; min, median
and max over the repeats, and the median of system time alone. The data is
the same for every repeat. Run it pinned to one core for steadier figures::

    taskset -c 1 python benchmarks/stage_bench.py [--rows 800000] [--repeats 7]

``--pool`` picks pyarrow's memory pool (``default`` keeps pyarrow's own);
``--json PATH`` writes the figures too.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa

from mpshuffle.demo.bench import make_synthetic
from mpshuffle.memory.pool import HostPool
from mpshuffle.table import PandasAdapter
from mpshuffle.table import _columns as columns


def _cpu() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_stime


def measure(fn: Callable[[], Any], gb: float, repeats: int) -> dict[str, float]:
    """CPU-s/GB of ``fn`` (min, median, max over ``repeats``), median system share and wall."""
    fn()  # compiled kernels loaded, first-use allocations made
    cpu, sys_, wall = [], [], []
    for _ in range(repeats):
        c0, s0 = _cpu()
        t0 = time.perf_counter()
        fn()
        wall.append(time.perf_counter() - t0)
        c1, s1 = _cpu()
        cpu.append((c1 - c0) / gb)
        sys_.append((s1 - s0) / gb)
    cpu.sort()
    return {
        "min": cpu[0], "median": cpu[len(cpu) // 2], "max": cpu[-1],
        "sys_median": sorted(sys_)[len(sys_) // 2], "wall_median_s": sorted(wall)[len(wall) // 2],
    }


def run(rows: int, partitions: int, repeats: int) -> dict[str, Any]:
    """Measure every stage on one synthetic partition; return the figures by stage."""
    frame = make_synthetic(0, rows, max(rows // 4, 1))
    nbytes = int(frame.memory_usage(deep=True, index=True).sum())
    gb = nbytes / 1e9
    adapter = PandasAdapter()
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    schema = pa.Schema.from_pandas(frame, preserve_index=False)
    cols = columns.pandas_columns(frame, False, schema)
    split = columns.hash_ids([cols[0]], partitions, len(frame))
    pieces = list(adapter.split(frame, ["key"], partitions).values())
    meta = frame.iloc[:0]
    # Enough blocks per size class for a whole insert's pieces: the steady
    # state of a worker whose pool serves every piece from reused memory.
    pool = HostPool(4 * nbytes, per_class=4 * partitions)
    stages: dict[str, Callable[[], Any]] = {
        "memcpy warm": lambda: np.copyto(dst, src),
        "memcpy fresh": lambda: src.copy(),
        "hash": lambda: columns.hash_ids([cols[0]], partitions, len(frame)),
        "to buffers": lambda: columns.pandas_columns(
            frame, False, pa.Schema.from_pandas(frame, preserve_index=False)
        ),
        "scatter+pack": lambda: columns.pack(cols, split, schema),
        "insert": lambda: adapter.split(frame, ["key"], partitions),
        "insert pooled": lambda: adapter.split_for(
            frame, ["key"], partitions, rank=0, nranks=2, pool=pool
        ),
        "read pieces": lambda: [columns.read_piece(p) for p in pieces],
        "extract": lambda: adapter.unpack(pieces, meta),
    }
    return {
        "bytes": nbytes, "rows": rows, "partitions": partitions, "repeats": repeats,
        "pyarrow_pool": pa.default_memory_pool().backend_name,
        "stages": {name: measure(fn, gb, repeats) for name, fn in stages.items()},
    }


def report(result: dict[str, Any]) -> str:
    """The figures as a text table."""
    head = (
        f"{result['rows']} rows, {result['bytes'] / 1e6:.1f} MB, {result['partitions']} pieces, "
        f"{result['repeats']} repeats, pyarrow pool {result['pyarrow_pool']}; CPU-s/GB\n"
        f"{'stage':<14} {'min':>7} {'median':>7} {'max':>7} {'sys med':>8}"
    )
    lines = [head]
    for name, s in result["stages"].items():
        lines.append(
            f"{name:<14} {s['min']:7.3f} {s['median']:7.3f} {s['max']:7.3f} {s['sys_median']:8.3f}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=800_000, help="rows of the partition")
    parser.add_argument("--partitions", type=int, default=60, help="output partitions")
    parser.add_argument("--repeats", type=int, default=7, help="repeats per stage (>= 5)")
    parser.add_argument("--pool", choices=["default", "system", "jemalloc", "mimalloc"],
                        default="default", help="pyarrow memory pool")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    if args.repeats < 5:
        parser.error("--repeats must be >= 5")
    if args.pool != "default":
        pa.set_memory_pool(getattr(pa, f"{args.pool}_memory_pool")())
    result = run(args.rows, args.partitions, args.repeats)
    result["machine"] = {"python": platform.python_version(), "pyarrow": pa.__version__,
                         "numpy": np.__version__, "processor": platform.processor()}
    print(report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
