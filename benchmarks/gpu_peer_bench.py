"""mpshuffle next to rapidsmpf 26.04 on one LocalCUDACluster, same data, same run.

One dask-cuda worker per GPU. For each size, ``--nparts`` cudf partitions
(an int64 ``key`` uniform in [0, 2^30) and three float64 columns: 32 bytes a
row) are generated on the GPUs, half on each, and persisted. Then, alternating
method by method within each repetition, the same persisted collection is
shuffled on ``key`` into as many output partitions:

* ``rapidsmpf``: ``rapidsmpf.examples.dask.dask_cudf_shuffle(df, on=["key"])``
  after ``rapidsmpf.integrations.dask.bootstrap_dask_cluster(client)``;
* ``mpshuffle``: ``mpshuffle.dask.shuffle(df, on="key", ignore_index=True)``
  after ``mpshuffle.dask.bootstrap_dask_cluster(client)`` (cudf partitions
  take mpshuffle's device path: hash and pack on each GPU, NCCL between them);
* ``floor`` (with ``--floor``): Dask alone, a graph of the same shape that
  moves no data (one no-op task per input partition, a barrier task, one
  task per output partition returning an empty frame), submitted and waited
  for like the shuffles: the fixed cost of any shuffle expressed as tasks on
  this cluster.

Seconds: from building the shuffle of the persisted input until its output is
persisted (every output partition exists on a GPU). GB/s per GPU = that GPU's
input bytes / seconds. Every output is checked: total rows and the sum of
column ``a`` equal the input's, and the per-partition distinct-key counts add
up to the global distinct count (each key in exactly one partition). For one
mpshuffle repetition per size the task stream gives the time line (insert,
barrier, extract phases), and the workers' run statistics the time spent in
mpshuffle's own phases.

Results: ``RESULT {json}`` lines on stdout and in ``OUT/peer_results.jsonl``.
Run: ``python benchmarks/gpu_peer_bench.py --rows-per-part 100000 6250000 10000000``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import threading
import time
from typing import Any

ROW_BYTES = 32  # int64 key + 3 float64


def _log(t0: float, *a: Any) -> None:
    print(f"[{time.perf_counter() - t0:7.1f}s]", *a, flush=True)


def make_part(i: int, nrows: int, seed: int) -> Any:
    """Input partition ``i``, generated on this worker's GPU."""
    import cudf
    import cupy as cp

    rng = cp.random.default_rng(seed * 100_003 + i)
    return cudf.DataFrame({
        "key": rng.integers(0, 2**30, nrows, dtype=cp.int64),
        "a": rng.random(nrows),
        "b": rng.random(nrows),
        "c": rng.random(nrows),
    })


def part_summary(df: Any) -> Any:
    """Rows, distinct keys and the sum of ``a`` of one partition (a 1-row frame)."""
    import cudf

    return cudf.DataFrame({
        "rows": [len(df)], "nuniq": [int(df["key"].nunique())], "asum": [float(df["a"].sum())],
    })


def summarize(ddf: Any) -> dict[str, Any]:
    """Totals over the partitions of ``ddf`` (computed on the GPUs)."""
    import cudf

    meta = cudf.DataFrame({
        "rows": cudf.Series([], dtype="int64"), "nuniq": cudf.Series([], dtype="int64"),
        "asum": cudf.Series([], dtype="float64"),
    })
    s = ddf.map_partitions(part_summary, meta=meta).compute().to_pandas()
    return {"rows": int(s.rows.sum()), "sum_nunique": int(s.nuniq.sum()), "asum": float(s.asum.sum()),
            "empty": int((s.rows == 0).sum()), "partitions": len(s)}


def _noop(*args: Any) -> int:
    return 0


def _empty_out(barrier: int, j: int, meta: Any) -> Any:
    return meta


def floor_run(df: Any, meta: Any) -> float:
    """Seconds for Dask to persist a no-op graph shaped like a shuffle of ``df`` (see the docstring).

    Built like mpshuffle's shuffle graph (persisted input keys, no alias
    tasks, one collection of the extract tasks) and persisted the same way.
    """
    from distributed import wait

    from mpshuffle.dask.dataframe import _collection, _skip_aliases

    token = os.urandom(6).hex()
    d = df.optimize()
    graph = dict(d.__dask_graph__())
    keys = _skip_aliases(graph, d.__dask_keys__())
    inserts = [(f"floor-insert-{token}", i) for i in range(len(keys))]
    for i, k in enumerate(keys):
        graph[inserts[i]] = (_noop, k)
    graph[f"floor-barrier-{token}"] = (_noop, *inserts)
    outs = [(f"floor-extract-{token}", j) for j in range(len(keys))]
    for j, k in enumerate(outs):
        graph[k] = (_empty_out, f"floor-barrier-{token}", j, meta)
    t0 = time.perf_counter()
    out = _collection(graph, meta, len(outs), outs).persist()
    wait(out, timeout=120)
    secs = time.perf_counter() - t0
    del out
    return secs


def mpshuffle_stats(dask_worker: Any) -> dict[str, Any]:
    """mpshuffle's statistics of the last run on this worker."""
    from mpshuffle.dask.worker import PLUGIN_NAME

    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    ctx = None if plugin is None else plugin.context
    return dict(ctx.history[-1][1]) if ctx is not None and ctx.history else {}


def timeline(records: list[dict[str, Any]], t0: float) -> dict[str, Any]:
    """Phase start/end (seconds after ``t0``) from task-stream records.

    Also: seconds per startstop action other than ``compute`` (transfers,
    spills), and per worker the extract tasks' starts and stops (ms after
    ``t0``) to show gaps between them.
    """
    phases: dict[str, list[float]] = {}
    actions: dict[str, float] = {}
    extracts: dict[str, list[tuple[int, int]]] = {}
    for r in records:
        name = str(r["key"])
        kind = next((k for k in ("insert", "barrier", "extract") if f"-{k}-" in name), "other")
        for ss in r["startstops"]:
            if ss["action"] != "compute":
                actions[ss["action"]] = actions.get(ss["action"], 0.0) + ss["stop"] - ss["start"]
                continue
            lo, hi = phases.setdefault(kind, [float("inf"), float("-inf"), 0, 0.0])[:2]
            p = phases[kind]
            p[0], p[1] = min(lo, ss["start"] - t0), max(hi, ss["stop"] - t0)
            p[2] += 1
            p[3] += ss["stop"] - ss["start"]
            if kind == "extract":
                extracts.setdefault(str(r.get("worker", "?")), []).append(
                    (round(1e3 * (ss["start"] - t0)), round(1e3 * (ss["stop"] - t0))))
    out: dict[str, Any] = {k: {"first_start": round(v[0], 4), "last_stop": round(v[1], 4), "tasks": v[2],
                               "busy_seconds": round(v[3], 4)} for k, v in phases.items()}
    out["other_actions_seconds"] = {k: round(v, 4) for k, v in actions.items()}
    out["extract_ms_by_worker"] = {w: sorted(v) for w, v in extracts.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows-per-part", type=int, nargs="+", default=[6_250_000, 10_000_000])
    ap.add_argument("--nparts", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--methods", default="rapidsmpf,mpshuffle")
    ap.add_argument("--rmm-pool", default="60GB")
    ap.add_argument("--floor", action="store_true", help="also time a no-op graph of the same shape")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()

    import cupy
    import dask
    import dask.dataframe as dd
    import distributed
    from dask_cuda import LocalCUDACluster
    from distributed import Client, get_task_stream, wait

    import mpshuffle
    from mpshuffle.dask import bootstrap_dask_cluster, shuffle

    t_start = time.perf_counter()
    out_path = os.path.join(args.out, "peer_results.jsonl")

    def result(**kw: Any) -> None:
        line = json.dumps(kw, default=str)
        print("RESULT", line, flush=True)
        with open(out_path, "a") as f:
            f.write(line + "\n")

    import cudf

    versions = {m.__name__: getattr(m, "__version__", "?") for m in (cudf, cupy, dask, distributed, mpshuffle)}
    try:
        import rapidsmpf

        versions["rapidsmpf"] = getattr(rapidsmpf, "__version__", "?")
    except Exception as e:  # noqa: BLE001 - report, run mpshuffle alone
        versions["rapidsmpf"] = f"not importable: {e!r}"[:200]
    ngpu = cupy.cuda.runtime.getDeviceCount()
    result(step="versions", versions=versions, ngpu=ngpu)
    methods = args.methods.split(",")

    with LocalCUDACluster(
        n_workers=ngpu, CUDA_VISIBLE_DEVICES=",".join(map(str, range(ngpu))), rmm_pool_size=args.rmm_pool,
        memory_limit=0, dashboard_address=":0",
    ) as cluster, Client(cluster) as client:
        client.wait_for_workers(ngpu)
        workers = sorted(client.sync(client.scheduler.identity, n_workers=-1)["workers"])
        _log(t_start, "cluster up:", workers)

        t = time.perf_counter()
        gen = bootstrap_dask_cluster(client)
        result(step="mpshuffle_bootstrap", seconds=time.perf_counter() - t, nranks=gen.nranks)
        dask_cudf_shuffle = None
        if "rapidsmpf" in methods:
            box: dict[str, Any] = {}

            def boot() -> None:
                try:
                    from rapidsmpf.examples.dask import dask_cudf_shuffle as f
                    from rapidsmpf.integrations.dask import bootstrap_dask_cluster as rboot

                    t1 = time.perf_counter()
                    rboot(client)
                    box["seconds"], box["fn"] = time.perf_counter() - t1, f
                except Exception as e:  # noqa: BLE001 - report it, go on with mpshuffle
                    box["error"] = repr(e)[:500]

            th = threading.Thread(target=boot, daemon=True)
            th.start()
            th.join(120)
            if "fn" in box:
                dask_cudf_shuffle = box["fn"]
            result(step="rapidsmpf_bootstrap", seconds=box.get("seconds"),
                   error=box.get("error", "timed out after 120 s" if th.is_alive() else None))

        builders = {
            "mpshuffle": lambda df: shuffle(df, on="key", ignore_index=True),
        }
        if dask_cudf_shuffle is not None:
            builders["rapidsmpf"] = lambda df: dask_cudf_shuffle(df, on=["key"])
        order = [m for m in methods if m in builders]

        for rows in args.rows_per_part:
            meta = make_part(0, 0, 0)
            futs = [client.submit(make_part, i, rows, 7, workers=[workers[i % ngpu]], pure=False)
                    for i in range(args.nparts)]
            wait(futs)
            df = dd.from_delayed(futs, meta=meta, verify_meta=False).persist()
            wait(df)
            del futs
            want = summarize(df)
            global_nunique = int(df["key"].nunique().compute())
            gb_per_gpu = rows * args.nparts * ROW_BYTES / ngpu / 1e9
            result(step="input", rows_per_part=rows, nparts=args.nparts, gb_per_gpu=gb_per_gpu,
                   global_nunique=global_nunique, **want)
            for rep in range(args.reps):
                if args.floor:
                    secs = floor_run(df, meta)
                    result(step="floor", rep=rep, gb_per_gpu=gb_per_gpu, seconds=secs)
                for m in order:
                    traced = m == "mpshuffle" and rep == args.reps - 1
                    try:
                        with get_task_stream(client) if traced else contextlib.nullcontext() as ts:
                            t0w, t0 = time.time(), time.perf_counter()
                            out = builders[m](df).persist()
                            wait(out, timeout=300)
                            secs = time.perf_counter() - t0
                        got = summarize(out)
                        ok = (got["rows"] == want["rows"] and got["sum_nunique"] == global_nunique
                              and abs(got["asum"] - want["asum"]) <= 1e-9 * abs(want["asum"]))
                        row: dict[str, Any] = {
                            "step": m, "rep": rep, "gb_per_gpu": gb_per_gpu, "seconds": secs,
                            "gbps_per_gpu": gb_per_gpu / secs, "correct": ok, **{f"out_{k}": v for k, v in got.items()},
                        }
                        if m == "mpshuffle":
                            row["worker_stats"] = client.run(mpshuffle_stats)
                        if traced and ts is not None:
                            row["timeline"] = timeline(ts.data, t0w)
                        result(**row)
                        del out
                    except Exception as e:  # noqa: BLE001 - record and go on
                        result(step=m, rep=rep, gb_per_gpu=gb_per_gpu, error=repr(e)[:800])
                    time.sleep(1.0)
            del df
            time.sleep(1.0)
    _log(t_start, "done")


if __name__ == "__main__":
    main()
    os._exit(0)  # rapidsmpf's and dask-cuda's threads may hold the interpreter at exit
