"""Peak memory of a shuffle far larger than the host budget: mpshuffle vs Dask's P2P.

Not a test. On a LocalCluster of 2 workers x 1 thread (explicit memory
limit) it shuffles data of at least 4x the sum of the workers' mpshuffle host
budgets, generated on the workers with numpy (int64 key, float64, string),
while a background thread samples every worker's RSS with psutil, and runs
Dask's P2P shuffle of the same data the same way. Every run gets a fresh
cluster of the same shape; with ``--repeats N`` the methods alternate, their
order turned each round (mpshuffle, P2P; P2P, mpshuffle; ...), so that a
change of the machine's load weighs on both. Per run it records the seconds,
the workers' CPU-seconds (user + system, from ``/proc``) and how busy the
disk of the spill directory was (``io_ticks`` of ``/proc/diskstats`` over
the wall time); where the time went: each worker thread group's user and
system CPU (task threads, event loop, mpshuffle's progress thread; from
``/proc/self/task`` on the workers) and Dask's task stream by key prefix
(tasks, summed compute seconds); the peak RSS's parts (``RssAnon``,
``RssFile``, ``RssShmem``: mapped spill-file pages count as ``RssFile``),
and for mpshuffle the bytes its host pool handed out fresh and reused.
With ``--perf DIR`` ``perf record -g`` samples every run's workers. For
each worker it prints the peak RSS next to the bound

    idle RSS (after bootstrap and a tiny warm-up shuffle) + host budget
    + 2 x the largest input or output partition's in-memory size

and writes everything to ``benchmarks/results/memory_budget.json``.

Run: ``python benchmarks/memory_budget.py [--gb 0.6] [--budget-mib 64] [--repeats 1] [--perf DIR]``
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import cloudpickle
import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import psutil
import pyarrow as pa
import pyarrow.compute as pc
from distributed import Client, LocalCluster

import mpshuffle
from mpshuffle.dask import bootstrap_dask_cluster, gather_statistics, shuffle

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import thread_cpu as per_thread

# Workers run per_thread.snapshot (benchmarks/thread_cpu.py) through client.run and cannot import the benchmarks folder.
cloudpickle.register_pickle_by_value(per_thread)

MiB = 2**20
# Bytes per row in memory: int64 + float64 + an 11-character pyarrow string
# (11 bytes of data + a 4-byte offset) — the generator below aims at this.
ROW_BYTES = 8 + 8 + 15


def make_partition(i: int, nrows: int) -> pd.DataFrame:
    """Input partition ``i``: ``nrows`` rows of int64 key, float64 and string columns.

    The strings are the key's last ten digits after a ``1``, made by Arrow's
    cast (~0.1 s a partition of 800k rows; formatting them in numpy took
    ~2 s, which both shuffles paid and which hid the difference between them).
    """
    rng = np.random.default_rng(i)
    keys = rng.integers(0, 2**40, nrows, dtype=np.int64)
    strings = pc.cast(pa.array(keys % 10**10 + 10**10), pa.string())
    return pd.DataFrame(
        {
            "k": keys,
            "x": rng.random(nrows),
            "s": strings.to_pandas(types_mapper=lambda _: pd.StringDtype("pyarrow", na_value=np.nan)),
        }
    )


def partition_sizes(df: pd.DataFrame) -> pd.DataFrame:
    """One row per partition: its row count and in-memory size in bytes."""
    return pd.DataFrame({"rows": [len(df)], "nbytes": [int(df.memory_usage(deep=True, index=True).sum())]})


class RSSSampler:
    """Samples the RSS of a set of processes in a background thread.

    Parameters
    ----------
    pids
        Worker address -> process id.
    interval
        Seconds between samples.
    """

    def __init__(self, pids: dict[str, int], interval: float = 0.02) -> None:
        self.procs = {w: psutil.Process(pid) for w, pid in pids.items()}
        self.interval = interval
        self.peak = {w: 0 for w in pids}
        self.peak_parts: dict[str, dict[str, int]] = {w: {} for w in pids}  # RssAnon/File/Shmem at the peak
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for w, p in self.procs.items():
                try:
                    with open(f"/proc/{p.pid}/status") as f:
                        parts = {
                            k: int(v.split()[0]) * 1024
                            for k, v in (line.split(":", 1) for line in f)
                            if k in ("RssAnon", "RssFile", "RssShmem")
                        }
                except (OSError, ValueError):
                    continue
                rss = sum(parts.values())
                if rss > self.peak[w]:
                    self.peak[w] = rss
                    self.peak_parts[w] = parts
            self.samples += 1
            self._stop.wait(self.interval)

    def __enter__(self) -> RSSSampler:  # noqa: PYI034
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def worker_pids(client: Client) -> dict[str, int]:
    return client.run(os.getpid)  # type: ignore[no-any-return]


def idle_rss(client: Client) -> dict[str, int]:
    """RSS of every worker after letting it settle for a moment."""
    time.sleep(1.0)
    return {w: psutil.Process(pid).memory_info().rss for w, pid in worker_pids(client).items()}


def build_input(nparts: int, rows: int) -> dd.DataFrame:
    return dd.from_map(make_partition, range(nparts), nrows=rows, enforce_metadata=False)


def worker_cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU-seconds each worker process has used so far."""
    out = {}
    for w, pid in pids.items():
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        out[w] = t.user + t.system
    return out


def disk_of(path: str) -> str | None:
    """The ``/proc/diskstats`` name of the block device holding ``path`` (a whole disk or partition), if found."""
    try:
        dev = os.stat(path).st_dev
        major, minor = os.major(dev), os.minor(dev)
        with open("/proc/diskstats") as f:
            for line in f:
                fields = line.split()
                if int(fields[0]) == major and int(fields[1]) == minor:
                    return fields[2]
    except (OSError, ValueError, IndexError):
        pass
    return None


def disk_ticks(name: str | None) -> tuple[int, int, int]:
    """``(io_ticks ms, sectors read, sectors written)`` of disk ``name`` from ``/proc/diskstats`` (zeros if unknown)."""
    if name is None:
        return (0, 0, 0)
    with open("/proc/diskstats") as f:
        for line in f:
            fields = line.split()
            if fields[2] == name:
                return (int(fields[12]), int(fields[5]), int(fields[9]))
    return (0, 0, 0)


def thread_cpu(before: dict[int, Any], after: dict[int, Any]) -> dict[str, list[float]]:
    """CPU-seconds ``[user, system]`` per thread group (task threads, event loop, progress thread, others)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for tid, (name, u, s) in after.items():
        _, u0, s0 = before.get(tid, (name, 0, 0))
        group = next(
            (g for g in ("mpshuffle-progress", "Dask-Default-Threads", "MainThread", "Dask-Offload") if g in name),
            "other",
        )
        out[group][0] += (u - u0) / tick
        out[group][1] += (s - s0) / tick
    return {k: [round(v[0], 2), round(v[1], 2)] for k, v in out.items()}


def task_seconds(stream: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per key prefix of Dask's task stream: ``[tasks, summed compute seconds]``."""
    out: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for ts in stream:
        key = ts["key"][0] if isinstance(ts["key"], tuple) else ts["key"]
        prefix = key.rsplit("-", 1)[0] if "-" in key else key
        out[prefix][0] += 1
        out[prefix][1] += sum(s["stop"] - s["start"] for s in ts["startstops"] if s["action"] == "compute")
    return {k: [v[0], round(v[1], 2)] for k, v in out.items()}


def run_phase(
    name: str, client: Client, shuffled: dd.DataFrame, disk: str | None, perf: str = ""
) -> dict[str, Any]:
    """Compute the sizes of ``shuffled``'s partitions while sampling RSS, CPU and the disk's busy time.

    With ``perf`` (a file path), ``perf record -g`` samples the workers meanwhile into that file.
    """
    pids = worker_pids(client)
    recorder = None
    if perf:
        recorder = subprocess.Popen(
            ["perf", "record", "-e", "cpu-clock", "-F", "499", "-g", "-p", ",".join(map(str, pids.values())),
             "-o", perf],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        time.sleep(0.5)
    client.get_task_stream(start=time.time())  # installs the scheduler's task stream plugin on first use
    threads0 = client.run(per_thread.snapshot)
    cpu0 = worker_cpu_seconds(pids)
    ticks0 = disk_ticks(disk)
    with RSSSampler(pids) as sampler:
        t0 = time.perf_counter()
        wall0 = time.time()
        sizes = shuffled.map_partitions(partition_sizes, meta={"rows": "i8", "nbytes": "i8"}).compute()
        seconds = time.perf_counter() - t0
    ticks1 = disk_ticks(disk)
    cpu1 = worker_cpu_seconds(pids)
    threads1 = client.run(per_thread.snapshot)
    if recorder is not None:
        recorder.send_signal(2)
        recorder.wait()
    return {
        "thread_cpu_seconds": {w: thread_cpu(threads0[w], threads1[w]) for w in threads1 if w in threads0},
        "task_seconds": task_seconds(client.get_task_stream(start=wall0)),
        "name": name,
        "seconds": seconds,
        "rows": int(sizes["rows"].sum()),
        "largest_output_partition_bytes": int(sizes["nbytes"].max()),
        "peak_rss": sampler.peak,
        "peak_rss_parts": sampler.peak_parts,
        "samples": sampler.samples,
        "worker_cpu_seconds": {w: cpu1[w] - cpu0[w] for w in cpu1 if w in cpu0},
        "disk": disk,
        "disk_busy_fraction": (ticks1[0] - ticks0[0]) / 1000 / seconds,
        "disk_read_bytes": (ticks1[1] - ticks0[1]) * 512,
        "disk_written_bytes": (ticks1[2] - ticks0[2]) * 512,
    }


def pool_stats(dask_worker: Any) -> dict[str, int]:
    """The worker's host pool's counters (``HostPool.stats``: bytes handed out reused and fresh so far)."""
    from mpshuffle.dask.worker import PLUGIN_NAME

    return dask_worker.plugins[PLUGIN_NAME].context.pool.stats()  # type: ignore[no-any-return]


def perf_file(directory: str, kind: str, r: int) -> str:
    """Where ``--perf`` writes run ``r`` of method ``kind`` ("" without ``--perf``)."""
    if not directory:
        return ""
    os.makedirs(directory, exist_ok=True)
    return os.path.join(directory, f"{kind}-{r}.data")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=0.6, help="in-memory size of the data, GB (1e9 bytes)")
    parser.add_argument("--partitions", type=int, default=40, help="input and output partitions")
    parser.add_argument("--budget-mib", type=int, default=64, help="mpshuffle host budget per worker, MiB")
    parser.add_argument("--memory-limit", default="4GiB", help="memory_limit of each worker")
    parser.add_argument(
        "--arrow-pool", default="system",
        help="ARROW_DEFAULT_MEMORY_POOL of the workers (both shuffles): 'system' returns freed "
        "memory at once; Arrow's default allocator keeps it for reuse, which hides the peak",
    )
    parser.add_argument(
        "--methods", default="mpshuffle,p2p", help="comma-separated, of mpshuffle and p2p, in round 0's order"
    )
    parser.add_argument(
        "--repeats", type=int, default=1,
        help="rounds; each runs every method once, each on a fresh cluster, the order turned by one every round",
    )
    parser.add_argument(
        "--perf", default="", help="record every run's workers with `perf record -g` into DIR/<method>-<round>.data"
    )
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results", "memory_budget.json")
    )
    args = parser.parse_args()

    if args.arrow_pool:
        # Inherited by the worker processes (and set the same for both shuffles).
        os.environ["ARROW_DEFAULT_MEMORY_POOL"] = args.arrow_pool
    nworkers = 2
    budget = args.budget_mib * MiB
    rows = int(args.gb * 1e9 / ROW_BYTES / args.partitions)
    result: dict[str, Any] = {
        "workers": nworkers,
        "threads_per_worker": 1,
        "memory_limit": args.memory_limit,
        "host_budget_bytes": budget,
        "partitions": args.partitions,
        "arrow_memory_pool": args.arrow_pool,
        "rows_per_partition": rows,
        "versions": {
            "mpshuffle": getattr(mpshuffle, "__version__", "?"),
            "dask": dask.__version__,
            "pandas": pd.__version__,
            "python": platform.python_version(),
        },
        "cpus": os.cpu_count(),
    }
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    assert set(methods) <= {"mpshuffle", "p2p"} and methods, methods
    result["methods"] = methods
    result["repeats"] = args.repeats
    spill_dir = dask.config.get("temporary-directory", None) or tempfile.gettempdir()
    disk = disk_of(spill_dir)
    result["spill_disk"] = disk
    result["load_average_start"] = os.getloadavg()
    df = build_input(args.partitions, rows)
    runs: list[dict[str, Any]] = []
    for r in range(args.repeats):
        turn = r % len(methods)
        for kind in methods[turn:] + methods[:turn]:
            # A fresh cluster of the same shape for every run, so that none
            # starts from another's leftovers.
            with LocalCluster(
                n_workers=nworkers, threads_per_worker=1, processes=True,
                memory_limit=args.memory_limit, dashboard_address=":0",
            ) as cluster, Client(cluster) as client:
                warm = dd.from_pandas(make_partition(0, 1000), npartitions=2)
                if "data_bytes" not in result:
                    inputs = df.map_partitions(partition_sizes, meta={"rows": "i8", "nbytes": "i8"}).compute()
                    total = int(inputs["nbytes"].sum())
                    result["data_bytes"] = total
                    result["largest_input_partition_bytes"] = int(inputs["nbytes"].max())
                    result["data_over_budgets"] = total / (nworkers * budget)
                    print(
                        f"data: {total / MiB:.0f} MiB in {args.partitions} partitions "
                        f"(largest {inputs['nbytes'].max() / MiB:.1f} MiB) = "
                        f"{result['data_over_budgets']:.1f} x the sum of the host budgets "
                        f"({nworkers} x {args.budget_mib} MiB); spill disk {disk}",
                        flush=True,
                    )
                if kind == "mpshuffle":
                    bootstrap_dask_cluster(client, spill_host=budget)
                    shuffle(warm, "k", npartitions=2).compute()
                    idle = idle_rss(client)
                    pool0 = client.run(pool_stats)
                    phase = run_phase(
                        kind, client, shuffle(df, "k", npartitions=args.partitions), disk, perf_file(args.perf, kind, r)
                    )
                    stats = gather_statistics(client)
                    phase["statistics"] = {w: runs_[-1] for w, runs_ in stats.items() if runs_}
                    pool1 = client.run(pool_stats)
                    phase["pool_bytes"] = {
                        w: {k: pool1[w][k] - pool0[w][k] for k in ("reused_bytes", "fresh_bytes")} for w in pool1
                    }
                else:
                    warm.shuffle("k", npartitions=2, shuffle_method="p2p").compute()
                    idle = idle_rss(client)
                    shuffled = df.shuffle("k", npartitions=args.partitions, shuffle_method="p2p")
                    phase = run_phase(kind, client, shuffled, disk, perf_file(args.perf, kind, r))
                phase["idle_rss"] = idle
                phase["round"] = r
                phase["load_average"] = os.getloadavg()
                runs.append(phase)
                print(
                    f"round {r} {kind}: {phase['seconds']:.1f} s, workers' CPU "
                    f"{sum(phase['worker_cpu_seconds'].values()):.1f} s, disk busy "
                    f"{phase['disk_busy_fraction']:.0%}, peak RSS MiB "
                    f"{sorted(round(v / MiB) for v in phase['peak_rss'].values())} (anon/file/shmem "
                    f"{[[round(v / MiB) for v in parts.values()] for parts in phase['peak_rss_parts'].values()]})",
                    flush=True,
                )
                for w, groups in sorted(phase["thread_cpu_seconds"].items()):
                    print(f"    {w} threads [user, sys] CPU-s: {dict(sorted(groups.items()))}", flush=True)
                print(f"    tasks [count, compute s]: {phase['task_seconds']}", flush=True)
    result["load_average_end"] = os.getloadavg()
    result["runs"] = runs

    largest = max(
        [result["largest_input_partition_bytes"]] + [p["largest_output_partition_bytes"] for p in runs]
    )
    result["largest_partition_bytes"] = largest
    print(f"\n{'':>10} {'round':>5} {'worker':<24} {'idle':>9} {'peak':>9} {'bound':>9} {'within':>7}   seconds")
    for phase in runs:
        phase["bound"] = {}
        phase["within_bound"] = {}
        for i, w in enumerate(sorted(phase["peak_rss"])):
            idle_w = sorted(phase["idle_rss"].items())[i][1]
            bound = idle_w + budget + 2 * largest
            phase["bound"][w] = bound
            phase["within_bound"][w] = phase["peak_rss"][w] <= bound
            print(
                f"{phase['name']:>10} {phase['round']:>5} {w:<24} {idle_w / MiB:7.0f}Mi "
                f"{phase['peak_rss'][w] / MiB:7.0f}Mi {bound / MiB:7.0f}Mi {phase['within_bound'][w]!s:>7}   "
                f"{phase['seconds']:.1f}"
            )
        assert phase["rows"] == args.partitions * rows, (phase["name"], phase["rows"])
    summary: dict[str, Any] = {}
    for kind in methods:
        of = [p for p in runs if p["name"] == kind]
        secs = [p["seconds"] for p in of]
        cpus = [sum(p["worker_cpu_seconds"].values()) for p in of]
        peaks = [max(p["peak_rss"].values()) for p in of]
        busy = [p["disk_busy_fraction"] for p in of]
        summary[kind] = {
            "seconds": [min(secs), statistics.median(secs), max(secs)],
            "worker_cpu_seconds": [min(cpus), statistics.median(cpus), max(cpus)],
            "peak_rss_per_worker": [min(peaks), statistics.median(peaks), max(peaks)],
            "disk_busy_fraction": [min(busy), statistics.median(busy), max(busy)],
        }
        if kind == "mpshuffle":
            summary[kind]["within_bound"] = all(all(p["within_bound"].values()) for p in of)
            summary[kind]["spilled_bytes"] = [
                sum(s["bytes_spilled_disk"] for s in p["statistics"].values()) for p in of
            ]
        print(
            f"{kind}: seconds min/median/max {'/'.join(f'{v:.1f}' for v in summary[kind]['seconds'])}, workers' "
            f"CPU-s {'/'.join(f'{v:.1f}' for v in summary[kind]['worker_cpu_seconds'])}, peak MiB per worker "
            f"{'/'.join(f'{v / MiB:.0f}' for v in summary[kind]['peak_rss_per_worker'])}, disk busy "
            f"{'/'.join(f'{v:.0%}' for v in summary[kind]['disk_busy_fraction'])}"
        )
    if set(methods) == {"mpshuffle", "p2p"}:
        ratios = [
            next(p for p in runs if p["round"] == r and p["name"] == "p2p")["seconds"]
            / next(p for p in runs if p["round"] == r and p["name"] == "mpshuffle")["seconds"]
            for r in range(args.repeats)
        ]
        summary["p2p_over_mpshuffle_per_round"] = ratios
        print(f"P2P / mpshuffle seconds per round: {' '.join(f'{x:.2f}' for x in ratios)}")
    result["summary"] = summary
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2, sort_keys=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
