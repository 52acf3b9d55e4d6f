"""Where a config-line shuffle's wall time goes on each worker: task phases, idle time, thread CPU.

Not a test. One ``LocalCluster`` (``--workers`` x 1 thread), one persisted
input of ``config_line_bench``'s synthetic partitions, one untimed shuffle,
then ``--repeats`` shuffles of each of ``--methods`` in turns (``config``:
``df.shuffle`` with ``dataframe.shuffle.method`` set to ``"mpshuffle"``;
``p2p``, ``tasks``: Dask's own), each persisted. For every shuffle it reads
Dask's task stream (each task's compute start and stop, per worker) and the
CPU time of every worker thread (``/proc/self/task``, user and system apart,
grouped by name: the task thread, the event loop ``MainThread``, mpshuffle's
progress thread, others), and prints:

* the shuffle's wall time and the time at which the last *map-side* task
  (mpshuffle's ``insert``; P2P's ``shuffle-transfer``; tasks' ``split``/
  ``shuffle-group``) ended, so the wall splits into a map phase and the rest;
* per worker, the seconds its task thread computed in each phase and was
  idle (no task computing) before the last map-side task ended and after;
  min / median / max over the workers;
* the CPU-seconds per GB of each thread group over all workers;
* for mpshuffle, each worker's engine timings of the run
  (``mpshuffle.dask.gather_statistics``): time in its inserts, of it waiting
  for the chunks to be taken, waiting for data at extract, and extracting.

Writes ``--out`` (JSON: every shuffle's figures, per worker). With many
workers on one host this shows whether the wall time is the workers' own work
(busy task threads), waiting for the slowest worker's inserts (idle before the
barrier), or work outside the task threads (event loops, progress threads).

Run: ``python benchmarks/worker_timeline.py [--workers 16] [--partitions 120] [--rows 2121212]``
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import dask
from distributed import Client, LocalCluster, get_task_stream, wait

import mpshuffle.dask  # noqa: F401 -- installs the shuffle method

sys.path.insert(0, str(Path(__file__).parent))
from config_line_bench import shuffled, synthetic
from thread_cpu import snapshot

_GROUPS = ("mpshuffle-progress", "Dask-Default-Threads", "MainThread")
# Key prefixes of the map side of each method (the tasks that read input partitions).
_MAP_SIDE = ("mpshuffle-insert", "shuffle-transfer", "split-", "shuffle-group", "shuffle-split")


def _group(name: str) -> str:
    for g in _GROUPS:
        if g in name:
            return g
    return "other"


def _key_name(key: Any) -> str:
    return str(key[0] if isinstance(key, tuple) else key)


def _phases(stream: list[dict[str, Any]], t0: float, t1: float) -> dict[str, Any]:
    """Map-phase end and each worker's busy and idle seconds in and after it, from a task stream."""
    computes: dict[str, list[tuple[float, float, bool]]] = collections.defaultdict(list)
    for task in stream:
        name = _key_name(task["key"])
        is_map = name.startswith(_MAP_SIDE)
        for s in task["startstops"]:
            if s["action"] == "compute":
                computes[task["worker"]].append((s["start"], s["stop"], is_map))
    map_end = max((stop for spans in computes.values() for _, stop, m in spans if m), default=t0)
    per_worker = {}
    for worker, spans in computes.items():
        busy_map = sum(min(stop, map_end) - max(start, t0) for start, stop, _ in spans if start < map_end)
        busy_after = sum(stop - max(start, map_end) for start, stop, _ in spans if stop > map_end)
        per_worker[worker] = {
            "busy_map_phase": busy_map, "idle_map_phase": (map_end - t0) - busy_map,
            "busy_after": busy_after, "idle_after": (t1 - map_end) - busy_after,
            "tasks": len(spans),
        }
    return {"map_end_s": map_end - t0, "workers": per_worker}


def _engine_seconds(client: Client) -> dict[str, dict[str, float]]:
    """Each worker's engine timings of its last finished shuffle (``mpshuffle.dask.gather_statistics``)."""
    from mpshuffle.dask import gather_statistics

    return {w: {k: v for k, v in runs[-1].items() if k.startswith("seconds_")}
            for w, runs in gather_statistics(client).items() if runs}


def _stats(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{min(values):6.2f} {statistics.median(values):6.2f} {max(values):6.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--partitions", type=int, default=60)
    p.add_argument("--rows", type=int, default=800_000)
    p.add_argument("--memory-limit", type=float, default=8.0, help="GiB per worker")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--methods", nargs="+", default=["config"], choices=["config", "function", "p2p", "tasks"])
    p.add_argument("--out", default=str(Path(__file__).with_name("results") / "worker_timeline.json"))
    args = p.parse_args()
    tick = os.sysconf("SC_CLK_TCK")
    runs = []
    with (
        LocalCluster(n_workers=args.workers, threads_per_worker=1, memory_limit=f"{args.memory_limit}GiB",
                     dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        df, on = synthetic(args.partitions, args.rows)
        df = df.persist()
        wait(df)
        gb = client.compute(df.memory_usage(deep=True, index=True).sum()).result() / 1e9
        for method in args.methods:
            wait(shuffled(method, df, on, args.partitions).persist())
        for r in range(args.repeats):
            for method in args.methods:
                before = client.run(snapshot)
                with get_task_stream(client) as ts:
                    t0 = time.time()
                    out = shuffled(method, df, on, args.partitions).persist()
                    wait(out)
                    t1 = time.time()
                after = client.run(snapshot)
                del out
                engine = _engine_seconds(client) if method in ("config", "function") else {}
                cpu: collections.Counter[str] = collections.Counter()
                for w, threads in after.items():
                    for tid, (name, user, system) in threads.items():
                        _, u0, s0 = before[w].get(tid, (name, 0, 0))
                        cpu[f"{_group(name)} user"] += (user - u0) / tick / gb
                        cpu[f"{_group(name)} sys"] += (system - s0) / tick / gb
                phases = _phases(ts.data, t0, t1)
                run = {"method": method, "round": r, "seconds": t1 - t0, "mb_per_s": gb * 1e3 / (t1 - t0),
                       "cpu_s_per_gb": dict(cpu), "load_average_1min": os.getloadavg()[0], **phases,
                       "engine_seconds": engine}
                runs.append(run)
                ws = list(phases["workers"].values())
                print(f"{method:8s} round {r}: {run['seconds']:.2f} s ({run['mb_per_s']:.0f} MB/s), map side ends at "
                      f"{phases['map_end_s']:.2f} s; CPU-s/GB "
                      + ", ".join(f"{k} {v:.2f}" for k, v in sorted(cpu.items()) if v >= 0.01), flush=True)
                for field in ("busy_map_phase", "idle_map_phase", "busy_after", "idle_after"):
                    print(f"    per worker {field:15s} min/med/max {_stats([w[field] for w in ws])}")
                for field in ("seconds_insert", "seconds_insert_wait", "seconds_wait", "seconds_extract"):
                    if engine:
                        print(f"    per worker {field:19s} min/med/max {_stats([w[field] for w in engine.values()])}")
                time.sleep(1)
    Path(args.out).write_text(json.dumps({"args": vars(args), "gb": gb, "versions": {
        "dask": dask.__version__, "python": sys.version.split()[0]}, "runs": runs}, indent=1))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
