"""Where a rechunk's time goes on the workers: per-thread CPU, Dask's task stream by prefix, py-spy.

Not a test. One LocalCluster (``--workers`` x 1 thread of 16 GiB), the
``rechunk_bench`` input persisted, ``--repeat`` rechunks per method in turns
(methods alternated). Per run: wall seconds, every worker thread's user and
system CPU (``/proc/self/task`` read on the workers before and after, grouped
by thread name) and, from Dask's task stream, per key prefix the tasks and
their summed compute seconds. With ``--py-spy DIR`` the mpshuffle runs are
recorded by ``py-spy record`` on every worker process (raw collapsed stacks
per worker, ``--threads``).

Run: ``python benchmarks/rechunk_profile.py time-to-space --t 400 --repeat 2 [--py-spy /tmp/rp]``
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cloudpickle
import dask
import thread_cpu
from distributed import Client, LocalCluster, wait
from rechunk_bench import check, source

import mpshuffle.dask

# Workers run thread_cpu.snapshot through client.run and cannot import the benchmarks folder.
cloudpickle.register_pickle_by_value(thread_cpu)


def _group(name: str) -> str:
    for g in ("mpshuffle-progress", "Dask-Default-Threads", "MainThread", "Profile", "Dask-Offload"):
        if name.startswith(g):
            return g
    return "other:" + name.split("-")[0]


def _delta(before: dict[int, Any], after: dict[int, Any]) -> dict[str, list[float]]:
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for tid, (name, u, s) in after.items():
        _, u0, s0 = before.get(tid, (name, 0, 0))
        g = out[_group(name)]
        g[0] += (u - u0) / tick
        g[1] += (s - s0) / tick
    return {k: [round(v[0], 2), round(v[1], 2)] for k, v in out.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("case", choices=("time-to-space", "space-to-time"))
    p.add_argument("--t", type=int, default=400)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--side", type=int, default=1000, help="spatial side S (a multiple of 20)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--methods", default="mpshuffle,p2p")
    p.add_argument("--partition-mib", type=float, default=0,
                   help="output partition size of mpshuffle's graph (rechunk.PARTITION_BYTES; 0: the default)")
    p.add_argument("--py-spy", default="")
    p.add_argument("--perf", default="", help="record mpshuffle runs with perf into this directory")
    p.add_argument("--out", default="")
    a = p.parse_args()
    if a.partition_mib:
        import mpshuffle.dask.rechunk as rc

        rc.PARTITION_BYTES = int(a.partition_mib * 2**20)
    side, small = a.side, a.side // 20
    rows = []
    with tempfile.TemporaryDirectory() as tmp, LocalCluster(
        n_workers=a.workers, threads_per_worker=1, processes=True, dashboard_address=":0",
        memory_limit="16GiB", local_directory=tmp,
    ) as cluster, Client(cluster) as client:
        pids = list(client.run(os.getpid).values())
        mpshuffle.dask.bootstrap_dask_cluster(client)
        warm = source((8, 40, 40), (1, 40, 40)).persist()
        for m in a.methods.split(","):
            with dask.config.set({"array.rechunk.method": m}):
                assert int(client.compute(check(warm.rechunk((8, 2, 2)))).result()) == 0
        if a.case == "time-to-space":
            x, target = source((a.t, side, side), (1, side, side)).persist(), (a.t, small, small)
        else:
            x, target = source((a.t, side, side), (a.t, small, small)).persist(), (1, side, side)
        wait(x)
        methods = a.methods.split(",")
        for r in range(a.repeat):
            for m in methods[r % len(methods):] + methods[: r % len(methods)]:
                with dask.config.set({"array.rechunk.method": m}):
                    y = x.rechunk(target)
                spies = []
                if a.py_spy and m == "mpshuffle":
                    for pid in pids:
                        spies.append(subprocess.Popen(
                            [os.path.join(os.path.dirname(sys.executable), "py-spy"), "record", "--pid", str(pid),
                             "--threads", "--rate", "200", "--format", "raw", "--nonblocking",
                             "-o", f"{a.py_spy}/{a.case}-{r}-{pid}.txt"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                    time.sleep(1.0)
                if a.perf and m == "mpshuffle":
                    spies.append(subprocess.Popen(
                        ["perf", "record", "-F", "499", "-g", "-p", ",".join(map(str, pids)),
                         "-o", f"{a.perf}/{a.case}-{r}.data"],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                    time.sleep(0.5)
                before = client.run(thread_cpu.snapshot)
                client.get_task_stream(start=time.time())  # clear nothing; mark start
                t0 = time.time()
                z = y.persist()
                wait(z)
                seconds = time.time() - t0
                after = client.run(thread_cpu.snapshot)
                stream = client.get_task_stream(start=t0)
                for s in spies:
                    s.send_signal(2)
                for s in spies:
                    s.wait()
                assert int(client.compute(check(z)).result()) == 0
                del z
                prefix: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
                for ts in stream:
                    pre = ts["key"][0] if isinstance(ts["key"], tuple) else ts["key"]
                    pre = pre.rsplit("-", 1)[0] if "-" in pre else pre
                    comp = sum(s["stop"] - s["start"] for s in ts["startstops"] if s["action"] == "compute")
                    prefix[pre][0] += 1
                    prefix[pre][1] += comp
                threads = {w: _delta(before[w], after[w]) for w in after}
                row = {"method": m, "round": r, "seconds": round(seconds, 3),
                       "threads": threads,
                       "prefixes": {k: [v[0], round(v[1], 3)] for k, v in prefix.items()}}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"case": a.case, "t": a.t, "load_end": os.getloadavg(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
