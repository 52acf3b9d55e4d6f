"""Benchmark: mpshuffle against Dask's P2P shuffle across rate-limited links.

Not a test. A scheduler and ``--workers`` ``dask worker --nthreads 1``
processes, each in its own Linux network namespace on a bridge (the harness
of ``tests/netns.py``; needs root, ``ip`` and ``tc``), mpshuffle with
``shared_memory=False``, so every byte between workers crosses a veth link.
For every rate of ``--rates`` (``none``: the veth's own speed; a number:
Gbit/s on both directions of every host's link, a ``tbf`` qdisc on each
end, :meth:`netns.Hosts.limit_rate`) both methods shuffle the **same**
persisted input ``--reps`` times each, each with ``ignore_index=True`` into
as many partitions as the input has. Each repetition goes through every
rate in turn and, at each, runs both methods, alternating their order
(mpshuffle then P2P, P2P then mpshuffle, ...); each method first shuffles a
small frame and then the full input once, untimed.

Per shuffle it records: ``seconds`` from submitting it until its output is
persisted; ``gb_per_s``, the input's in-memory size
(``memory_usage(deep=True)``, 10**9 bytes) over ``seconds``; the output's
row count (checked against the input's: a mismatch stops the run); the bytes
that crossed the links (``/sys/class/net/<veth>/statistics`` of the
root-side ends: what each host sent and received, TCP/IP headers and Dask's
own messages included); ``link_bound_seconds``, the least time the busiest
host's link needs for its bytes at the rate; user + system CPU-seconds of
all worker processes (``psutil``, in this process: the namespaces share
the PID space) and their peak summed RSS; the ``tbf`` counters; Dask's own
transfers of task data between workers during the shuffle (an input fetched
by another worker, e.g. after work stealing) and the scheduler's steals;
the number of mpshuffle runs the ranks finished (one per worker, more if
the shuffle ran again).

Where the network is the bound, ``link_bound_seconds`` is close to
``seconds``. With ``W`` workers and uniform keys, (W-1)/W of the input
changes hosts and each host's link carries (W-1)/W**2 of it each way: at
1 Gbit/s and 3 workers a shuffle can move at most 1e9/8 * 9/2 = 0.56 GB/s
of input, at 8 workers 1.14 GB/s, at 16 workers 2.1 GB/s.

Run (as root, repository root): ``python3 benchmarks/netns_bench.py
[--workers 3] [--size 1.0 | --rows N] [--reps 3] [--rates none 10 1]
[--json benchmarks/results/netns.json]``. Needs dask, distributed, psutil
and mpshuffle importable by this Python (``src`` is put on the path if
mpshuffle is not installed; a ``PYTHONPATH`` is passed on to the workers).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
try:
    import mpshuffle  # noqa: F401
except ImportError:  # a checkout without `pip install`: the workers need src too
    sys.path.insert(0, str(ROOT / "src"))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)

METHODS = ("mpshuffle", "p2p")


def _rate(text: str) -> float | None:
    """``none`` -> ``None`` (no limit); a number -> that many Gbit/s, in bits/s (at least 0.001)."""
    if text.lower() in ("none", "0", "off"):
        return None
    try:
        gbit = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a rate is 'none' or Gbit/s as a number, not {text!r}") from None
    if not gbit >= 0.001:
        raise argparse.ArgumentTypeError(f"a rate must be at least 0.001 Gbit/s (1 Mbit/s), got {text!r}")
    return gbit * 1e9


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
        return value

    return parse


def _link_bytes(hosts: Any) -> dict[int, tuple[int, int]]:
    """Host index -> (bytes it sent, bytes it received) so far, from its root-side veth's counters."""
    out = {}
    for i, dev in enumerate(hosts.links):
        stats = Path("/sys/class/net", dev, "statistics")
        # The root-side end receives what the host sends and transmits what it receives.
        out[i] = (int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text()))
    return out


def _dask_moves(client: Any, since: float) -> tuple[int, int, int]:
    """Dask's own task-data transfers between workers that started after ``since`` (``time.time()``).

    Returns (transfers, bytes, tasks the scheduler's work stealing moved so
    far in all). Neither shuffle's data is among them (both send theirs on
    connections of their own): these are inputs fetched by a worker that
    runs a task whose input is elsewhere, as after a steal.
    """

    # Nested, so that cloudpickle sends them by value: the workers cannot import this script.
    def moved(dask_worker: Any = None) -> tuple[int, int]:
        log = [t for t in dask_worker.transfer_incoming_log if t["start"] >= since]
        return len(log), sum(t["total"] for t in log)

    def steals(dask_scheduler: Any = None) -> int:
        stealing = dask_scheduler.extensions.get("stealing")
        return int(getattr(stealing, "count", 0))

    per_worker = client.run(moved).values()
    return sum(n for n, _ in per_worker), sum(b for _, b in per_worker), client.run_on_scheduler(steals)


def _mpshuffle_runs(client: Any) -> set[tuple[str, str, int]]:
    """(worker, generation, op_id) of every finished mpshuffle run the workers remember."""
    from mpshuffle.dask import gather_statistics

    return {(w, r["generation"], r["op_id"]) for w, runs in gather_statistics(client).items() for r in runs}


def _shuffle(method: str, df: Any, npartitions: int) -> Any:
    if method == "mpshuffle":
        from mpshuffle.dask import shuffle

        return shuffle(df, "key", npartitions=npartitions, ignore_index=True)
    return df.shuffle("key", npartitions=npartitions, ignore_index=True, shuffle_method="p2p")


def one_shuffle(client: Any, hosts: Any, method: str, df: Any, rows: int, nbytes: int,
                npartitions: int, pids: Sequence[int], bits_per_s: float | None) -> dict[str, Any]:
    """Time one shuffle of the persisted ``df``; check its row count; return its record."""
    from distributed import wait

    from mpshuffle.demo.bench import RssSampler

    links0 = _link_bytes(hosts)
    tc0 = hosts.rate_counters() if bits_per_s else {}
    steals0 = _dask_moves(client, time.time())[2]
    runs0 = _mpshuffle_runs(client)
    since = time.time()
    with RssSampler(pids) as sampler:
        t0 = time.perf_counter()
        out = _shuffle(method, df, npartitions).persist()
        wait(out)
        seconds = time.perf_counter() - t0
    links1 = _link_bytes(hosts)
    moves, moved_bytes, steals1 = _dask_moves(client, since)
    # More than one new run per worker: (part of) the shuffle ran again.
    mpshuffle_runs = len(_mpshuffle_runs(client) - runs0)
    tc1 = hosts.rate_counters() if bits_per_s else {}
    out_rows = int(out.map_partitions(len).compute().sum())
    if out_rows != rows:
        raise RuntimeError(f"{method} returned {out_rows} rows of {rows}")
    del out
    moved = {i: (links1[i][0] - links0[i][0], links1[i][1] - links0[i][1]) for i in links0}
    busiest = max(max(s, r) for i, (s, r) in moved.items() if i > 0)
    return {
        "method": method,
        "seconds": seconds,
        "gb_per_s": nbytes / 1e9 / seconds,
        "rows_out": out_rows,
        "link_bytes_sent": {str(i): s for i, (s, _) in moved.items()},
        "link_bytes_received": {str(i): r for i, (_, r) in moved.items()},
        "link_bytes_total": sum(s for i, (s, _) in moved.items() if i > 0),
        "link_bound_seconds": busiest * 8 / bits_per_s if bits_per_s else None,
        "dask_transfers": moves,
        "dask_transfer_bytes": moved_bytes,
        "steals": steals1 - steals0,
        "mpshuffle_rank_runs": mpshuffle_runs,
        "worker_cpu_seconds": sampler.cpu_seconds,
        "worker_cpu_system_seconds": sampler.cpu_system_seconds,
        "peak_cluster_rss": sampler.peak_total,
        "tbf_overlimits": sum(tc1[d]["overlimits"] - tc0[d]["overlimits"] for d in tc1),
        "tbf_dropped": sum(tc1[d]["dropped"] - tc0[d]["dropped"] for d in tc1),
        "load_average_1min": os.getloadavg()[0],
    }


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per method min/median/max of seconds and GB/s, medians of the rest; P2P/mpshuffle time ratios.

    The ratio is taken per pair of neighbouring runs (rep ``i`` of each
    method, which ran one after the other) and given as min/median/max.
    """
    out: dict[str, Any] = {}
    for m in METHODS:
        rs = [r for r in runs if r["method"] == m]
        secs = [r["seconds"] for r in rs]
        bound = [r["link_bound_seconds"] for r in rs if r["link_bound_seconds"] is not None]
        out[m] = {
            "seconds": [min(secs), statistics.median(secs), max(secs)],
            "gb_per_s": [min(r["gb_per_s"] for r in rs), statistics.median(r["gb_per_s"] for r in rs),
                         max(r["gb_per_s"] for r in rs)],
            "link_gb_median": statistics.median(r["link_bytes_total"] for r in rs) / 1e9,
            "link_busy_median": statistics.median(b / r["seconds"] for b, r in zip(bound, rs, strict=True))
            if bound else None,
            "worker_cpu_seconds_median": statistics.median(r["worker_cpu_seconds"] for r in rs),
            "dask_transfer_gb_max": max(r["dask_transfer_bytes"] for r in rs) / 1e9,
            "peak_cluster_rss_max": max(r["peak_cluster_rss"] for r in rs),
        }
    mine = [r["seconds"] for r in runs if r["method"] == "mpshuffle"]
    theirs = [r["seconds"] for r in runs if r["method"] == "p2p"]
    pairs = [t / m for m, t in zip(mine, theirs, strict=True)]
    out["p2p/mpshuffle"] = [min(pairs), statistics.median(pairs), max(pairs)]
    return out


def _input(client: Any, rows: int, partitions: int) -> tuple[Any, int, int]:
    """The synthetic input of ``mpshuffle bench`` (int64 key, two float64, an 11-character string), persisted."""
    import dask.dataframe as dd
    from distributed import wait

    from mpshuffle.demo.bench import make_synthetic

    per = -(-rows // partitions)
    sizes = [min(per, rows - i * per) for i in range(partitions)]
    df = dd.from_map(make_synthetic, list(range(partitions)), sizes, [max(rows // 4, 1)] * partitions,
                     enforce_metadata=False).persist()
    wait(df)
    return df, int(df.memory_usage(deep=True).sum().compute()), int(df.shape[0].compute())


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start the namespace cluster, run every rate's repetitions, remove everything; return the results."""
    from distributed import Client, wait

    from mpshuffle.dask import bootstrap_dask_cluster
    from mpshuffle.demo.bench import versions
    from netns import can_limit_rate, can_make_namespaces, new_hosts

    reason = can_make_namespaces() or (can_limit_rate() if any(args.rates) else None)
    if reason:
        raise SystemExit(f"cannot run here: {reason}")
    rows = args.rows if args.rows is not None else int(args.size * 1e9 / 43)  # 43 bytes a row in memory
    partitions = args.partitions or 6 * args.workers
    results: dict[str, Any] = {"versions": versions(), "args": vars(args), "rates": []}
    hosts = new_hosts(nworkers=args.workers, timeout=300.0, memory_limit=f"{args.memory_limit}GiB")
    try:
        hosts.up()
        hosts.start()
        with Client(hosts.scheduler, timeout=60) as client:
            client.wait_for_workers(args.workers, timeout=120)
            pids = sorted(client.run(os.getpid).values())
            bootstrap_dask_cluster(client, shared_memory=False)
            warm, _, _ = _input(client, 20_000, 2 * args.workers)
            for m in METHODS:  # imports, compiled kernels, connections: not timed
                wait(_shuffle(m, warm, 2 * args.workers).persist())
            del warm
            df, nbytes, nrows = _input(client, rows, partitions)
            results.update(input_bytes=nbytes, rows=nrows, partitions=partitions)
            print(f"{args.workers} workers, {nrows:,} rows, {nbytes / 1e9:.2f} GB in memory, "
                  f"{partitions} -> {partitions} partitions; load average {os.getloadavg()[0]:.1f}", flush=True)
            for m in METHODS:
                # A full-size shuffle first, untimed: a fresh worker's first one
                # also grows its memory pools and touches fresh pages (1.5-2x the
                # time of the next), which would fall on whichever rate came first.
                one_shuffle(client, hosts, m, df, nrows, nbytes, partitions, pids, None)
            runs: dict[int, list[dict[str, Any]]] = {k: [] for k in range(len(args.rates))}
            # Rates cycle within each repetition, so that other load on the
            # machine falls on every rate alike; the methods alternate.
            for rep in range(args.reps):
                for k, bits_per_s in enumerate(args.rates):
                    hosts.unlimit()
                    if bits_per_s:
                        hosts.limit_rate(bits_per_s)
                    for method in METHODS if rep % 2 == 0 else reversed(METHODS):
                        r = one_shuffle(client, hosts, method, df, nrows, nbytes, partitions, pids, bits_per_s)
                        r["rep"] = rep
                        print(f"  rep {rep} {_label(bits_per_s):>11} {method:<9} {r['seconds']:7.2f} s "
                              f"{r['gb_per_s']:6.3f} GB/s  load {r['load_average_1min']:.1f}", flush=True)
                        runs[k].append(r)
                    hosts.unlimit()
                results["rates"] = [
                    {"bits_per_s": b, "runs": runs[k], "summary": summarize(runs[k])}
                    for k, b in enumerate(args.rates)
                ]
                _write(results, args.json)
    finally:
        hosts.unlimit()
        hosts.down()
    return results


def _label(bits_per_s: float | None) -> str:
    return "none" if not bits_per_s else f"{bits_per_s / 1e9:g} Gbit/s"


def _write(results: dict[str, Any], path: str | None) -> None:
    # After every rate, so an interrupted run keeps what it measured.
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        Path(path).write_text(json.dumps(results, indent=1))


def report(results: dict[str, Any]) -> str:
    """The summary as a text table: one row per rate and method."""
    head = (f"{'limit':>11} {'method':<9} {'seconds min/med/max':>20} {'GB/s min/med/max':>19} "
            f"{'link GB':>7} {'link busy':>9} {'CPU-s':>6} {'peak GB':>7} {'moved GB':>8} {'P2P/mps min/med/max':>20}")
    lines = [head]
    for rate in results["rates"]:
        s = rate["summary"]
        for m in METHODS:
            x = s[m]
            busy = "" if x["link_busy_median"] is None else f"{x['link_busy_median']:.0%}"
            ratio = "/".join(f"{v:.1f}" for v in s["p2p/mpshuffle"]) if m == "p2p" else ""
            lines.append(
                f"{_label(rate['bits_per_s']):>11} {m:<9} {'/'.join(f'{v:.2f}' for v in x['seconds']):>20} "
                f"{'/'.join(f'{v:.3f}' for v in x['gb_per_s']):>19} {x['link_gb_median']:7.2f} {busy:>9} "
                f"{x['worker_cpu_seconds_median']:6.1f} {x['peak_cluster_rss_max'] / 1e9:7.2f} "
                f"{x['dask_transfer_gb_max']:8.2f} {ratio:>20}"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the options, run, print the table (and write the JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=_positive(int), default=3, help="workers, each its own host (default 3)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--size", type=_positive(float), default=1.0,
                      help="input size in memory, GB (10**9 bytes; 43 bytes a row); default 1.0")
    size.add_argument("--rows", type=_positive(int), default=None, help="input rows, instead of --size")
    parser.add_argument("--partitions", type=_positive(int), default=None,
                        help="input and output partitions (default 6 per worker)")
    parser.add_argument("--reps", type=_positive(int), default=3, help="shuffles of each method per rate (default 3)")
    parser.add_argument("--rates", type=_rate, nargs="+", default=[None, 10e9, 1e9],
                        help="link rates in Gbit/s, 'none' for no limit (default: none 10 1)")
    parser.add_argument("--memory-limit", type=_positive(float), default=4.0,
                        help="memory_limit of every worker, GiB (default 4)")
    parser.add_argument("--json", default=None, help="write the results here as JSON")
    args = parser.parse_args(argv)
    results = run(args)
    print(report(results))
    if args.json:
        print(f"results: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
