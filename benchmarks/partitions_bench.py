"""Many partitions through the config line: mpshuffle, P2P and tasks, sizes swept, slope fitted.

Not a test. For each number of partitions ``n`` (``--sizes``), an input of
``n`` partitions of ``--rows`` rows (``int64`` key, ``float64`` value, made
on the workers by ``dd.from_map`` from :mod:`inputs`, so the task's
function is pickled by reference, not by value) is shuffled ``n -> n`` with plain Dask
code, only the method switched::

    dask.config.set({"dataframe.shuffle.method": method})
    df.shuffle("key")

on one LocalCluster (``--workers`` x 1 thread); method ``floor`` is Dask's
own cost for a graph of that shape doing nothing, ``floor-fused`` the same
with each insert's place inside its input's task, as mpshuffle's inserts
fuse into ``from_map`` (see :func:`_floor_graph`).
Per run: seconds from
submitting until the output is persisted, the peak of the cluster's memory
(the largest sum over the workers of one RSS sample, every 20 ms; also
less their sum before the run, which favours a method that runs after
another has grown the workers), the sum once the output is released
(``retained_bytes``: that less the sum before), the CPU seconds of the workers and of this
process (client and scheduler), and the seconds to build and materialize
the optimized graph on the client. A method whose run took more than
``--max-seconds`` is not run at larger sizes (its slope would only say the
same). The methods take turns within each size. Then, per method, the
least-squares slope of log(seconds) and log(peak) against log(n): ~1 is
linear in the partitions, ~2 grows with input x output.

Writes ``--out`` (JSON, each run appended as it ends) and, with matplotlib,
a PNG next to it.

    python benchmarks/partitions_bench.py --sizes 500 1000 2000 5000 10000
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import threading
import time
from typing import Any

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import psutil
from distributed import Client, LocalCluster, wait

import mpshuffle
import mpshuffle.dask

try:  # run as a script (benchmarks/ on the path) or as benchmarks.partitions_bench
    import inputs
except ImportError:
    from benchmarks import inputs
make_partition = inputs.make_partition


class _Sampler:
    """The largest sum of the processes' RSS over samples every ``interval`` seconds."""

    def __init__(self, pids: list[int], interval: float = 0.02) -> None:
        self.procs = [psutil.Process(p) for p in pids]
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            total = 0
            for p in self.procs:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)
            self._stop.wait(self.interval)

    def __enter__(self) -> _Sampler:  # noqa: PYI034
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _rss(pids: list[int]) -> int:
    return sum(psutil.Process(p).memory_info().rss for p in pids)


def _cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


def _floor_graph(n: int, rows: int, fused: bool = False) -> tuple[dict[Any, Any], list[Any]]:
    """Dask's floor for a shuffle of ``n -> n``: the same shape of graph, moving no data.

    ``n`` input tasks (the same partitions), one task after each (the
    insert's place), one barrier task depending on those, ``n`` output
    tasks depending on the barrier: ``3 n + 1`` tasks, as P2P's graph has.
    With ``fused`` the insert's place is inside the input's task
    (``inputs.placeholder_of_partition``): ``2 n + 1`` tasks, the shape of
    mpshuffle's graph when its inserts fuse into a blockwise input. What it
    costs is what the scheduler and the workers spend on the tasks
    themselves, whatever a shuffle does in them.
    """
    graph: dict[Any, Any] = {}
    for i in range(n):
        if fused:
            graph[("floor-insert", i)] = (inputs.placeholder_of_partition, i, rows)
            continue
        graph[("floor-input", i)] = (make_partition, i, rows)
        graph[("floor-insert", i)] = (inputs.placeholder, ("floor-input", i), i)
    graph["floor-barrier"] = (inputs.placeholder_barrier, *[("floor-insert", i) for i in range(n)])
    keys = [("floor-output", j) for j in range(n)]
    for j, key in enumerate(keys):
        graph[key] = (inputs.placeholder, "floor-barrier", j)
    return graph, keys


def run_once(client: Client, method: str, n: int, rows: int) -> dict[str, Any]:
    """One ``n -> n`` shuffle with ``method`` (or ``floor``, see :func:`_floor_graph`); its figures."""
    pids = list(client.run(os.getpid).values())
    client.run(__import__("gc").collect)
    time.sleep(0.5)
    idle = _rss(pids)
    if method in ("floor", "floor-fused"):
        t0 = time.perf_counter()
        graph, keys = _floor_graph(n, rows, fused=method == "floor-fused")
        graph_seconds = time.perf_counter() - t0
        cpu0, main0 = _cpu(pids), time.process_time()
        with _Sampler(pids) as sampler:
            t1 = time.perf_counter()
            futures = client.get(graph, keys, sync=False)
            wait(futures)
            seconds = time.perf_counter() - t1
        cpu1, main1 = _cpu(pids), time.process_time()
        if sorted(client.gather(futures)) != list(range(n)):
            raise AssertionError(f"floor at {n}: wrong outputs")
        del futures
        return {
            "method": method, "partitions": n, "rows_per_partition": rows, "seconds": seconds,
            "graph_seconds": graph_seconds, "graph_tasks": len(graph),
            "peak_bytes": sampler.peak - idle, "peak_rss_bytes": sampler.peak, "idle_rss_bytes": idle,
            "worker_cpu_seconds": cpu1 - cpu0, "client_scheduler_cpu_seconds": main1 - main0,
            **_after(client, pids, idle),
        }
    with dask.config.set({"dataframe.shuffle.method": method}):
        t0 = time.perf_counter()
        df = dd.from_map(make_partition, range(n), rows=rows)
        out = df.shuffle("key").optimize()
        ntasks = len(out.__dask_graph__())
        graph_seconds = time.perf_counter() - t0
        cpu0, main0 = _cpu(pids), time.process_time()
        with _Sampler(pids) as sampler:
            t1 = time.perf_counter()
            persisted = out.persist()
            wait(persisted)
            seconds = time.perf_counter() - t1
        cpu1, main1 = _cpu(pids), time.process_time()
        nrows = int(persisted.map_partitions(len).sum().compute())
        del persisted, out, df
    if nrows != n * rows:
        raise AssertionError(f"{method} at {n}: {nrows} rows out, {n * rows} in")
    return {
        "method": method, "partitions": n, "rows_per_partition": rows, "seconds": seconds,
        "graph_seconds": graph_seconds, "graph_tasks": ntasks,
        "peak_bytes": sampler.peak - idle, "peak_rss_bytes": sampler.peak, "idle_rss_bytes": idle,
        "worker_cpu_seconds": cpu1 - cpu0,
        "client_scheduler_cpu_seconds": main1 - main0,
        **_after(client, pids, idle),
    }


def _trim() -> int:
    """``malloc_trim(0)`` in this process (glibc); 0 where there is none."""
    import ctypes

    try:
        return int(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return 0


def _after(client: Client, pids: list[int], idle: int) -> dict[str, int]:
    """The workers' RSS once the output is released (and collected): what the run left above idle.

    Also after ``malloc_trim(0)`` on the workers (``retained_trimmed_bytes``):
    the part of what is left that is only the C allocator's free memory,
    not yet given back to the system.
    """
    client.run(__import__("gc").collect)
    time.sleep(1.0)
    after = _rss(pids)
    client.run(_trim)
    time.sleep(0.2)
    trimmed = _rss(pids)
    return {"after_rss_bytes": after, "retained_bytes": after - idle, "retained_trimmed_bytes": trimmed - idle}


def slope(runs: list[dict[str, Any]], key: str) -> float | None:
    """Least-squares slope of log(key) against log(partitions); ``None`` under two sizes."""
    pts = [(math.log(r["partitions"]), math.log(r[key])) for r in runs if r[key] > 0]
    if len({x for x, _ in pts}) < 2:
        return None
    return float(np.polyfit([x for x, _ in pts], [y for _, y in pts], 1)[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[500, 1000, 2000, 5000, 10000])
    parser.add_argument("--rows", type=int, default=500)
    parser.add_argument("--methods", nargs="+", default=["mpshuffle", "p2p", "tasks", "floor"])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--memory-limit", default="8GiB")
    parser.add_argument("--max-seconds", type=float, default=150.0)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "partitions.json"))
    args = parser.parse_args()
    result: dict[str, Any] = {
        "workers": args.workers, "threads_per_worker": 1, "rows_per_partition": args.rows,
        "cpus": os.cpu_count(), "affinity": sorted(os.sched_getaffinity(0)),
        "versions": {"mpshuffle": getattr(mpshuffle, "__version__", "?"), "dask": dask.__version__,
                     "pandas": pd.__version__, "python": platform.python_version()},
        "runs": [],
    }

    def save() -> None:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)

    stopped: dict[str, float] = {}
    with LocalCluster(n_workers=args.workers, threads_per_worker=1, memory_limit=args.memory_limit,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        for method in args.methods:  # warm-up: bootstrap, kernels, P2P's plugin
            run_once(client, method, 8, 100)
        for n in args.sizes:
            for method in args.methods:
                if method in stopped:
                    continue
                load = os.getloadavg()[0]
                r = run_once(client, method, n, args.rows)
                r["load_average"] = load
                result["runs"].append(r)
                print(json.dumps(r), flush=True)
                save()
                if r["seconds"] > args.max_seconds:
                    stopped[method] = r["seconds"]
    result["slopes"] = {
        m: {k: slope([r for r in result["runs"] if r["method"] == m], k)
            for k in ("seconds", "peak_bytes", "peak_rss_bytes", "worker_cpu_seconds", "graph_seconds")}
        for m in args.methods
    }
    result["not_run_past"] = stopped
    save()
    print(json.dumps(result["slopes"], indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for m in args.methods:
        runs = [r for r in result["runs"] if r["method"] == m]
        xs = [r["partitions"] for r in runs]
        axes[0].loglog(xs, [r["seconds"] for r in runs], "o-", label=m)
        axes[1].loglog(xs, [max(r["peak_bytes"], 1) / 2**20 for r in runs], "o-", label=m)
    axes[0].set(xlabel="partitions (in = out)", ylabel="seconds", title="time")
    axes[1].set(xlabel="partitions (in = out)", ylabel="MiB", title="peak memory of the workers")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(os.path.splitext(args.out)[0] + ".png", dpi=100)


if __name__ == "__main__":
    main()
