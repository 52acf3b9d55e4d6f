"""Where a many-partition shuffle's memory is, at its peak and after it: per worker, through the config line.

Not a test. One ``LocalCluster`` (``--workers`` x 1 thread), one warm-up
shuffle of 8 partitions, then ``--repeats`` shuffles ``n -> n``
(``--partitions`` input partitions of ``--rows`` rows made by
``inputs.make_partition``, ``df.shuffle("key")`` with
``dataframe.shuffle.method`` set to ``"mpshuffle"``, persisted, counted,
released), as ``partitions_bench.py`` runs them. A thread in every worker
samples every ``--interval`` seconds its RSS (``RssAnon``, ``RssFile``,
``RssShmem``), glibc's heap (``mallinfo2``), the bytes Dask holds
(``WorkerState.nbytes``), mpshuffle's host bytes (reserved in its
``BufferResource``: the postbox's chunks and the pool's idle blocks), how
many partitions it has extracted, and with ``--tracemalloc`` the bytes
``tracemalloc`` traces (Python objects and NumPy's data); at every new high
of the traced bytes (10 % above the last) it keeps the top lines of a
snapshot, so the last kept is near the peak. After each run and
``gc.collect``: every worker's RSS parts, the heap, what the run left
(with ``--tracemalloc``: the top lines of a snapshot against one taken
before the run), then again after ``malloc_trim(0)`` (with ``--trim``).
Prints one summary per run and worker and writes ``--out`` (JSON).

    python benchmarks/partition_memory.py --partitions 2000 --rows 20000 [--tracemalloc] [--trim]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from typing import Any

import dask
import dask.dataframe as dd
import psutil
from distributed import Client, LocalCluster, wait

import mpshuffle.dask  # noqa: F401 -- installs the shuffle method

try:  # run as a script (benchmarks/ on the path) or as benchmarks.partition_memory
    import inputs
except ImportError:
    from benchmarks import inputs


def _rss_parts() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for row in f:
            if row.startswith(("VmRSS", "RssAnon", "RssFile", "RssShmem")):
                name, value = row.split(":")
                out[name.lower()] = int(value.split()[0]) * 1024
    return out


def _malloc() -> dict[str, int]:
    import ctypes

    class _Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Info
    info = libc.mallinfo2()
    return {"heap_arena": info.arena, "heap_in_use": info.uordblks, "heap_free": info.fordblks,
            "malloc_mmapped": info.hblkhd}


def _top(snapshot: Any, base: Any = None, n: int = 25) -> list[str]:
    import tracemalloc

    filters = [tracemalloc.Filter(False, tracemalloc.__file__)]
    snapshot = snapshot.filter_traces(filters)
    if base is not None:
        stats = snapshot.compare_to(base.filter_traces(filters), "traceback")
        return [f"{s.size_diff / 1e6:8.2f} MB {s.count_diff:+8d} blocks  " + " <- ".join(
            f"{os.path.basename(fr.filename)}:{fr.lineno}" for fr in s.traceback) for s in stats[:n]]
    stats = snapshot.statistics("traceback")
    return [f"{s.size / 1e6:8.2f} MB {s.count:8d} blocks  " + " <- ".join(
        f"{os.path.basename(fr.filename)}:{fr.lineno}" for fr in s.traceback) for s in stats[:n]]


def _install(interval: float, trace: bool, dask_worker: Any) -> None:
    """In a worker: count extracts, and sample memory on a thread (see the module docstring)."""
    import threading
    import tracemalloc

    from mpshuffle.dask.worker import PLUGIN_NAME
    from mpshuffle.memory.resource import MemoryType
    from mpshuffle.shuffler import host

    state: dict[str, Any] = {"extracted": 0, "samples": [], "on": False, "snap": None, "snap_at": 0}
    extract = host.Shuffler.extract

    def counting_extract(self: Any, partition_id: int) -> Any:
        out = extract(self, partition_id)
        state["extracted"] += 1
        return out

    host.Shuffler.extract = counting_extract  # type: ignore[method-assign]
    if trace:
        tracemalloc.start(6)

    def sample() -> None:
        while True:
            if state["on"]:
                ctx = dask_worker.plugins[PLUGIN_NAME].context
                s = {"t": time.monotonic(), **_rss_parts(), **_malloc(), "dask": int(dask_worker.state.nbytes),
                     "extracted": state["extracted"]}
                if ctx is not None:
                    s["mps_host"] = ctx.resource.used(MemoryType.HOST)
                    s["pool_idle"] = ctx.pool.idle_bytes
                if trace:
                    current = tracemalloc.get_traced_memory()[0]
                    s["traced"] = current
                    if current > 1.1 * state["snap_at"] and current > 50e6:
                        state["snap_at"] = current
                        state["snap"] = {"sample": s, "top": _top(tracemalloc.take_snapshot())}
                state["samples"].append(s)
            time.sleep(interval)

    threading.Thread(target=sample, daemon=True, name="memory-sampler").start()
    dask_worker._partition_memory = state


def _start(dask_worker: Any) -> None:
    import tracemalloc

    state = dask_worker._partition_memory
    state.update(samples=[], extracted=0, snap=None, snap_at=0, on=True)
    state["base"] = tracemalloc.take_snapshot() if tracemalloc.is_tracing() else None


def _stop(dask_worker: Any) -> dict[str, Any]:
    state = dask_worker._partition_memory
    state["on"] = False
    return {"samples": list(state["samples"]), "snap": state["snap"]}


def _after(trim: bool, dask_worker: Any) -> dict[str, Any]:
    import ctypes
    import tracemalloc

    from mpshuffle.dask.worker import PLUGIN_NAME
    from mpshuffle.memory.resource import MemoryType

    gc.collect()
    time.sleep(0.5)
    ctx = dask_worker.plugins[PLUGIN_NAME].context
    out: dict[str, Any] = {**_rss_parts(), **_malloc(), "dask": int(dask_worker.state.nbytes),
                           "tasks": len(dask_worker.state.tasks)}
    if ctx is not None:
        out.update(mps_host=ctx.resource.used(MemoryType.HOST), pool_idle=ctx.pool.idle_bytes,
                   runs=len(ctx.shufflers))
    state = dask_worker._partition_memory
    if tracemalloc.is_tracing() and state.get("base") is not None:
        out["left"] = _top(tracemalloc.take_snapshot(), state["base"])
        out["traced"] = tracemalloc.get_traced_memory()[0]
    if trim:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        out["trimmed"] = {**_rss_parts(), **_malloc()}
    return out


def _idle(dask_worker: Any) -> dict[str, Any]:
    gc.collect()
    return {**_rss_parts(), **_malloc()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--partitions", type=int, default=2000)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--interval", type=float, default=0.02)
    parser.add_argument("--tracemalloc", action="store_true")
    parser.add_argument("--trim", action="store_true")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "partition_memory.json"))
    args = parser.parse_args()
    result: dict[str, Any] = {"args": vars(args), "runs": []}
    with LocalCluster(n_workers=args.workers, threads_per_worker=1, memory_limit="8GiB",
                      dashboard_address=None) as cluster, Client(cluster) as client:
        pids = client.run(os.getpid)
        with dask.config.set({"dataframe.shuffle.method": "mpshuffle"}):
            warm = dd.from_map(inputs.make_partition, range(8), rows=100).shuffle("key").persist()
            wait(warm)
            del warm
        client.run(_install, args.interval, args.tracemalloc)
        for r in range(args.repeats):
            time.sleep(0.5)
            idle = client.run(_idle)
            client.run(_start)
            cpu0 = {a: sum(psutil.Process(p).cpu_times()[:2]) for a, p in pids.items()}
            load = os.getloadavg()[0]
            t0 = time.perf_counter()
            with dask.config.set({"dataframe.shuffle.method": "mpshuffle"}):
                df = dd.from_map(inputs.make_partition, range(args.partitions), rows=args.rows)
                out = df.shuffle("key").optimize().persist()
                wait(out)
            seconds = time.perf_counter() - t0
            cpu = {a: sum(psutil.Process(p).cpu_times()[:2]) - cpu0[a] for a, p in pids.items()}
            got = client.run(_stop)
            nrows = int(out.map_partitions(len).sum().compute())
            assert nrows == args.partitions * args.rows, nrows
            del out, df
            time.sleep(0.5)
            after = client.run(_after, args.trim)
            run = {"seconds": seconds, "load": load, "cpu": cpu, "workers": {}}
            for w, addr in enumerate(sorted(got)):
                samples = got[addr]["samples"]
                peak = max(samples, key=lambda s: s["vmrss"])
                run["workers"][addr] = {"idle": idle[addr], "peak": peak, "after": after[addr],
                                        "snap": got[addr]["snap"], "nsamples": len(samples)}
                mb = 1e6
                print(f"run {r} worker {w}: {seconds:.1f} s load {load:.1f} cpu {cpu[addr]:.1f} s; idle "
                      f"{idle[addr]['vmrss'] / mb:.0f} MB; peak {peak['vmrss'] / mb:.0f} (anon {peak['rssanon'] / mb:.0f} "
                      f"file {peak['rssfile'] / mb:.0f} shm {peak['rssshmem'] / mb:.0f}; heap in use "
                      f"{peak['heap_in_use'] / mb:.0f} free {peak['heap_free'] / mb:.0f} mmapped "
                      f"{peak['malloc_mmapped'] / mb:.0f}; dask {peak['dask'] / mb:.0f} mps "
                      f"{peak.get('mps_host', 0) / mb:.0f} pool {peak.get('pool_idle', 0) / mb:.0f} traced "
                      f"{peak.get('traced', 0) / mb:.0f}; extracted {peak['extracted']}); after "
                      f"{after[addr]['vmrss'] / mb:.0f} (anon {after[addr]['rssanon'] / mb:.0f}, heap in use "
                      f"{after[addr]['heap_in_use'] / mb:.0f} free {after[addr]['heap_free'] / mb:.0f}, mmapped "
                      f"{after[addr]['malloc_mmapped'] / mb:.0f}, dask {after[addr]['dask'] / mb:.0f}, tasks "
                      f"{after[addr]['tasks']}, mps {after[addr].get('mps_host', 0) / mb:.0f}, runs "
                      f"{after[addr].get('runs')})"
                      + (f"; trimmed {after[addr]['trimmed']['vmrss'] / mb:.0f}" if args.trim else ""), flush=True)
                snap = got[addr]["snap"]
                if snap:
                    print(f"  near the peak (traced {snap['sample']['traced'] / mb:.0f} MB, rss "
                          f"{snap['sample']['vmrss'] / mb:.0f}, extracted {snap['sample']['extracted']}):")
                    print("\n".join("    " + x for x in snap["top"][:15]))
                if "left" in after[addr]:
                    print(f"  left after the run (traced {after[addr]['traced'] / mb:.0f} MB):")
                    print("\n".join("    " + x for x in after[addr]["left"][:12]))
            result["runs"].append(run)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1, default=str)
    gc.collect()


if __name__ == "__main__":
    main()
