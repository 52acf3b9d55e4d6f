"""Dask Array rechunks with only the method changed: mpshuffle, P2P and tasks, alternated, every output checked.

Not a test. Three cases on one LocalCluster per case (``--workers`` x
``--threads``):

* ``time-to-space``: float32 ``(T, S, S)`` in chunks ``(1, S, S)`` (one time
  step per chunk) to ``(T, S/20, S/20)`` (one pixel column per chunk). The
  input is persisted first; the timing covers ``x.rechunk(...).persist()``
  until every output block is in memory.
* ``space-to-time``: the reverse, from a persisted ``(T, S/20, S/20)`` array.
* ``out-of-core``: time-to-space of an array ``--factor`` times the workers'
  memory (``--memory-limit`` each; mpshuffle's budget is its default: a
  quarter of that, at most half of what Dask's spill fraction leaves above the
  worker's baseline, recorded in the JSON), generated block by block inside the graph and checked
  block by block, never held whole: the timing covers generation, rechunk
  and check, the same work for every method.

Every output block of every timed run is compared with the values it must
hold (each element is a function of its position), inside the graph on the
workers; a run with a wrong element, or chunks other than Dask's, fails the
benchmark. The methods take turns (``--repeat`` rounds, each in a rotated
order) after one untimed small run of each. Peak memory is the cluster's
(sum of the worker processes' RSS, ``distributed``'s ``MemorySampler``,
every 0.1 s) during the run, and (``peak_rss``) the same sum read from
the worker processes every 20 ms, which the scheduler's heartbeats do not
delay; each run starts once the previous run's output is gone and the
scheduler has seen it go. CPU seconds are the workers' (user + system).

Writes ``benchmarks/results/<--name>.json`` and prints min/median/max.

Run: ``python benchmarks/rechunk_bench.py [--t 400] [--side 1000] [--repeat 3] [--cases time-to-space,...]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import dask
import dask.array as da
import numpy as np
import psutil
from distributed import Client, LocalCluster, wait
from distributed.diagnostics import MemorySampler

import mpshuffle
import mpshuffle.dask

try:
    from memory_timeline import Timeline, summary
except ImportError:  # run as a module from elsewhere
    from benchmarks.memory_timeline import Timeline, summary

METHODS = ("mpshuffle", "p2p", "tasks")
RESULTS = Path(__file__).resolve().parent / "results"
_MOD = 2**24  # values stay exact in float32


def _values(location: list[tuple[int, int]]) -> np.ndarray:
    """The elements of the array's region ``location``: ``(7919 t + 31 y + x) mod 2**24``, float32."""
    (t0, t1), (y0, y1), (x0, x1) = location
    out = np.empty((t1 - t0, y1 - y0, x1 - x0), np.float32)
    for t, yx in _slabs(location):
        out[t - t0] = yx
    return out


def _slabs(location: list[tuple[int, int]]) -> Any:
    """``(t, values of the (y, x) plane at t)`` over the region, one plane at a time.

    The plane's ``31 y + x`` (int64, < 2**24 for the sides used here) is made
    once; each plane costs one add, one modulo and one cast of ``(y, x)``
    elements, so a check or fill holds a plane's temporaries, never an int64
    copy of the whole block (8 bytes per element, twice: that was ~80 MB per
    15 MB block of the out-of-core case, on workers of 1 GiB).
    """
    (t0, t1), (y0, y1), (x0, x1) = location
    plane = np.arange(y0, y1, dtype=np.int64)[:, None] * 31 + np.arange(x0, x1, dtype=np.int64)[None, :]
    for t in range(t0, t1):
        yield t, ((plane + 7919 * t) % _MOD).astype(np.float32)


def _fill(block: np.ndarray, block_info: Any = None) -> np.ndarray:
    return _values(block_info[None]["array-location"])


def _mismatches(block: np.ndarray, block_info: Any = None) -> np.ndarray:
    (t0, _), _, _ = location = block_info[0]["array-location"]
    bad = sum(int(np.count_nonzero(block[t - t0] != yx)) for t, yx in _slabs(location))
    return np.full((1, 1, 1), bad, dtype=np.int64)


def source(shape: tuple[int, int, int], chunks: tuple[int, int, int]) -> da.Array:
    """The benchmark's array, computed block by block from positions (no input data)."""
    return da.zeros(shape, chunks=chunks, dtype=np.float32).map_blocks(_fill, dtype=np.float32)


def check(y: da.Array) -> da.Array:
    """Number of wrong elements in ``y`` (0 when right), computed on the workers block by block."""
    ones = tuple((1,) * len(c) for c in y.chunks)
    return y.map_blocks(_mismatches, dtype=np.int64, chunks=ones).sum()


def _cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def _one(
    client: Client, case: str, method: str, x: da.Array, target: tuple[int, ...], pids: list[int],
    sampler: MemorySampler, label: str, timeline: float = 0.0,
) -> dict[str, Any]:
    want = x.rechunk(target, method="tasks").chunks
    with dask.config.set({"array.rechunk.method": method}):
        y = x.rechunk(target)
    assert y.chunks == want, (method, y.chunks, want)
    _settle(client, x.name)
    cpu0 = _cpu(pids)
    tl = Timeline(client, timeline, echo=True).start() if timeline else None
    direct = _PeakRss(pids).start()
    t0 = time.perf_counter()
    failed = None
    with sampler.sample(label, client=client, measure="process", interval=0.1):
        if case == "out-of-core":
            try:
                bad = int(client.compute(check(y)).result())
            except Exception as e:  # noqa: BLE001 -- a method that fails (workers killed) is a result too
                failed, bad = f"{type(e).__name__}: {e}"[:400], 0
        else:
            z = client.persist(y)
            wait(z)
            seconds = time.perf_counter() - t0
    if case == "out-of-core":
        seconds = time.perf_counter() - t0
    cpu = _cpu(pids) - cpu0
    rss_start, rss_peak = direct.stop()
    samples = tl.stop() if tl is not None else []
    if failed is not None:
        series = sampler.to_pandas()[label].dropna()
        print(f"{case} with {method} failed after {seconds:.1f} s: {failed}", flush=True)
        # Fresh workers (and mpshuffle's generation on them) for the next run.
        client.restart()
        mpshuffle.dask.bootstrap_dask_cluster(client)
        pids[:] = list(client.run(os.getpid).values())
        # CPU seconds are not known: the workers that died took theirs with them.
        return {"method": method, "seconds": round(seconds, 3), "cpu_seconds": None,
                "peak_bytes": int(series.max()), "failed": failed, "checked": False,
                "at_peak_rss": summary(samples) if samples else {}}
    if case != "out-of-core":
        bad = int(client.compute(check(z)).result())
        del z
    if bad:
        raise SystemExit(f"{case} with {method}: {bad} wrong elements")
    series = sampler.to_pandas()[label].dropna()
    row = {
        "method": method, "seconds": round(seconds, 3), "cpu_seconds": round(cpu, 2),
        "peak_bytes": int(series.max()), "start_bytes": int(series.iloc[0]), "checked": True,
        "peak_rss_bytes": rss_peak, "start_rss_bytes": rss_start,
    }
    if samples:
        row["timeline"] = samples[::3]  # every third sample, to keep the JSON small
        row["at_peak_rss"] = summary(samples)
    return row


class _PeakRss:
    """The workers' summed RSS, read from their processes every 20 ms by a process of its own: first value and peak.

    Why beside ``MemorySampler``: that reads the workers' memory as the
    scheduler last heard it (heartbeats, ~0.5-1 s late), so it missed the
    last outputs of a run that ends soon after they are made (P2P's sampled
    peak was below its start plus its output). Why a process: a thread here
    waits for the GIL behind the schedulers of this process and missed
    short peaks under load. Nothing runs on the workers for it.
    """

    _LOOP = (
        "import os, sys, select\n"
        "pids = sys.argv[1:]; page = os.sysconf('SC_PAGE_SIZE'); values = []\n"
        "def rss():\n"
        "    total = 0\n"
        "    for p in pids:\n"
        "        try:\n"
        "            with open(f'/proc/{p}/statm') as f:\n"
        "                total += int(f.read().split()[1]) * page\n"
        "        except OSError:\n"
        "            pass\n"
        "    return total\n"
        "values.append(rss()); print('ready', flush=True)\n"
        "while not select.select([sys.stdin], [], [], 0.02)[0]:\n"
        "    values.append(rss())\n"
        "values.append(rss())\n"
        "print(values[0], max(values), flush=True)\n"
    )

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self._proc: subprocess.Popen[str] | None = None

    def start(self) -> _PeakRss:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", self._LOOP, *map(str, self.pids)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        assert self._proc.stdout is not None
        self._proc.stdout.readline()  # its first sample is taken
        return self

    def stop(self) -> tuple[int, int]:
        assert self._proc is not None
        out, _ = self._proc.communicate("stop\n")
        first, peak = (int(v) for v in out.split())
        return first, peak


def _settle(client: Client, keep: str, timeout: float = 30.0) -> None:
    """Wait until the workers hold no key but the input's (``keep``), then collect and trim their heaps.

    Why: the sampler reads the workers' memory as the scheduler last heard
    it (heartbeats), and at the start of a run that was often still the
    previous run's end, output included (the run's first sample equal to
    its peak): the run's peak was then the previous method's. So this also
    waits until the scheduler's figure has come down to the workers' RSS.
    Trimming (``malloc_trim``) gives back what the allocator kept of freed
    memory, for every method alike.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        held = [k for keys in client.has_what().values() for k in keys
                if not (isinstance(k, tuple) and k[0] == keep)]
        if not held:
            break
        time.sleep(0.1)
    client.run(_trim)
    # The sampler reads the scheduler's view of each worker's memory, which
    # heartbeats update: wait until it has seen the memory given back.
    while time.monotonic() < deadline:
        rss = sum(client.run(_rss).values())
        seen = client.run_on_scheduler(_process_memory)
        if seen <= rss * 1.02 + 2**24:
            break
        time.sleep(0.1)


def _rss() -> int:
    return int(psutil.Process().memory_info().rss)


def _process_memory(dask_scheduler: Any = None) -> int:
    return int(sum(ws.memory.process for ws in dask_scheduler.workers.values()))


def _trim() -> None:
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def run_case(case: str, args: argparse.Namespace) -> dict[str, Any]:
    t, side = args.t, args.side
    small = side // 20
    limit = args.memory_limit if case == "out-of-core" else "16GiB"
    if case == "out-of-core":
        per_step = side * side * 4
        t = max(1, int(args.factor * args.workers * dask.utils.parse_bytes(limit) / per_step))
    shape = (t, side, side)
    rows: list[dict[str, Any]] = []
    methods = tuple(args.methods.split(","))
    with tempfile.TemporaryDirectory(prefix="mpshuffle-rechunk-bench-") as tmp, LocalCluster(
        n_workers=args.workers, threads_per_worker=args.threads, processes=True,
        dashboard_address=":0", memory_limit=limit, local_directory=tmp,
    ) as cluster, Client(cluster) as client:
        pids = list(client.run(os.getpid).values())
        mpshuffle.dask.bootstrap_dask_cluster(client)
        budgets: list[Any] = []
        seen: set[tuple[Any, ...]] = set()
        sampler = MemorySampler()
        # Untimed warm-up of each method on a small array.
        warm = source((8, 40, 40), (1, 40, 40)).persist()
        for m in methods:
            with dask.config.set({"array.rechunk.method": m}):
                assert int(client.compute(check(warm.rechunk((8, 2, 2)))).result()) == 0
        del warm
        if case == "time-to-space":
            x, target = source(shape, (1, side, side)).persist(), (t, small, small)
        elif case == "space-to-time":
            x, target = source(shape, (t, small, small)).persist(), (1, side, side)
        else:
            x, target = source(shape, (1, side, side)), (t, small, small)
        if case != "out-of-core":
            wait(x)
        for r in range(args.repeat):
            order = methods[r % len(methods) :] + methods[: r % len(methods)]
            for m in order:
                row = _one(client, case, m, x, target, pids, sampler, f"{case}-{m}-{r}", args.timeline)
                row["round"] = r
                if m == "mpshuffle" and not row.get("failed"):
                    stats = mpshuffle.dask.gather_statistics(client)
                    runs = [s for per in stats.values() for s in per
                            if (s["generation"], s["op_id"], s["rank"]) not in seen]  # this run's only
                    seen.update((s["generation"], s["op_id"], s["rank"]) for s in runs)
                    row["bytes_spilled_disk"] = sum(s["bytes_spilled_disk"] for s in runs)
                    budgets = sorted({s["options"]["host_budget"] for s in runs if s.get("options")})
                rows.append(row)
                print(f"{case:14s} round {r} {m:9s} {row['seconds']:7.2f} s  cpu {row['cpu_seconds'] or 0:6.1f} s  "
                      f"peak {row['peak_bytes'] / 2**30:5.2f} GiB  rss {row.get('peak_rss_bytes', 0) / 2**30:5.2f} GiB", flush=True)
    summary: dict[str, Any] = {}
    for m in methods:
        mine = [r for r in rows if r["method"] == m and not r.get("failed")]
        if not mine:
            summary[m] = {"failed": [r["failed"] for r in rows if r["method"] == m]}
            continue
        secs = [r["seconds"] for r in mine]
        peaks = [r["peak_bytes"] for r in mine]
        summary[m] = {
            "seconds": {"min": min(secs), "median": statistics.median(secs), "max": max(secs)},
            "peak_gib": {"min": round(min(peaks) / 2**30, 2), "median": round(statistics.median(peaks) / 2**30, 2),
                         "max": round(max(peaks) / 2**30, 2)},
            "peak_rss_gib": {"min": round(min(r["peak_rss_bytes"] for r in mine) / 2**30, 2),
                             "median": round(statistics.median(r["peak_rss_bytes"] for r in mine) / 2**30, 2),
                             "max": round(max(r["peak_rss_bytes"] for r in mine) / 2**30, 2)},
            "cpu_seconds_median": statistics.median(r["cpu_seconds"] for r in mine),
            "failed_runs": sum(1 for r in rows if r["method"] == m and r.get("failed")),
        }
    for m in (m for m in methods if m != "mpshuffle"):
        # Per round, the other method's time over mpshuffle's (pairs from the same round).
        ok = {(r["method"], r["round"]): r["seconds"] for r in rows if not r.get("failed")}
        ratios = [ok[m, k] / ok["mpshuffle", k] for k in range(args.repeat) if (m, k) in ok and ("mpshuffle", k) in ok]
        if ratios:
            summary[f"x_{m}"] = {"min": round(min(ratios), 2), "median": round(statistics.median(ratios), 2),
                                 "max": round(max(ratios), 2)}
    return {
        "case": case, "shape": list(shape), "dtype": "float32", "bytes": int(np.prod(shape)) * 4,
        "memory_limit_per_worker": limit, "host_budget_per_worker": budgets, "rows": rows, "summary": summary,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--t", type=int, default=400, help="time steps of the in-memory cases")
    parser.add_argument("--side", type=int, default=1000, help="spatial side S (a multiple of 20)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--memory-limit", default="1GiB", help="per worker, out-of-core case")
    parser.add_argument("--factor", type=float, default=3.0, help="out-of-core array / workers' memory")
    parser.add_argument("--cases", default="time-to-space,space-to-time,out-of-core")
    parser.add_argument("--methods", default=",".join(METHODS), help="methods to alternate (mpshuffle first)")
    parser.add_argument("--timeline", type=float, default=0.0,
                        help="sample every worker's memory every this many seconds (memory_timeline.py); 0: off")
    parser.add_argument("--name", default="rechunk")
    parser.add_argument("--out", default=str(RESULTS), help="directory of the JSON result")
    args = parser.parse_args()
    results = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "load_average_start": os.getloadavg()},
        "versions": {"mpshuffle": mpshuffle.__version__, "dask": dask.__version__,
                     "numpy": np.__version__},
        "workers": args.workers, "threads_per_worker": args.threads, "repeat": args.repeat,
        "cases": [],
    }
    for case in args.cases.split(","):
        results["cases"].append(run_case(case, args))
        s = results["cases"][-1]["summary"]
        print(json.dumps({case: s}), flush=True)
    results["machine"]["load_average_end"] = os.getloadavg()
    out = Path(args.out) / f"{args.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
