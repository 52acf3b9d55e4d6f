"""A device shuffle through Dask on one GPU, in memory and past the device budget, with and without disk.

One ``LocalCluster`` worker process (one GPU, Dask's own memory spilling
off, so every byte that leaves the GPU is mpshuffle's), CuPy-backed
:class:`~mpshuffle.table.device.DeviceTable` partitions through
:func:`mpshuffle.dask.shuffle_graph`. The input partitions are made on the
GPU by tasks of the same graph (an int64 ``key`` uniform in [0, 2^62), an
int64 ``row`` numbering every row, two float64 columns: 32 bytes a row), so
the GPU never holds the whole input: what it holds beyond one input and one
output partition is the shuffle's, bounded by the device budget. Scenarios,
each bootstrapped with its own options, in this order and repeated
``--reps`` times:

- ``memory``: device budget ``spill_device`` = 0.9 of the GPU, nothing spills;
- ``device3x``: device budget = ``--gb`` / 3 (the data is 3x the budget),
  host budget ``--host-gb-big`` (nothing reaches disk);
- ``disk``: the same device budget and a host budget of ``--host-gb``, so
  most of what leaves the GPU goes on to disk (``spill_dir``: ``--spill-dir``).

Every repetition is checked: the task after each output partition returns,
computed on the GPU, its rows, a checksum (the sum of every column's values
taken as ``uint64`` bits, modulo 2^64) and whether every row's key hashes to
that partition; totals must equal the inputs' (the same tasks over the
inputs alone, which is also the ``floor`` scenario: the graph without its
shuffle). The ``row`` column is a permutation check: its sum is known.

Per repetition: seconds from ``client.get`` until every summary is back;
GB/s = input bytes / seconds; the run's statistics (bytes spilled per tier
and seconds per phase); peaks sampled every 10 ms on the worker: the
shuffle's accounted use per tier (``DEVICE``, ``HOST``, ``DISK``), CuPy's
pool (bytes in use) and the process's resident memory.

Run: ``python benchmarks/gpu_tiers_bench.py --gb 24 --reps 3 --out tiers.json``.
``--numpy`` runs the same graph with NumPy tables (the host path) to try
the script on a machine without a GPU; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import threading
import time
from typing import Any

ROW_BYTES = 32


def make(i: int, nrows: int, seed: int, gpu: bool) -> Any:
    """Input partition ``i``: ``nrows`` rows made on the worker's GPU (rows ``i * nrows ...``)."""
    import numpy as np

    from mpshuffle.table.device import DeviceTable

    if gpu:
        import cupy as xp
    else:
        xp = np
    rs = xp.random.RandomState(seed * 100_003 + i)
    return DeviceTable({
        "key": rs.randint(0, 2**62, size=nrows, dtype=np.int64),
        "row": xp.arange(i * nrows, (i + 1) * nrows, dtype=np.int64),
        "a": rs.random_sample(nrows),
        "b": rs.random_sample(nrows),
    })


def summary(t: Any, partition: int | None, npartitions: int) -> list[int]:
    """``[rows, checksum, in partition, sum of row]`` of a partition, computed where it lies."""
    import numpy as np

    from mpshuffle.table.device import DeviceAdapter

    xp = t.xp
    total = sum(int(c.view(np.uint64).sum(dtype=np.uint64)) for c in t.columns.values()) % 2**64
    member = 1
    if partition is not None and t.nrows:
        member = int(bool((DeviceAdapter().partition_ids(t, ["key"], npartitions) == partition).all()))
    rows_sum = int(xp.sum(t.columns["row"])) if t.nrows else 0
    return [int(t.nrows), total, member, rows_sum]


def start_sampler(dask_worker: Any, interval: float = 0.01) -> None:
    """Sample the shuffle's use per tier, CuPy's pool and the RSS on the worker until stopped."""
    import psutil

    from mpshuffle.dask.worker import PLUGIN_NAME
    from mpshuffle.memory import MemoryType

    try:
        import cupy

        pool: Any = cupy.get_default_memory_pool()
    except ImportError:
        pool = None
    proc = psutil.Process()
    peaks = {"device_accounted": 0, "host_accounted": 0, "disk_accounted": 0,
             "cupy_pool_used": 0, "rss": 0, "rss_start": int(proc.memory_info().rss)}
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            plugin = dask_worker.plugins.get(PLUGIN_NAME)
            ctx = plugin.context if plugin is not None else None
            if ctx is not None:
                for key, mt in (("device_accounted", MemoryType.DEVICE), ("host_accounted", MemoryType.HOST),
                                ("disk_accounted", MemoryType.DISK)):
                    peaks[key] = max(peaks[key], ctx.resource.used(mt))
            if pool is not None:
                peaks["cupy_pool_used"] = max(peaks["cupy_pool_used"], int(pool.used_bytes()))
            peaks["rss"] = max(peaks["rss"], int(proc.memory_info().rss))
            stop.wait(interval)

    th = threading.Thread(target=loop, name="tiers-sampler", daemon=True)
    dask_worker._tiers_sampler = (stop, th, peaks)  # one benchmark's state, on its worker
    th.start()


def stop_sampler(dask_worker: Any) -> dict[str, Any]:
    """Stop the sampler; its peaks, the last run's statistics and the budgets."""
    from mpshuffle.dask.worker import PLUGIN_NAME
    from mpshuffle.memory import MemoryType

    stop, th, peaks = dask_worker._tiers_sampler
    stop.set()
    th.join()
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    ctx = plugin.context if plugin is not None else None
    out: dict[str, Any] = {"peaks": peaks}
    if ctx is not None:
        out["stats"] = dict(ctx.history[-1][1]) if ctx.history else {}
        out["budgets"] = {m.name: ctx.resource.limit(m) for m in MemoryType}
        out["left"] = {m.name: ctx.resource.used(m) for m in MemoryType}
    return out


def free_pool() -> int:
    """Give CuPy's cached blocks back between repetitions; bytes still in use."""
    try:
        import cupy
    except ImportError:
        return 0
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    return int(pool.used_bytes())


def register(gpu: bool) -> None:
    """Register the device table's frame adapter in this process (CuPy's, or the NumPy twin's)."""
    from mpshuffle.table import register_adapter
    from mpshuffle.table.device import DeviceAdapter
    from mpshuffle.table.gpu import register_device_adapter

    if not (gpu and register_device_adapter()):
        register_adapter(DeviceAdapter())


def versions(gpu: bool) -> dict[str, Any]:
    import dask
    import distributed
    import numpy
    import pandas
    import pyarrow

    import mpshuffle

    out: dict[str, Any] = {
        "python": platform.python_version(), "mpshuffle": mpshuffle.__version__, "dask": dask.__version__,
        "distributed": distributed.__version__, "numpy": numpy.__version__, "pandas": pandas.__version__,
        "pyarrow": pyarrow.__version__, "cpus": os.cpu_count(),
    }
    if gpu:
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(0)
        out.update(cupy=cupy.__version__, cuda_runtime=cupy.cuda.runtime.runtimeGetVersion(),
                   driver=cupy.cuda.runtime.driverGetVersion(), device=props["name"].decode(),
                   device_memory_bytes=int(cupy.cuda.runtime.memGetInfo()[1]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=24.0, help="GB of input (3x the device budget)")
    ap.add_argument("--inputs", type=int, default=48, help="input partitions")
    ap.add_argument("--npartitions", type=int, default=32)
    ap.add_argument("--host-gb", type=float, default=2.0, help="host budget (GB) of the disk scenario")
    ap.add_argument("--host-gb-big", type=float, default=100.0, help="host budget (GB) of the device3x scenario")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--scenarios", nargs="+", default=["floor", "memory", "device3x", "disk"])
    ap.add_argument("--spill-dir", default=None, help="spill directory (default: a temporary one)")
    ap.add_argument("--threads", type=int, default=1, help="threads of the worker")
    ap.add_argument("--numpy", action="store_true", help="NumPy tables, the host path (a dry run)")
    ap.add_argument("--out", default="gpu_tiers_bench.json")
    args = ap.parse_args()
    gpu = not args.numpy

    import dask
    from distributed import Client, LocalCluster

    from mpshuffle.dask import bootstrap_dask_cluster, shuffle_graph

    nrows = int(args.gb * 1e9 / ROW_BYTES / args.inputs)
    in_bytes = nrows * args.inputs * ROW_BYTES
    ntotal = nrows * args.inputs
    meta = make(0, 0, 0, gpu)
    spill_dir = args.spill_dir or tempfile.mkdtemp(prefix="mpshuffle-tiers-")
    info = versions(gpu)
    total_dev = info.get("device_memory_bytes", 10**12)
    budget = in_bytes / 3
    scenario_options = {
        "memory": {"spill_device": 0.9, "spill_host": int(args.host_gb_big * 1e9)},
        "device3x": {"spill_device": budget / total_dev, "spill_host": int(args.host_gb_big * 1e9)},
        "disk": {"spill_device": budget / total_dev, "spill_host": int(args.host_gb * 1e9)},
    }
    results: dict[str, Any] = {
        "meta": {**info, "input_bytes": in_bytes, "rows": ntotal, "inputs": args.inputs,
                 "npartitions": args.npartitions, "row_bytes": ROW_BYTES, "threads": args.threads,
                 "spill_dir": spill_dir, "device_budget_bytes_3x": int(budget),
                 "host_budget_bytes_disk": int(args.host_gb * 1e9)},
        "runs": [],
    }
    want_rowsum = ntotal * (ntotal - 1) // 2
    # Dask's own spilling off: every byte that leaves the GPU is the shuffle's.
    cfg = {"distributed.worker.memory.target": False, "distributed.worker.memory.spill": False,
           "distributed.worker.memory.pause": False, "distributed.worker.memory.terminate": False}
    with dask.config.set(cfg), LocalCluster(
        n_workers=1, threads_per_worker=args.threads, processes=True, dashboard_address=":0",
        memory_limit="120GB", env={"NCCL_NVLS_ENABLE": "0"},
    ) as cluster, Client(cluster) as client:
        seq = iter(range(10**6))
        register(gpu)
        client.run(register, gpu)

        def graph_of(shuffle: bool, n: int = nrows) -> tuple[dict[Any, Any], list[Any]]:
            tok = f"{next(seq)}-{os.urandom(3).hex()}"
            inputs = [(f"make-{tok}", i) for i in range(args.inputs)]
            graph: dict[Any, Any] = {k: (make, i, n, 7, gpu) for i, k in enumerate(inputs)}
            if not shuffle:
                outs = [(f"sum-{tok}", i) for i in range(args.inputs)]
                graph.update({o: (summary, k, None, 1) for o, k in zip(outs, inputs, strict=True)})
                return graph, outs
            g, keys = shuffle_graph(inputs, on=["key"], npartitions=args.npartitions, meta=meta, token=tok)
            graph.update(g)
            outs = [(f"sum-{tok}", j) for j in range(args.npartitions)]
            graph.update({o: (summary, k, j, args.npartitions) for j, (o, k) in enumerate(zip(outs, keys, strict=True))})
            return graph, outs

        # The inputs' own totals (and a warm-up of the kernels).
        graph, outs = graph_of(False)
        want = client.get(graph, outs)
        want_rows, want_sum = sum(w[0] for w in want), sum(w[1] for w in want) % 2**64
        assert want_rows == ntotal and sum(w[3] for w in want) == want_rowsum
        print(json.dumps({"input_rows": want_rows, "input_bytes": in_bytes}), flush=True)
        for name in args.scenarios:
            opts = scenario_options.get(name, {"spill_device": 0.9})
            with dask.config.set({f"mpshuffle.{k}": v for k, v in {**opts, "spill_dir": spill_dir}.items()}):
                if name != "floor":
                    gen = bootstrap_dask_cluster(client, spill_dir=spill_dir, **opts)
                    # An untimed small shuffle: kernels loaded, the generation's run machinery warm.
                    client.get(*graph_of(True, 10_000))
                for rep in range(args.reps):
                    graph, outs = graph_of(name != "floor")
                    client.run(free_pool)
                    client.run(start_sampler)
                    t0 = time.perf_counter()
                    got = client.get(graph, outs)
                    secs = time.perf_counter() - t0
                    time.sleep(0.3)  # the run's close reaches the worker's history
                    (probe,) = client.run(stop_sampler).values()
                    ok = (sum(g[0] for g in got) == want_rows and sum(g[1] for g in got) % 2**64 == want_sum
                          and all(g[2] for g in got) and sum(g[3] for g in got) == want_rowsum)
                    rec = {"scenario": name, "rep": rep, "seconds": secs, "gbps": in_bytes / 1e9 / secs,
                           "correct": bool(ok), "options": opts if name != "floor" else None,
                           "generation": gen.id if name != "floor" else None, **probe}
                    if name == "floor":
                        rec.pop("stats", None)
                    results["runs"].append(rec)
                    print(json.dumps({k: rec[k] for k in ("scenario", "rep", "seconds", "gbps", "correct")}
                                     | {"peaks": rec["peaks"]}
                                     | {k: v for k, v in rec.get("stats", {}).items() if k.startswith("bytes_spilled")}),
                          flush=True)
                    if not ok:
                        raise SystemExit(f"{name} rep {rep}: output check failed")
                    with open(args.out, "w") as f:
                        json.dump(results, f, indent=1)
    by: dict[str, list[float]] = {}
    for r in results["runs"]:
        by.setdefault(r["scenario"], []).append(r["seconds"])
    ref = statistics.median(by["memory"]) if "memory" in by else None
    results["summary"] = {
        s: {"seconds_min": min(v), "seconds_median": statistics.median(v), "seconds_max": max(v),
            "gbps_median": in_bytes / 1e9 / statistics.median(v),
            "speed_vs_memory_median": None if ref is None else ref / statistics.median(v)}
        for s, v in by.items()
    }
    print(json.dumps(results["summary"], indent=1), flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
