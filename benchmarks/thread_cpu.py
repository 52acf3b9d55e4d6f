"""CPU time of each worker thread during mpshuffle shuffles, user and system apart.

Not a test. On a LocalCluster of 2 workers x 1 thread (``memory_limit`` 8 GiB)
it shuffles the benchmark's synthetic data (``mpshuffle.demo.bench.make_synthetic``,
60 -> 60 partitions) once untimed and then ``repeats`` times, reading every
worker thread's user and system CPU time from ``/proc/self/task`` before and
after each shuffle. Threads are grouped by name: the Dask task threads, the
worker's event loop (``MainThread``), mpshuffle's progress thread, and
unnamed native threads (``python``: Arrow's or numba's pools). Figures are
CPU-seconds per GB of input, summed over both workers, so where the time
goes shows even on a loaded machine. Options such as
``DASK_MPSHUFFLE__SHARED_MEMORY=false`` come from the environment.

Run: ``python benchmarks/thread_cpu.py [--gb 0.5] [--repeats 3]`` (Linux only).
"""

from __future__ import annotations

import argparse
import collections
import os
import threading
import time
from typing import Any

_GROUPS = ("mpshuffle-progress", "Dask-Default-Threads", "ThreadPoolExecutor", "MainThread", "Profile")


def snapshot() -> dict[int, tuple[str, int, int]]:
    """Every thread of this process: native id -> (name, user ticks, system ticks)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(tid)] = (names.get(int(tid), comm), int(fields[11]), int(fields[12]))
    return out


def _group(name: str) -> str:
    for g in _GROUPS:
        if g in name:
            return g
    return name


def main() -> None:
    """Run the shuffles and print CPU-s/GB per thread group."""
    import dask.dataframe as dd
    from distributed import Client, LocalCluster, wait

    from mpshuffle.dask import bootstrap_dask_cluster, shuffle
    from mpshuffle.demo.bench import make_synthetic

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=0.5)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    nparts = 60
    tick = os.sysconf("SC_CLK_TCK")
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, memory_limit="8GiB", dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        rows = int(args.gb * 1e9 / 43 / nparts)
        df = dd.from_map(lambda i: make_synthetic(i, rows, 10**9), list(range(nparts))).persist()
        wait(df)
        gb = client.compute(df.memory_usage(deep=True, index=True).sum()).result() / 1e9
        bootstrap_dask_cluster(client)
        wait(shuffle(df, "key", npartitions=nparts, ignore_index=True).persist())
        for r in range(args.repeats):
            before = client.run(snapshot)
            t0 = time.perf_counter()
            out = shuffle(df, "key", npartitions=nparts, ignore_index=True).persist()
            wait(out)
            seconds = time.perf_counter() - t0
            after = client.run(snapshot)
            del out
            total: collections.Counter[tuple[str, str]] = collections.Counter()
            for w, threads in after.items():
                for tid, (name, user, system) in threads.items():
                    _, u0, s0 = before[w].get(tid, (name, 0, 0))
                    total[(_group(name), "user")] += (user - u0) / tick / gb
                    total[(_group(name), "sys")] += (system - s0) / tick / gb
            user = sum(v for (_, k), v in total.items() if k == "user")
            system = sum(v for (_, k), v in total.items() if k == "sys")
            print(f"run {r}: {seconds:.2f} s, {gb * 1e3 / seconds:.0f} MB/s, "
                  f"{user + system:.2f} CPU-s/GB (user {user:.2f}, system {system:.2f})")
            groups: Any = sorted({g for g, _ in total})
            for g in groups:
                u, s = total[(g, "user")], total[(g, "sys")]
                if u + s >= 0.01:
                    print(f"    {g:24} user {u:.2f}  system {s:.2f}")
            time.sleep(1)


if __name__ == "__main__":
    main()
