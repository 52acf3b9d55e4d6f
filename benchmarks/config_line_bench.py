"""The path a Dask user takes: ``df.shuffle`` with the shuffle method set by one config line.

Not a test. One ``LocalCluster`` (``--workers`` x 1 thread, ``--memory-limit``
each), one persisted input, and these ways of shuffling it, taking turns
(``--repeats`` rounds, each in a rotated order, after one untimed warm-up of
each on a small frame unless ``--no-warmup``):

* ``config``: ``dask.config.set({"dataframe.shuffle.method": "mpshuffle"})``
  and ``df.shuffle(on, npartitions=P)``: what a Dask user runs after
  ``import mpshuffle.dask``;
* ``function``: mpshuffle's own ``mpshuffle.dask.shuffle(df, on, npartitions=P)``;
* ``p2p``, ``tasks``: ``df.shuffle`` with Dask's own methods.

Every method is given ``ignore_index=True``. Each timing runs from building
the collection until its output is persisted (``distributed.wait``); the
input's size is its in-memory size (``memory_usage(deep=True)``, 10**6
bytes for MB); CPU seconds are the workers' user + system over the run.
Rows are counted after every run.

Data (``--data synthetic``, the default): ``--partitions`` partitions of
``--rows`` rows: ``key`` int64 uniform over ``[0, 2**40)``, ``x``, ``y``
float64, ``s`` a ``str`` column of unique 12-character values (60 x 800,000
rows are 2.11 GB). ``--data lineitem``: TPC-H ``lineitem`` of ``--sf``
(``tpchgen-cli``, the ``demo`` extra), one partition per parquet part,
shuffled on ``l_orderkey``, read by ``mpshuffle.demo.tpch.load_parquet``
(decimals as ``float64``, dates as ``datetime64[ms]``, strings as ``str``);
``--data lineitem-dask``: the same files as ``dask.dataframe.read_parquet``
gives them to a Dask user (``decimal128(15, 2)[pyarrow]``,
``date32[day][pyarrow]``, ``str`` over Arrow large strings).

``--first`` adds a fresh cluster per method before the rounds: its first
shuffle (no warm-up; mpshuffle bootstraps within it) and the next one, in
the order ``--methods`` names them (``MemTotal`` of ``/proc/meminfo`` is
recorded before each). On a VM whose memory grows as it is first used (the
lent GPU machine: about 3 s per 8 GiB), whichever method runs first on a
bare machine pays that growth; ``--pregrow-gib N`` has a child process touch
and free N GiB before anything else, so no method pays it.

Writes ``--out`` (JSON: every run, min/median/max per method, the ratios,
machine and versions) and prints a table.

Run: ``python benchmarks/config_line_bench.py [--repeats 3] [--first] [--out PATH]``
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
import dask.dataframe as dd
import numpy as np
import pandas as pd
import psutil
import pyarrow as pa
from distributed import Client, LocalCluster, wait

import mpshuffle
import mpshuffle.dask

try:  # run as a script from the repository root or from benchmarks/
    from partitions_bench import _Sampler
except ImportError:  # pragma: no cover
    from benchmarks.partitions_bench import _Sampler

METHODS = ("config", "function", "p2p", "tasks")


def make_partition(i: int, rows: int) -> pd.DataFrame:
    """Partition ``i``: int64 key over ``[0, 2**40)``, two float64, unique 12-character strings."""
    rng = np.random.default_rng(i)
    ids = np.arange(rows, dtype=np.int64) + i * rows
    powers = 10 ** np.arange(11, -1, -1, dtype=np.int64)
    digits = ((ids[:, None] // powers) % 10 + ord("0")).astype(np.uint8)
    strings = pa.Array.from_buffers(
        pa.large_string(), rows,
        [None, pa.py_buffer(np.arange(0, 12 * rows + 1, 12, dtype=np.int64)), pa.py_buffer(digits)],
    )
    frame = pa.table({
        "key": rng.integers(0, 2**40, rows, dtype=np.int64),
        "x": rng.random(rows),
        "y": rng.standard_normal(rows),
        "s": strings,
    }).to_pandas()
    return frame


def synthetic(partitions: int, rows: int) -> tuple[dd.DataFrame, str]:
    return dd.from_map(make_partition, list(range(partitions)), [rows] * partitions), "key"


def _lineitem_files(sf: float, parts: int, directory: Path) -> list[str]:
    from mpshuffle.demo.tpch import generate

    root = generate(sf, directory, parts=parts, tables=("lineitem",))
    path = Path(root, "lineitem")
    return sorted(str(p) for p in path.glob("*.parquet")) if path.is_dir() else [str(Path(root, "lineitem.parquet"))]


def lineitem(sf: float, parts: int, directory: Path) -> tuple[dd.DataFrame, str]:
    from mpshuffle.demo.tpch import load_parquet

    return dd.from_map(load_parquet, _lineitem_files(sf, parts, directory)), "l_orderkey"


def lineitem_dask(sf: float, parts: int, directory: Path) -> tuple[dd.DataFrame, str]:
    """lineitem as ``dask.dataframe.read_parquet`` gives it: decimals, ``date32[pyarrow]``, Arrow strings."""
    return dd.read_parquet(_lineitem_files(sf, parts, directory)), "l_orderkey"


def shuffled(method: str, df: dd.DataFrame, on: str, npartitions: int) -> dd.DataFrame:
    if method == "function":
        return mpshuffle.dask.shuffle(df, on, npartitions=npartitions, ignore_index=True)
    dask_method = "mpshuffle" if method == "config" else method
    with dask.config.set({"dataframe.shuffle.method": dask_method}):
        out = df.shuffle(on, npartitions=npartitions, ignore_index=True)
        # Lower while the method is set: persist optimizes the expression.
        return out.optimize()


def _cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def run_once(client: Client, df: dd.DataFrame, on: str, npartitions: int, method: str,
             nbytes: int, rows: int, *, trim: bool = True, sample: float = 0.02) -> dict[str, Any]:
    pids = list(client.run(os.getpid).values())
    before = sum(psutil.Process(p).memory_info().rss for p in pids)
    cpu0, t0 = _cpu(pids), time.perf_counter()
    with _Sampler(pids, sample if sample > 0 else 3600.0) as sampler:
        out = shuffled(method, df, on, npartitions).persist()
        wait(out)
    seconds = time.perf_counter() - t0
    cpu = _cpu(pids) - cpu0
    names = {str(k[0] if isinstance(k, tuple) else k).split("-")[0] for k in out.__dask_keys__()}
    got = int(out.map_partitions(len).compute().sum())
    if got != rows:
        raise RuntimeError(f"{method} returned {got} rows of {rows}")
    del out
    if trim:
        client.run(_trim)
    return {"method": method, "seconds": seconds, "mb_per_s": nbytes / 1e6 / seconds,
            "worker_cpu_seconds": cpu, "worker_cpu_s_per_gb": cpu / (nbytes / 1e9),
            # The workers' largest summed RSS during the run (samples every
            # 20 ms; the persisted input and output included), and its rise.
            "peak_rss_gb": sampler.peak / 1e9, "peak_rise_gb": (sampler.peak - before) / 1e9,
            "output_key_prefixes": sorted(names), "load_average_1min": os.getloadavg()[0]}


def _trim() -> None:
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def stats(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in METHODS:
        rs = [r for r in runs if r["method"] == m]
        if rs:
            out[m] = {k: stats([r[k] for r in rs]) for k in (
                "seconds", "mb_per_s", "worker_cpu_s_per_gb", "peak_rss_gb", "peak_rise_gb") if k in rs[0]}
    if "config" in out:
        med = out["config"]["mb_per_s"]["median"]
        out["ratios_of_medians"] = {
            f"config/{m}": med / out[m]["mb_per_s"]["median"] for m in METHODS[1:] if m in out
        }
        # config time / function time, as the issue states its mark (<= 1.1).
        if "function" in out:
            out["ratios_of_medians"]["config_time/function_time"] = (
                out["config"]["seconds"]["median"] / out["function"]["seconds"]["median"])
    return out


def _cluster(args: argparse.Namespace) -> tuple[LocalCluster, Client]:
    cluster = LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                           memory_limit=f"{args.memory_limit}GiB", dashboard_address=":0")
    return cluster, Client(cluster)


def _input(args: argparse.Namespace, tmp: str) -> tuple[dd.DataFrame, str]:
    if args.data == "lineitem":
        return lineitem(args.sf, args.parts, Path(tmp) / "lineitem")
    if args.data == "lineitem-dask":
        return lineitem_dask(args.sf, args.parts, Path(tmp) / "lineitem")
    return synthetic(args.partitions, args.rows)


def _mem_total_gib() -> float | None:
    """``MemTotal`` of ``/proc/meminfo`` in GiB (``None`` where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _pregrow(gib: float) -> None:
    """Touch ``gib`` GiB in a child process and let it exit (the VM keeps the memory it grew by)."""
    code = f"import numpy as np; a = np.ones(int({gib} * 2**30) // 8); print(a[-1])"
    subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", choices=["synthetic", "lineitem", "lineitem-dask"], default="synthetic")
    parser.add_argument("--partitions", type=int, default=60, help="input and output partitions (synthetic)")
    parser.add_argument("--rows", type=int, default=800_000, help="rows per partition (synthetic)")
    parser.add_argument("--sf", type=float, default=1.0, help="TPC-H scale factor (lineitem)")
    parser.add_argument("--parts", type=int, default=16, help="parquet parts = partitions (lineitem)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--memory-limit", type=float, default=8.0, help="GiB per worker")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--no-warmup", action="store_true")
    parser.add_argument("--first", action="store_true",
                        help="also: a fresh cluster per method, its first and second shuffle")
    parser.add_argument("--pregrow-gib", type=float, default=0.0,
                        help="touch and free this much memory in a child process first (a VM that grows on use)")
    parser.add_argument("--no-trim", action="store_true",
                        help="leave the workers' freed memory with malloc (no gc.collect + malloc_trim after each run)")
    parser.add_argument("--sample", type=float, default=0.02,
                        help="seconds between samples of the workers' RSS (0: one sample at the start)")
    parser.add_argument("--out", default=str(Path(__file__).with_name("results") / "config_line.json"))
    args = parser.parse_args()
    methods = list(dict.fromkeys(args.methods))
    mem_total = {"start": _mem_total_gib()}
    if args.pregrow_gib > 0:
        _pregrow(args.pregrow_gib)
        mem_total["after_pregrow"] = _mem_total_gib()
    results: dict[str, Any] = {
        "args": vars(args),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "processor": platform.processor(),
                    "memory_gib": round(psutil.virtual_memory().total / 2**30, 1)},
        "versions": {"mpshuffle": mpshuffle.__version__, "dask": dask.__version__,
                     "pandas": pd.__version__, "pyarrow": pa.__version__, "numpy": np.__version__,
                     "python": platform.python_version()},
    }
    with tempfile.TemporaryDirectory(prefix="mpshuffle-config-line-") as tmp:
        df, on = _input(args, tmp)
        npartitions = df.npartitions
        if args.first:
            first: dict[str, list[dict[str, Any]]] = {}
            for m in methods:
                mem_total[f"before_first_{m}"] = _mem_total_gib()
                cluster, client = _cluster(args)
                with cluster, client:
                    data = df.persist()
                    wait(data)
                    nbytes = int(data.memory_usage(deep=True).sum().compute())
                    rows = int(data.map_partitions(len).compute().sum())
                    first[m] = [run_once(client, data, on, npartitions, m, nbytes, rows) for _ in range(2)]
                    print(f"fresh cluster {m:9s} first {first[m][0]['mb_per_s']:7.0f} MB/s, "
                          f"second {first[m][1]['mb_per_s']:7.0f} MB/s", flush=True)
                    del data
            results["first_of_fresh_cluster"] = first
        results["mem_total_gib"] = mem_total
        cluster, client = _cluster(args)
        with cluster, client:
            if not args.no_warmup:
                small, son = synthetic(4, 5_000)
                small = small.persist()
                wait(small)
                for m in methods:
                    run_once(client, small, son, 4, m, 1, 20_000)
                del small
            data = df.persist()
            wait(data)
            nbytes = int(data.memory_usage(deep=True).sum().compute())
            rows = int(data.map_partitions(len).compute().sum())
            results.update(input_bytes=nbytes, rows=rows, partitions=npartitions)
            runs = []
            for r in range(args.repeats):
                order = methods[r % len(methods):] + methods[: r % len(methods)]
                for m in order:
                    out = run_once(client, data, on, npartitions, m, nbytes, rows,
                                   trim=not args.no_trim, sample=args.sample)
                    out["round"] = r
                    runs.append(out)
                    print(f"round {r} {m:9s} {out['seconds']:7.2f} s {out['mb_per_s']:7.0f} MB/s "
                          f"(workers' CPU {out['worker_cpu_s_per_gb']:5.2f} s/GB, "
                          f"peak {out['peak_rss_gb']:.2f} GB)", flush=True)
            results["runs"] = runs
            results["summary"] = summarize(runs)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(report(results))
    print(f"wrote {args.out}")


def report(results: dict[str, Any]) -> str:
    s = results["summary"]
    head = (f"{results['input_bytes'] / 1e9:.2f} GB, {results['partitions']} partitions, "
            f"{results['args']['workers']} workers x 1 thread")
    lines = [head, (f"{'method':<10} {'MB/s min / median / max':>26} {'CPU-s/GB median':>16} "
                   f"{'peak GB median':>15}")]
    for m in METHODS:
        if m in s:
            v = s[m]["mb_per_s"]
            peak = s[m].get("peak_rss_gb", {}).get("median", float("nan"))
            lines.append(f"{m:<10} {v['min']:8.0f} {v['median']:8.0f} {v['max']:8.0f} "
                         f"{s[m]['worker_cpu_s_per_gb']['median']:16.2f} {peak:15.2f}")
    for k, v in s.get("ratios_of_medians", {}).items():
        lines.append(f"{k}: {v:.2f}")
    for m, (first, second) in results.get("first_of_fresh_cluster", {}).items():
        lines.append(f"fresh cluster, {m}: first {first['mb_per_s']:.0f} MB/s, second "
                     f"{second['mb_per_s']:.0f} MB/s ({first['mb_per_s'] / second['mb_per_s']:.2f} of it)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
