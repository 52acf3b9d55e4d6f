"""Benchmark: mpshuffle against Dask's P2P and task-based shuffles, in one run.

Every method shuffles the **same** persisted input on the **same** cluster
(one ``LocalCluster`` per worker count: ``n`` workers x 1 thread, every
worker the same explicit ``memory_limit``). For each method and repeat the
benchmark records:

* ``seconds``: from submitting the shuffle of the persisted input until its
  output is persisted (``distributed.wait``);
* ``mb_per_s``: the input's in-memory size (``memory_usage(deep=True)`` of the
  persisted input, in 10**6 bytes) divided by ``seconds``;
* ``peak_rss``: the largest resident set size of each worker process, sampled
  every 20 ms by a thread of this process (``psutil``), and ``peak_cluster_rss``,
  the largest sum over the workers of one sample;
* ``disk_write_bytes``: bytes the worker processes wrote to storage during
  the run (``psutil`` I/O counters; Dask P2P stages its shards on disk);
* ``worker_cpu_seconds``: user + system CPU time of all worker processes
  during the run (less sensitive than ``seconds`` to other load on the machine),
  and its two parts ``worker_cpu_user_seconds``, ``worker_cpu_system_seconds``
  (system time is mostly page faults and socket copies), and per GB of input
  (``worker_cpu_s_per_gb``);
* ``bytes_spilled`` (mpshuffle only): from :func:`mpshuffle.dask.gather_statistics`.

mpshuffle's bootstrap is timed once per cluster, on its own, before the first
shuffle (``bootstrap_seconds``) and is not part of any ``seconds``. Each
method first shuffles a tiny frame once (imports, connections), untimed,
unless ``--no-warmup`` asks for first runs as a user meets them.
Methods run ``repeats`` times each in alternating order (A B C, C B A, ...);
between runs the output is released and the benchmark waits until the
workers' memory is back near where it was before the run.

Dask's shuffles run with their default settings; every method drops the
index (``ignore_index=True``), so all do the same work.

Run ``mpshuffle bench --help`` for the sweeps (sizes, workers, partitions,
TPC-H lineitem); results go to a JSON file and, with matplotlib installed
(the ``[bench]`` extra), a PNG plot of the synthetic cases. Needs the
``demo`` extra (tqdm; tpchgen-cli for lineitem), which ``[bench]`` includes.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import platform
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Self

from mpshuffle.demo import progress_bar, require
from mpshuffle.demo._cliargs import int_at_least, positive_float, positive_int

__all__ = ["METHODS", "main", "make_synthetic"]

METHODS = ("mpshuffle", "p2p", "tasks")

#: Bytes per row of the synthetic data in memory (int64 + 2 float64 + a
#: ``str`` column of 11-character values with 8-byte offsets), measured.
_ROW_BYTES = 43


def make_synthetic(seed: int, nrows: int, nkeys: int) -> Any:
    """One partition of the synthetic input: int64 key, two float64, one string.

    Parameters
    ----------
    seed
        Seed of numpy's ``default_rng`` (one per partition).
    nrows
        Number of rows.
    nkeys
        Keys are uniform in ``[0, nkeys)``.

    Returns
    -------
    pandas.DataFrame
        Columns ``key`` (int64), ``x``, ``y`` (float64), ``s`` (pandas ``str``,
        11 characters drawn from 100 000 distinct values); about 43 bytes a row.
    """
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    words = pa.array([f"w{i:010d}" for i in range(100_000)])
    table = pa.table(
        {
            "key": rng.integers(0, nkeys, nrows, dtype=np.int64),
            "x": rng.random(nrows),
            "y": rng.standard_normal(nrows),
            "s": words.take(pa.array(rng.integers(0, len(words), nrows))),
        }
    )
    return table.to_pandas()


class RssSampler:
    """Sample the RSS (and disk writes) of a set of processes on a thread.

    Parameters
    ----------
    pids
        Process ids of the workers.
    interval
        Seconds between samples.
    """

    def __init__(self, pids: Sequence[int], interval: float = 0.02) -> None:
        import psutil

        self._procs = [psutil.Process(p) for p in pids]
        self._interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.peak = [0] * len(self._procs)
        self.peak_total = 0
        self._writes0 = [0] * len(self._procs)
        self._cpu0 = (0.0, 0.0)
        self.disk_write_bytes = 0
        self.cpu_seconds = 0.0
        self.cpu_user_seconds = 0.0
        self.cpu_system_seconds = 0.0

    def _cpu(self) -> tuple[float, float]:
        times = [p.cpu_times() for p in self._procs]
        return sum(t.user for t in times), sum(t.system for t in times)

    def rss(self) -> list[int]:
        """Return the current RSS of each process, in bytes."""
        return [p.memory_info().rss for p in self._procs]

    def _writes(self) -> list[int]:
        out = []
        for p in self._procs:
            try:
                out.append(p.io_counters().write_bytes)
            except (OSError, AttributeError):  # no I/O counters (permissions, platform)
                out.append(0)
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            now = self.rss()
            self.peak = [max(a, b) for a, b in zip(self.peak, now, strict=True)]
            self.peak_total = max(self.peak_total, sum(now))
            self._stop.wait(self._interval)

    def __enter__(self) -> Self:
        self._writes0 = self._writes()
        self._cpu0 = self._cpu()
        self._thread = threading.Thread(target=self._run, name="bench-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.disk_write_bytes = sum(b - a for a, b in zip(self._writes0, self._writes(), strict=True))
        user, system = self._cpu()
        self.cpu_user_seconds = user - self._cpu0[0]
        self.cpu_system_seconds = system - self._cpu0[1]
        self.cpu_seconds = self.cpu_user_seconds + self.cpu_system_seconds


def _trim_memory() -> int:
    # Give freed heap back to the OS so that one method's leftovers do not
    # count in the next one's peak RSS.
    import ctypes

    gc.collect()
    try:
        return int(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except OSError:
        return 0


def _settle(client: Any, sampler_pids: Sequence[int], baseline: int, timeout: float = 20.0) -> int:
    """Wait until the workers' total RSS is back within 10% (+64 MB) of ``baseline``."""
    import psutil

    deadline = time.monotonic() + timeout
    total = 0
    while time.monotonic() < deadline:
        client.run(_trim_memory)
        total = sum(psutil.Process(p).memory_info().rss for p in sampler_pids)
        if total <= baseline * 1.1 + 64e6:
            break
        time.sleep(0.25)
    return total


def _shuffle(method: str, df: Any, on: str, npartitions: int) -> Any:
    if method == "mpshuffle":
        from mpshuffle.dask import shuffle

        return shuffle(df, on, npartitions=npartitions, ignore_index=True)
    return df.shuffle(on, npartitions=npartitions, ignore_index=True, shuffle_method=method)


def _spilled(client: Any, since: dict[str, int]) -> int:
    from mpshuffle.dask import gather_statistics

    stats = gather_statistics(client)
    total = 0
    for addr, runs in stats.items():
        for r in runs:
            if r["op_id"] > since.get(addr, -1):
                total += int(r.get("bytes_spilled_disk", 0))
        if runs:
            since[addr] = max(r["op_id"] for r in runs)
    return total


def _order(repeats: int) -> list[str]:
    order: list[str] = []
    for i in range(repeats):
        order.extend(METHODS if i % 2 == 0 else reversed(METHODS))
    return order


def run_case(
    client: Any, df: Any, on: str, npartitions: int, repeats: int, pids: Sequence[int],
    progress: Callable[[str, bool], None],
) -> dict[str, Any]:
    """Shuffle the persisted ``df`` with every method ``repeats`` times.

    Returns
    -------
    dict
        ``input_bytes``, ``rows``, and ``runs``: one record per shuffle (see the
        module docstring), in the order they ran.
    """
    from distributed import wait

    nbytes = int(df.memory_usage(deep=True).sum().compute())
    rows = int(df.shape[0].compute())
    spill_seen: dict[str, int] = {}
    _spilled(client, spill_seen)
    runs = []
    for method in _order(repeats):
        progress(method, False)
        baseline = sum(RssSampler(pids).rss())
        with RssSampler(pids) as sampler:
            t0 = time.perf_counter()
            out = _shuffle(method, df, on, npartitions).persist()
            wait(out)
            seconds = time.perf_counter() - t0
        out_rows = int(out.map_partitions(len).compute().sum())
        if out_rows != rows:
            raise RuntimeError(f"{method} returned {out_rows} rows of {rows}")
        del out
        record = {
            "method": method,
            "seconds": seconds,
            "mb_per_s": nbytes / 1e6 / seconds,
            "peak_rss": sampler.peak,
            "peak_cluster_rss": sampler.peak_total,
            "baseline_cluster_rss": baseline,
            "disk_write_bytes": sampler.disk_write_bytes,
            "worker_cpu_seconds": sampler.cpu_seconds,
            "worker_cpu_user_seconds": sampler.cpu_user_seconds,
            "worker_cpu_system_seconds": sampler.cpu_system_seconds,
            "worker_cpu_s_per_gb": sampler.cpu_seconds / (nbytes / 1e9),
            "load_average_1min": os.getloadavg()[0],
        }
        if method == "mpshuffle":
            record["bytes_spilled"] = _spilled(client, spill_seen)
        runs.append(record)
        progress(method, True)
        _settle(client, pids, baseline)
    return {"input_bytes": nbytes, "rows": rows, "runs": runs}


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def summarize(case: dict[str, Any]) -> dict[str, Any]:
    """Min/median/max of seconds, MB/s, worker CPU-s/GB and peak memory per method, and the ratios.

    Ratios compare mpshuffle with each Dask method: throughput by the best
    (max), the median and the worst (min) run of each; worker CPU time per GB
    by the median of each; memory by the larger peak of each.
    """
    out: dict[str, Any] = {}
    for m in METHODS:
        rs = [r for r in case["runs"] if r["method"] == m]
        if not rs:
            continue
        out[m] = {
            "seconds_min": min(r["seconds"] for r in rs),
            "seconds_max": max(r["seconds"] for r in rs),
            "mb_per_s_min": min(r["mb_per_s"] for r in rs),
            "mb_per_s_max": max(r["mb_per_s"] for r in rs),
            "peak_cluster_rss_max": max(r["peak_cluster_rss"] for r in rs),
            "peak_worker_rss_max": max(max(r["peak_rss"]) for r in rs),
            "disk_write_bytes_max": max(r["disk_write_bytes"] for r in rs),
            "worker_cpu_seconds_min": min(r["worker_cpu_seconds"] for r in rs),
            "worker_cpu_s_per_gb_min": min(r["worker_cpu_s_per_gb"] for r in rs),
            "worker_cpu_s_per_gb_median": _median([r["worker_cpu_s_per_gb"] for r in rs]),
            "worker_cpu_s_per_gb_max": max(r["worker_cpu_s_per_gb"] for r in rs),
            "worker_cpu_system_share_median": _median(
                [r["worker_cpu_system_seconds"] / max(r["worker_cpu_seconds"], 1e-9) for r in rs]
            ),
            "mb_per_s_median": _median([r["mb_per_s"] for r in rs]),
        }
        if m == "mpshuffle":
            out[m]["bytes_spilled_max"] = max(r.get("bytes_spilled", 0) for r in rs)
    if "mpshuffle" in out:
        mine = out["mpshuffle"]
        for m in ("p2p", "tasks"):
            if m in out:
                out[f"mpshuffle/{m}"] = {
                    "throughput_best": mine["mb_per_s_max"] / out[m]["mb_per_s_max"],
                    "throughput_worst": mine["mb_per_s_min"] / out[m]["mb_per_s_min"],
                    "throughput_median": mine["mb_per_s_median"] / out[m]["mb_per_s_median"],
                    "worker_cpu_per_gb": out[m]["worker_cpu_s_per_gb_median"]
                    / mine["worker_cpu_s_per_gb_median"],
                    "peak_cluster_rss": mine["peak_cluster_rss_max"] / out[m]["peak_cluster_rss_max"],
                }
    return out


def _synthetic(gb: float, partitions: int) -> tuple[Any, str]:
    import dask.dataframe as dd

    rows = int(gb * 1e9 / _ROW_BYTES)
    per = -(-rows // partitions)
    sizes = [min(per, rows - i * per) for i in range(partitions)]
    nkeys = max(rows // 4, 1)
    df = dd.from_map(make_synthetic, list(range(partitions)), sizes, [nkeys] * partitions,
                     enforce_metadata=False)
    return df, "key"


def _lineitem(scale_factor: float, partitions: int, data_dir: str) -> tuple[Any, str]:
    import dask.dataframe as dd

    from mpshuffle.demo.tpch import generate, load_parquet

    root = os.path.join(data_dir, f"sf{scale_factor:g}-p{partitions}")
    # Reuse a generation only if it finished and is of these parameters: an
    # interrupted one leaves some parts, which would shuffle without error.
    done = Path(root, "lineitem.done")
    stamp = f"scale_factor={scale_factor!r} parts={partitions}\n"
    if not (done.is_file() and done.read_text() == stamp):
        done.unlink(missing_ok=True)
        generate(scale_factor, root, parts=partitions, tables=("lineitem",))
        done.write_text(stamp)
    path = os.path.join(root, "lineitem")
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".parquet"))
    else:  # one part: tpchgen-cli writes lineitem.parquet, no folder
        files = [os.path.join(root, "lineitem.parquet")]
    return dd.from_map(load_parquet, files), "l_orderkey"


def _cases(args: Any) -> list[dict[str, Any]]:
    cases = []
    for w in args.workers:
        for p in args.partitions:
            sizes = args.sizes if args.gb_per_worker is None else [args.gb_per_worker * w]
            for gb in sizes:
                cases.append({"data": "synthetic", "workers": w, "partitions": p, "gb": gb})
            if args.lineitem_sf is not None:
                cases.append({"data": "lineitem", "workers": w, "partitions": p,
                              "scale_factor": args.lineitem_sf})
    return cases


def versions() -> dict[str, str]:
    """Versions of Python and the libraries that take part, and the machine."""
    import dask
    import distributed
    import numpy
    import pandas
    import psutil
    import pyarrow

    import mpshuffle

    return {
        "python": platform.python_version(), "mpshuffle": mpshuffle.__version__,
        "dask": dask.__version__, "distributed": distributed.__version__,
        "pandas": pandas.__version__, "pyarrow": pyarrow.__version__, "numpy": numpy.__version__,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpus": str(psutil.cpu_count(logical=True)),
        "memory_gib": f"{psutil.virtual_memory().total / 2**30:.1f}",
    }


def run(args: Any) -> dict[str, Any]:
    """Run every case of the sweep; return the results (also written as JSON)."""
    cases = _cases(args)
    results: dict[str, Any] = {"versions": versions(), "args": vars(args),
                               "plot": _plot_path(args.output, cases), "cases": []}
    # Generated lineitem goes to --data-dir if given (kept), else to a temporary directory removed at the end.
    kept = args.data_dir is not None
    with contextlib.nullcontext(args.data_dir) if kept else tempfile.TemporaryDirectory(prefix="mpshuffle-bench-") as data_dir:
        _run_cases(args, cases, results, data_dir)
    return results


def _run_cases(args: Any, cases: list[dict[str, Any]], results: dict[str, Any], data_dir: str) -> None:
    """Run ``cases`` (clusters by worker count), appending each case's results to ``results`` and writing them."""
    from distributed import Client, LocalCluster, wait

    from mpshuffle.dask import bootstrap_dask_cluster

    # P2P's scheduler plugin logs each shuffle's start and end as WARNINGs (the
    # LocalCluster's scheduler runs in this process); the table says what ran.
    logging.getLogger("distributed.shuffle").setLevel(logging.ERROR)
    total = len(cases) * args.repeats * len(METHODS)
    bar = progress_bar(total, "bench", "shuffle", args.no_progress)
    by_workers: dict[int, list[dict[str, Any]]] = {}
    for c in cases:
        by_workers.setdefault(c["workers"], []).append(c)
    for nworkers, group in by_workers.items():
        memory_limit = int(args.memory_limit * 2**30)
        with LocalCluster(n_workers=nworkers, threads_per_worker=args.threads, processes=True,
                          memory_limit=memory_limit, dashboard_address=":0") as cluster, \
                Client(cluster) as client:
            pids = sorted(client.run(os.getpid).values())
            t0 = time.perf_counter()
            bootstrap_dask_cluster(client)
            bootstrap = time.perf_counter() - t0
            if not args.no_warmup:
                warm, _ = _synthetic(0.002, nworkers * 2)
                warm = warm.persist()
                wait(warm)
                for m in METHODS:
                    wait(_shuffle(m, warm, "key", nworkers * 2).persist())
                del warm
            for case in group:
                if case["data"] == "synthetic":
                    df, on = _synthetic(case["gb"], case["partitions"])
                else:
                    df, on = _lineitem(case["scale_factor"], case["partitions"], data_dir)
                df = df.persist()
                wait(df)

                def progress(method: str, done: bool, case: dict[str, Any] = case, nworkers: int = nworkers) -> None:
                    what = f"{case['gb']:g} GB" if "gb" in case else f"lineitem sf{case['scale_factor']:g}"
                    bar.set_postfix_str(f"{nworkers}w {what} {case['partitions']}p {method}")
                    bar.update(1 if done else 0)

                out = run_case(client, df, on, case["partitions"], args.repeats, pids, progress)
                del df
                out.update(case, memory_limit=memory_limit, bootstrap_seconds=bootstrap)
                out["summary"] = summarize(out)
                results["cases"].append(out)
                _write(results, args.output)
    bar.close()


def _plot_path(output: str, cases: Sequence[dict[str, Any]]) -> str | None:
    """Where the PNG goes (next to ``output``), or ``None`` if there is none to draw.

    The plot shows the synthetic cases only, and needs matplotlib, which is
    the optional ``[bench]`` extra: without it the benchmark still runs and
    writes its JSON, and says once that no plot is written.
    """
    if not any(c["data"] == "synthetic" for c in cases):
        return None
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print('matplotlib not installed (pip install -e ".[bench]" in a clone of mpshuffle, or pip install '
              '"mpshuffle[bench]"); no plot written', flush=True)
        return None
    return os.path.splitext(output)[0] + ".png"


def _write(results: dict[str, Any], output: str) -> None:
    # Written after every case, so an interrupted sweep keeps what it measured.
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with open(output, "w") as f:
        json.dump(results, f, indent=1)
    if results["plot"] is not None:
        plot(results, results["plot"])


def plot(results: dict[str, Any], path: str) -> None:
    """Throughput and peak cluster memory against input size, one line per method.

    One line per (method, workers, partitions) of the synthetic cases; the
    markers span min..max of the repeats. Needs matplotlib (``[bench]`` extra).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [c for c in results["cases"] if c["data"] == "synthetic"]
    if not cases:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    groups: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for c in cases:
        groups.setdefault((c["workers"], c["partitions"]), []).append(c)
    for (w, p), cs in sorted(groups.items()):
        cs = sorted(cs, key=lambda c: c["input_bytes"])
        gb = [c["input_bytes"] / 1e9 for c in cs]
        for m in METHODS:
            s = [c["summary"][m] for c in cs]
            hi = [x["mb_per_s_max"] for x in s]
            lo = [x["mb_per_s_min"] for x in s]
            label = f"{m} ({w} workers, {p} partitions)"
            line = ax1.plot(gb, hi, marker="o", label=label)[0]
            ax1.fill_between(gb, lo, hi, alpha=0.2, color=line.get_color())
            ax2.plot(gb, [x["peak_cluster_rss_max"] / 1e9 for x in s], marker="o",
                     color=line.get_color(), label=label)
    ax1.set(xlabel="input size in memory (GB)", ylabel="throughput (MB/s)",
            title="Shuffle throughput (line: best run, band: min-max)")
    ax2.set(xlabel="input size in memory (GB)", ylabel="peak cluster RSS (GB)",
            title="Peak memory of all workers together")
    ax2.plot([0, max(c["input_bytes"] for c in cases) / 1e9], [0, max(c["input_bytes"] for c in cases) / 1e9],
             ls=":", color="gray", label="input size")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    ax1.legend(fontsize=7)
    v = results["versions"]
    fig.suptitle(f"mpshuffle vs Dask P2P / tasks, {v['cpus']} CPUs, dask {v['dask']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the benchmark's options to ``parser`` (used by ``mpshuffle bench``)."""
    parser.add_argument("--sizes", type=positive_float, nargs="+", default=[0.25, 0.5, 1.0, 2.0],
                        help="synthetic input sizes in GB (10**9 bytes in memory), each > 0")
    parser.add_argument("--gb-per-worker", type=positive_float, default=None,
                        help="instead of --sizes: this many GB per worker, > 0 (weak scaling)")
    parser.add_argument("--workers", type=positive_int, nargs="+", default=[2],
                        help="worker counts to sweep, each >= 1")
    parser.add_argument("--partitions", type=positive_int, nargs="+", default=[60],
                        help="partition counts to sweep (input and output alike), each >= 1")
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="threads per worker (task threads), >= 1")
    parser.add_argument("--repeats", type=int_at_least(2), default=2,
                        help="runs of each method per case (>= 2)")
    parser.add_argument("--memory-limit", type=positive_float, default=8.0,
                        help="memory_limit of every worker in GiB, > 0")
    parser.add_argument("--lineitem-sf", type=positive_float, default=None,
                        help="also shuffle TPC-H lineitem of this scale factor (> 0) on l_orderkey")
    parser.add_argument("--data-dir", default=None,
                        help="where tpchgen-cli writes lineitem, one folder per scale factor and partition "
                             "count; a finished generation there is reused and kept (default: a temporary dir, "
                             "removed at the end)")
    parser.add_argument("--output", "-o", default="benchmarks/results/bench.json",
                        help="JSON file; the plot goes next to it as .png")
    parser.add_argument("--no-warmup", action="store_true",
                        help="no untimed 2 MB shuffle of each method first: each method's first run then "
                             "includes its one-time costs (imports, mpshuffle's kernels), as a user's first "
                             "shuffle does (mpshuffle's bootstrap stays timed apart)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar (there is none either when stderr is not a terminal)")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark from the command line; print the summary table."""
    parser = argparse.ArgumentParser(prog="mpshuffle bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    require("mpshuffle bench")
    return run_and_report(args)


def run_and_report(args: Any) -> int:
    """Run the sweep described by parsed ``args`` and print one line per case and method."""
    results = run(args)
    print(report(results))
    print(f"results: {args.output}" + ("" if results["plot"] is None else f" and {results['plot']}"))
    return 0


def report(results: dict[str, Any]) -> str:
    """Return the summary as a text table (one row per case and method)."""
    head = f"{'case':<34} {'method':<10} {'MB/s min-max':>15} {'s min-max':>13} "
    lines = [head + f"{'peak GB':>8} {'CPU-s/GB':>9} {'sys':>4} {'x mps min/med/max':>17}"]
    for c in results["cases"]:
        what = f"{c['gb']:g}GB" if "gb" in c else f"lineitem-sf{c['scale_factor']:g}"
        name = f"{what} {c['workers']}w {c['partitions']}p ({c['input_bytes'] / 1e9:.2f} GB)"
        s = c["summary"]
        for m in METHODS:
            x = s[m]
            ratio = ""
            if m != "mpshuffle":
                r = s[f"mpshuffle/{m}"]
                ratio = (f"{r['throughput_worst']:.1f}/{r['throughput_median']:.1f}/"
                         f"{r['throughput_best']:.1f}")
            lines.append(
                f"{name:<34} {m:<10} {x['mb_per_s_min']:7.0f}-{x['mb_per_s_max']:<7.0f} "
                f"{x['seconds_min']:6.2f}-{x['seconds_max']:<6.2f} {x['peak_cluster_rss_max'] / 1e9:8.2f} "
                f"{x['worker_cpu_s_per_gb_median']:9.2f} {x['worker_cpu_system_share_median']:4.0%} "
                f"{ratio:>17}"
            )
        lines.append(f"{'':<34} bootstrap {c['bootstrap_seconds']:.3f} s, mpshuffle spilled "
                     f"{s['mpshuffle'].get('bytes_spilled_max', 0) / 1e6:.0f} MB")
    lines.append("  sys: the system (kernel) share of the workers' CPU; x mps: mpshuffle's MB/s over the "
                 "method's, worst/median/best pairing of runs")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
