"""Where a fresh cluster's first bootstrap spends its time, phase by phase.

Not a test. Starts a ``LocalCluster`` (``--workers`` x 1 thread), persists
``config_line_bench``'s synthetic input (0.7 GB per worker unless ``--rows``),
waits until every worker has loaded the kernels (the client preload's work;
not with ``--no-wait``),
then times, from the client: registering the plugins again, and the
generation's bootstrap (``ensure_generation`` on the scheduler). On every
worker it wraps the bootstrap's steps (``TcpCommunicator.start``,
``rendezvous``, ``remove_orphans``, ``WorkerContext``) with timers, and prints
each step's min / median / max over the workers. Then it times two
config-line shuffles.

Run: ``python benchmarks/bootstrap_phases.py [--workers 16] [--json PATH]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import dask
from distributed import Client, LocalCluster, wait

import mpshuffle.dask  # noqa: F401  (registers the method and the client preload)

try:
    from config_line_bench import synthetic
except ImportError:  # run as a module
    from benchmarks.config_line_bench import synthetic


def _warmed_up() -> float | None:
    from mpshuffle.table.warm import warmed_up

    return warmed_up()


def _patch() -> bool:
    """Wrap the bootstrap's steps in this worker process with timers (kept on the worker module)."""
    import functools

    import mpshuffle.dask.worker as w

    # This function travels by value (cloudpickle), so its times live in a
    # module that stays in the worker process between calls.
    _TIMES: dict[str, float] = w.__dict__.setdefault("_bench_times", {})

    def timed(name: str, fn: Any, is_async: bool) -> Any:
        if is_async:
            @functools.wraps(fn)
            async def a(*args: Any, **kwargs: Any) -> Any:
                t = time.perf_counter()
                try:
                    return await fn(*args, **kwargs)
                finally:
                    _TIMES[name] = _TIMES.get(name, 0.0) + time.perf_counter() - t
            return a

        @functools.wraps(fn)
        def s(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                _TIMES[name] = _TIMES.get(name, 0.0) + time.perf_counter() - t
        return s

    comm_cls = w.TcpCommunicator
    start = comm_cls.start.__func__  # type: ignore[attr-defined]

    async def start_timed(cls: Any, *args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        comm = await start(cls, *args, **kwargs)
        _TIMES["comm_start"] = time.perf_counter() - t
        comm.rendezvous = timed("rendezvous", comm.rendezvous, True)
        return comm

    comm_cls.start = classmethod(start_timed)  # type: ignore[method-assign,assignment]
    w.remove_orphans = timed("remove_orphans", w.remove_orphans, False)
    w.WorkerContext = timed("worker_context", w.WorkerContext, False)
    plugin_cls = w.ShuffleWorkerPlugin
    plugin_cls._join = timed("join", plugin_cls._join, True)  # type: ignore[method-assign]
    return True


def _times() -> dict[str, float]:
    import mpshuffle.dask.worker as w

    return dict(w.__dict__.get("_bench_times", {}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--partitions", type=int, default=120)
    p.add_argument("--rows", type=int, default=None)
    p.add_argument("--memory-limit", type=float, default=6.0, help="GiB per worker")
    p.add_argument("--no-wait", action="store_true",
                   help="bootstrap at once after the persist, not after the kernels are loaded")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = args.rows or 700_000_000 * args.workers // 44 // args.partitions
    df, on = synthetic(args.partitions, rows)
    out: dict[str, Any] = {"args": vars(args) | {"rows": rows}}
    t_start = time.perf_counter()
    with (
        LocalCluster(n_workers=args.workers, threads_per_worker=1, memory_limit=f"{args.memory_limit}GiB",
                     dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        out["cluster_s"] = time.perf_counter() - t_start
        data = df.persist()
        wait(data)
        out["persist_done_s"] = time.perf_counter() - t_start
        while not args.no_wait and None in client.run(_warmed_up).values():
            time.sleep(0.05)
        out["kernels_loaded_s"] = time.perf_counter() - t_start
        client.run(_patch)
        from mpshuffle.config import resolve_options
        from mpshuffle.dask.bootstrap import register_plugins
        from mpshuffle.dask.dataframe import _warm_up_generation

        t = time.perf_counter()
        register_plugins(client)
        out["register_again_s"] = time.perf_counter() - t
        t = time.perf_counter()
        gen = client.run_on_scheduler(_warm_up_generation, options=resolve_options().as_dict())
        out["ensure_generation_s"] = time.perf_counter() - t
        out["bootstrapped"] = gen.get("bootstrapped")
        per_worker = list(client.run(_times).values())
        out["worker_steps"] = {
            k: {"min": min(v), "median": statistics.median(v), "max": max(v)}
            for k in sorted({k for d in per_worker for k in d})
            for v in [[d.get(k, 0.0) for d in per_worker]]
        }
        shuffles = []
        for _ in range(2):
            t = time.perf_counter()
            with dask.config.set({"dataframe.shuffle.method": "mpshuffle"}):
                res = data.shuffle(on, npartitions=args.partitions, ignore_index=True).persist()
            wait(res)
            shuffles.append(time.perf_counter() - t)
            del res
        out["shuffles_s"] = shuffles
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
