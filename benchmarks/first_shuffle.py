"""Where the first shuffle of a fresh cluster spends its time, stage by stage.

Not a test. Starts a fresh LocalCluster (2 workers x 1 thread, ``memory_limit``
8 GiB, as ``mpshuffle bench``), bootstraps mpshuffle, runs the bench's 2 MB
warm-up, persists the bench's synthetic input and shuffles it ``--repeats``
times with mpshuffle (``--p2p``: a Dask P2P shuffle first, as a baseline of the
same run). Before anything runs, every worker gets:

* wrappers that add, per stage, the calling thread's user and system
  CPU-seconds and minor page faults (``getrusage(RUSAGE_THREAD)``) around
  the insert's hash (``hash_ids``), scatter (``pack``), send (``Shuffler.insert``),
  the progress thread's ``Shuffler.receive`` and the extract's ``unpack``
  (concatenate + ``to_pandas``); the first ``kernels()`` load is timed apart;
* a thread that wakes every 10 ms and records the largest gap between its
  wake-ups less the time it waited on a run queue (``/proc/thread-self/schedstat``):
  how long something held the GIL, apart from other load on the machine.

Per shuffle it prints the wall time, the workers' user/system CPU-seconds and
minor faults (``/proc/PID/stat``), the machine's THP and compaction counters
(``/proc/vmstat``), the stages and the largest GIL gap. Figures are summed
over both workers.

To tell the kernel's page state from mpshuffle's own: ``--churn GB`` has every
worker touch and free that much memory just before each shuffle (so the
kernel's free lists hold pages just used), ``--sleep S`` rests before each
shuffle; ``--no-warmup`` drops the warm-up shuffle and ``--implicit-bootstrap``
the explicit bootstrap, so the first timed shuffle is a user's first.

Run: ``python benchmarks/first_shuffle.py [--gb 2.07] [--repeats 2] [--p2p] [--json PATH]``
(Linux only; options such as ``DASK_MPSHUFFLE__...`` come from the environment).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

_VMSTAT = ("thp_fault_alloc", "thp_fault_fallback", "compact_stall", "compact_success", "pgfault")


def install_probes() -> None:
    """Wrap the engine's stages with per-thread CPU and fault counters; start the GIL ticker (in a worker)."""
    import resource
    import sys
    import threading
    import types

    import mpshuffle.table._columns as columns
    import mpshuffle.table.pandas as pandas_adapter
    from mpshuffle.shuffler import host

    if "mpshuffle_probe" in sys.modules:
        return
    probe = types.ModuleType("mpshuffle_probe")
    probe.stages = {}  # type: ignore[attr-defined]
    probe.gap = 0.0  # type: ignore[attr-defined]
    lock = threading.Lock()
    sys.modules["mpshuffle_probe"] = probe

    def wrap(owner: Any, name: str, stage: str) -> None:
        fn = getattr(owner, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            r0 = resource.getrusage(resource.RUSAGE_THREAD)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                r1 = resource.getrusage(resource.RUSAGE_THREAD)
                with lock:
                    s = probe.stages.setdefault(stage, [0, 0.0, 0.0, 0.0, 0, 0.0])  # type: ignore[attr-defined]
                    s[0] += 1
                    s[1] += r1.ru_utime - r0.ru_utime
                    s[2] += r1.ru_stime - r0.ru_stime
                    s[3] += time.perf_counter() - t0
                    s[4] += r1.ru_minflt - r0.ru_minflt
                    s[5] = max(s[5], time.perf_counter() - t0)

        setattr(owner, name, wrapped)

    wrap(pandas_adapter, "hash_ids", "hash")
    wrap(pandas_adapter, "pack", "scatter")
    wrap(columns, "kernels", "kernels load")
    wrap(host.Shuffler, "insert", "send")
    wrap(host.Shuffler, "receive", "receive")
    wrap(pandas_adapter.PandasAdapter, "unpack", "extract")

    def run_delay() -> float:
        # Seconds this thread waited on a run queue (runnable, no CPU free).
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9

    def tick() -> None:
        # A gap the thread spent runnable is the machine's other load, not
        # the GIL: subtract its run-queue wait.
        last, waited = time.perf_counter(), run_delay()
        while True:
            time.sleep(0.01)
            now, w = time.perf_counter(), run_delay()
            probe.gap = max(probe.gap, now - last - 0.01 - (w - waited))  # type: ignore[attr-defined]
            last, waited = now, w

    threading.Thread(target=tick, name="gil-ticker", daemon=True).start()


def read_probes(reset: bool = True) -> dict[str, Any]:
    """This worker's stages and largest GIL gap since the last reset, and its process counters."""
    import sys

    probe = sys.modules["mpshuffle_probe"]
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    out = {
        "stages": {k: list(v) for k, v in probe.stages.items()},  # type: ignore[attr-defined]
        "gil_gap": probe.gap,  # type: ignore[attr-defined]
        "minflt": int(fields[7]),
        "user": int(fields[11]) / tick,
        "system": int(fields[12]) / tick,
    }
    if reset:
        probe.stages = {}  # type: ignore[attr-defined]
        probe.gap = 0.0  # type: ignore[attr-defined]
    return out


def churn(nbytes: int) -> None:
    """Touch ``nbytes`` of fresh memory and free it (so the kernel holds recently used pages)."""
    import numpy as np

    a = np.ones(nbytes, np.uint8)
    del a


def vmstat() -> dict[str, int]:
    """The machine's THP and compaction counters."""
    out = {}
    with open("/proc/vmstat") as f:
        for line in f:
            k, v = line.split()
            if k in _VMSTAT:
                out[k] = int(v)
    return out


def _sum(snaps: dict[str, dict[str, Any]], before: dict[str, dict[str, Any]]) -> dict[str, Any]:
    stages: dict[str, list[float]] = {}
    for s in snaps.values():
        for k, v in s["stages"].items():
            acc = stages.setdefault(k, [0, 0.0, 0.0, 0.0, 0, 0.0])
            for i in range(5):
                acc[i] += v[i]
            acc[5] = max(acc[5], v[5])
    return {
        "user": sum(s["user"] - before[w]["user"] for w, s in snaps.items()),
        "system": sum(s["system"] - before[w]["system"] for w, s in snaps.items()),
        "minflt": sum(s["minflt"] - before[w]["minflt"] for w, s in snaps.items()),
        "gil_gap": max(s["gil_gap"] for s in snaps.values()),
        "stages": stages,
    }


def main() -> None:
    """Run the shuffles and print where their time went."""
    from distributed import Client, LocalCluster, wait

    from mpshuffle.dask import bootstrap_dask_cluster, shuffle
    from mpshuffle.demo.bench import _synthetic

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=2.07)
    p.add_argument("--partitions", type=int, default=60)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--p2p", action="store_true", help="a P2P shuffle first, as a same-run baseline")
    p.add_argument("--sleep", type=float, default=1.0, help="seconds of rest before each shuffle")
    p.add_argument("--churn", type=float, default=0.0,
                   help="GB each worker touches and frees just before each shuffle (recycled memory)")
    p.add_argument("--no-warmup", action="store_true",
                   help="no 2 MB warm-up shuffle (the bench's) before the timed ones: the first is a user's first")
    p.add_argument("--implicit-bootstrap", action="store_true",
                   help="no bootstrap_dask_cluster call: the first shuffle's graph bootstraps (as a user's does)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    results: dict[str, Any] = {"args": vars(args), "load": os.getloadavg(), "runs": []}
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, memory_limit="8GiB", dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        client.run(install_probes)
        print("worker pids", sorted(client.run(os.getpid).values()), flush=True)
        if not args.implicit_bootstrap:
            t0 = time.perf_counter()
            bootstrap_dask_cluster(client)
            results["bootstrap_seconds"] = time.perf_counter() - t0
            print(f"bootstrap {results['bootstrap_seconds']:.2f} s")
        if not args.no_warmup:
            warm, _ = _synthetic(0.002, 4)
            warm = warm.persist()
            wait(warm)
            before = client.run(read_probes)
            t0 = time.perf_counter()
            wait(shuffle(warm, "key", npartitions=4, ignore_index=True).persist())
            warmup = _sum(client.run(read_probes), before)
            warmup["seconds"] = time.perf_counter() - t0
            results["warmup"] = warmup
            print(f"warm-up {warmup['seconds']:.2f} s, largest GIL gap {warmup['gil_gap'] * 1e3:.0f} ms, "
                  f"stages {warmup['stages']}")
            del warm
        df, on = _synthetic(args.gb, args.partitions)
        df = df.persist()
        wait(df)
        gb = client.compute(df.memory_usage(deep=True).sum()).result() / 1e9
        methods = (["p2p"] if args.p2p else []) + ["mpshuffle"] * args.repeats
        for i, method in enumerate(methods):
            time.sleep(args.sleep)
            if args.churn:
                client.run(churn, int(args.churn * 1e9))
            before = client.run(read_probes)
            vm0 = vmstat()
            load = os.getloadavg()[0]
            t0 = time.perf_counter()
            mono0 = time.monotonic()
            if method == "p2p":
                out = df.shuffle(on, npartitions=args.partitions, ignore_index=True, shuffle_method="p2p")
            else:
                out = shuffle(df, on, npartitions=args.partitions, ignore_index=True)
            out = out.persist()
            wait(out)
            seconds = time.perf_counter() - t0
            r = _sum(client.run(read_probes), before)
            vm1 = vmstat()
            r["perf_window"] = (mono0, time.monotonic())
            r.update(method=method, seconds=seconds, mb_per_s=gb * 1e3 / seconds, load=load,
                     vmstat={k: vm1[k] - vm0[k] for k in vm0})
            results["runs"].append(r)
            del out
            print(f"run {i} {method}: {seconds:.2f} s ({gb * 1e3 / seconds:.0f} MB/s, load {load:.1f}), "
                  f"CPU user {r['user']:.2f} s system {r['system']:.2f} s, minflt {r['minflt'] / 1e6:.2f} M, "
                  f"GIL gap {r['gil_gap'] * 1e3:.0f} ms, vmstat {r['vmstat']}, monotonic {mono0:.3f},{time.monotonic():.3f}")
            for k, v in sorted(r["stages"].items()):
                print(f"    {k:13} n={v[0]:4d} user {v[1]:6.2f} sys {v[2]:6.2f} wall {v[3]:6.2f} "
                      f"minflt {v[4] / 1e3:8.0f} k  longest {v[5]:.3f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
