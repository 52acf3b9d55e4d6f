"""The insert and extract tasks' own CPU time at n -> n partitions of few rows, in one process.

Not a test. Shuffles ``n`` partitions of ``--rows`` rows (``inputs.make_partition``:
``int64`` key, ``float64`` value) ``n -> n`` through the config line
(``dataframe.shuffle.method = "mpshuffle"``, ``df.shuffle("key")``) on Dask's
synchronous scheduler, so every task runs on this thread with mpshuffle's
local runtime: no event loop, no scheduler, no transport between processes.
It reads the thread CPU time of each insert task and each extract task
(``mpshuffle.dask.graph.insert`` / ``extract``, wrapped), and of the engine's
part of the extract (``Shuffler.extract``, the postbox's pop), then calls the
pandas adapter's ``unpack`` and ``split_for`` again on inputs captured from
the run (``--captured`` of each), alone, ``--repeats`` times each.
Prints min / median / max in milliseconds and writes ``--out`` (JSON) if
given. The first ``--skip`` tasks of each kind (warm-up, the run's first
extract filing every chunk) are left out of the task figures.

Alternate two checkouts for an A/B, one process each (``PYTHONPATH`` first
names the ``src`` to measure)::

    for src in /a/src /b/src /a/src /b/src; do
        PYTHONPATH=$src python benchmarks/task_cost.py --partitions 2000
    done
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from typing import Any

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd

import mpshuffle
import mpshuffle.dask
from mpshuffle.dask import graph
from mpshuffle.shuffler.host import Shuffler
from mpshuffle.table.pandas import PandasAdapter

try:  # run as a script (benchmarks/ on the path) or as benchmarks.task_cost
    import inputs
except ImportError:
    from benchmarks import inputs


def _ms(xs: list[float]) -> dict[str, float]:
    return {"min": float(np.min(xs)) * 1e3, "median": float(np.median(xs)) * 1e3, "max": float(np.max(xs)) * 1e3}


def measure(n: int, rows: int, captured: int, repeats: int, skip: int) -> dict[str, Any]:
    """One shuffle of ``n -> n`` partitions; the tasks' and the adapter calls' thread CPU (see the module docstring)."""
    times: dict[str, list[float]] = {"insert": [], "extract": [], "pop": []}
    unpacks: list[tuple[Any, ...]] = []
    splits: list[tuple[Any, ...]] = []
    unpack, split_for = PandasAdapter.unpack, PandasAdapter.split_for
    insert, extract, pop = graph.insert, graph.extract, Shuffler.extract

    def timed(name: str, func: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            t = time.thread_time()
            try:
                return func(*args, **kwargs)
            finally:
                times[name].append(time.thread_time() - t)
        return run

    def capture_unpack(self: PandasAdapter, pieces: Any, meta: Any, *args: Any, **kwargs: Any) -> Any:
        if len(unpacks) < captured:
            unpacks.append((self, pieces, meta, args, kwargs))
        return unpack(self, pieces, meta, *args, **kwargs)

    def capture_split(self: PandasAdapter, frame: Any, *args: Any, **kwargs: Any) -> Any:
        if len(splits) < captured:
            splits.append((self, frame, args, kwargs))
        return split_for(self, frame, *args, **kwargs)

    graph.insert, graph.extract = timed("insert", insert), timed("extract", extract)  # type: ignore[assignment]
    Shuffler.extract = timed("pop", pop)  # type: ignore[method-assign]
    PandasAdapter.unpack, PandasAdapter.split_for = capture_unpack, capture_split  # type: ignore[method-assign]
    try:
        with dask.config.set({"dataframe.shuffle.method": "mpshuffle", "scheduler": "sync"}):
            frame = dd.from_map(inputs.make_partition, range(n), rows=rows)
            out = frame.shuffle("key").compute()
    finally:
        graph.insert, graph.extract, Shuffler.extract = insert, extract, pop  # type: ignore[method-assign]
        PandasAdapter.unpack, PandasAdapter.split_for = unpack, split_for  # type: ignore[method-assign]
    if len(out) != n * rows:
        raise AssertionError(f"{len(out)} rows out, {n * rows} in")
    alone: dict[str, list[float]] = {"unpack": [], "split_for": []}
    for _ in range(repeats):
        for self, pieces, meta, args, kwargs in unpacks:
            t = time.thread_time()
            unpack(self, pieces, meta, *args, **kwargs)
            alone["unpack"].append(time.thread_time() - t)
        for self, frame, args, kwargs in splits:
            kwargs = {**kwargs, "pool": None}  # the run's pool is closed
            t = time.thread_time()
            split_for(self, frame, *args, **kwargs)
            alone["split_for"].append(time.thread_time() - t)
    return {
        "partitions": n, "rows_per_partition": rows,
        "pieces_per_extract": float(np.mean([len(u[1]) for u in unpacks])) if unpacks else 0.0,
        **{f"{k}_ms": _ms(v[skip:]) for k, v in times.items()},
        **{f"{k}_alone_ms": _ms(v) for k, v in alone.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--partitions", type=int, default=2000)
    parser.add_argument("--rows", type=int, default=500)
    parser.add_argument("--captured", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip", type=int, default=100)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    measure(min(args.partitions, 50), args.rows, 1, 1, 0)  # warm-up: kernels, imports
    result = measure(args.partitions, args.rows, args.captured, args.repeats, args.skip)
    result.update(
        src=os.path.dirname(os.path.dirname(mpshuffle.__file__)), load_average=os.getloadavg()[0],
        versions={"mpshuffle": getattr(mpshuffle, "__version__", "?"), "dask": dask.__version__,
                  "pandas": pd.__version__, "python": platform.python_version()},
    )
    for key in ("insert_ms", "extract_ms", "pop_ms", "unpack_alone_ms", "split_for_alone_ms"):
        r = result[key]
        print(f"{key[:-3]:16s} {r['min']:.3f} / {r['median']:.3f} / {r['max']:.3f} ms", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
