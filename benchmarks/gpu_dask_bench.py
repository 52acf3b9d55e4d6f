"""Device shuffle through Dask on a GPU machine: per-GPU GB/s end to end.

One worker process per GPU (``CUDA_VISIBLE_DEVICES`` per nanny, one thread
each), ``bootstrap_dask_cluster(pool_size=, spill_device=)``, input
partitions made on the GPUs (an int64 ``key`` uniform in [0, 2^62) and three
float64 columns: 32 bytes a row), kept there as futures, then a shuffle of
them through :func:`mpshuffle.dask.shuffle_graph`. Seconds: from
``client.get`` of the graph until every output partition exists on its owner
GPU (a tiny task per partition returns its summary, so outputs stay
device-resident); Dask's scheduling of the graph is inside the time. GB/s per
GPU = that GPU's input bytes / seconds.

Run: ``python benchmarks/gpu_dask_bench.py --gb 2 5 10 --reps 3 --out result.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any


def make(i: int, nrows: int, seed: int) -> Any:
    """One input partition, generated on this worker's GPU."""
    import cupy as cp

    from mpshuffle.table.device import DeviceTable

    rs = cp.random.RandomState(seed * 1000 + i)
    return DeviceTable({
        "key": rs.randint(0, 2**62, nrows, dtype=cp.int64),
        "a": rs.random_sample(nrows),
        "b": rs.random_sample(nrows),
        "c": rs.random_sample(nrows),
    })


def summary(t: Any, partition: int | None = None, npartitions: int = 1) -> list[int]:
    """Rows, checksum and membership of a partition, computed on its GPU (it stays there).

    The checksum is the sum of every column's values taken as ``uint64`` bits,
    modulo 2^64 (exact and independent of row order); membership is 1 when
    every row's key hashes to ``partition`` (always 1 for an input).
    """
    import cupy as cp

    from mpshuffle.table.device import DeviceAdapter

    total = sum(int(c.view(cp.uint64).sum(dtype=cp.uint64)) for c in t.columns.values()) % 2**64
    member = 1
    if partition is not None and t.nrows:
        member = int(bool((DeviceAdapter().partition_ids(t, ["key"], npartitions) == partition).all()))
    return [int(t.nrows), total, member]


def stats_probe(dask_worker: Any) -> dict[str, Any]:
    """Statistics of the last run on this worker."""
    from mpshuffle.dask.worker import PLUGIN_NAME

    ctx = dask_worker.plugins[PLUGIN_NAME].context
    return dict(ctx.history[-1][1]) if ctx is not None and ctx.history else {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gb", type=float, nargs="+", default=[2.0, 5.0, 10.0], help="GB of input per GPU")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--inputs", type=int, default=4, help="input partitions per GPU")
    ap.add_argument("--npartitions", type=int, default=16)
    ap.add_argument("--pool-size", type=float, default=0.6)
    ap.add_argument("--spill-device", type=float, default=0.5)
    ap.add_argument("--out", default="gpu_dask_bench.json")
    args = ap.parse_args()

    import cupy as cp
    from distributed import Client, Nanny, Scheduler, SpecCluster, wait

    from mpshuffle.dask import bootstrap_dask_cluster, shuffle_graph
    from mpshuffle.table.device import DeviceTable
    from mpshuffle.table.gpu import register_device_adapter

    register_device_adapter()
    ngpu = cp.cuda.runtime.getDeviceCount()
    workers = {
        f"gpu{i}": {"cls": Nanny, "options": {
            "nthreads": 1, "env": {"CUDA_VISIBLE_DEVICES": str(i), "NCCL_NVLS_ENABLE": "0"},
        }}
        for i in range(ngpu)
    }
    results: list[dict[str, Any]] = []
    sched = {"cls": Scheduler, "options": {"dashboard_address": ":0"}}
    with SpecCluster(workers=workers, scheduler=sched) as cluster, Client(cluster) as client:
        client.wait_for_workers(ngpu)
        t0 = time.perf_counter()
        gen = bootstrap_dask_cluster(client, pool_size=args.pool_size, spill_device=args.spill_device)
        print(f"bootstrap {time.perf_counter() - t0:.2f} s, {gen.nranks} ranks", flush=True)
        addrs = sorted(client.sync(client.scheduler.identity, n_workers=-1)["workers"])
        meta = DeviceTable({k: cp.empty(0, dtype=d) for k, d in
                            (("key", cp.int64), ("a", cp.float64), ("b", cp.float64), ("c", cp.float64))})
        for gb in args.gb:
            nin = args.inputs * ngpu
            nrows = int(gb * 1e9 / 32 / args.inputs)
            futs = [client.submit(make, i, nrows, int(gb * 100), workers=[addrs[i % ngpu]], pure=False)
                    for i in range(nin)]
            wait(futs)
            want = client.gather([client.submit(summary, f, pure=False) for f in futs])
            want_rows, want_sum = sum(w[0] for w in want), sum(w[1] for w in want) % 2**64
            secs, correct = [], []
            stats = {}
            for rep in range(args.reps):
                graph, keys = shuffle_graph([f.key for f in futs], on=["key"],
                                            npartitions=args.npartitions, meta=meta,
                                            token=f"bench-{gb}-{rep}")
                for k, task in list(graph.items()):
                    if isinstance(k, tuple) and "insert" in k[0]:
                        graph[k] = (task[0], futs[task[2]], *task[2:])
                count_keys = [("summary", j) for j in range(args.npartitions)]
                for j, (ck, k) in enumerate(zip(count_keys, keys, strict=True)):
                    graph[ck] = (summary, k, j, args.npartitions)
                t0 = time.perf_counter()
                got = client.get(graph, count_keys)
                secs.append(time.perf_counter() - t0)
                ok = (sum(g[0] for g in got) == want_rows == nin * nrows
                      and sum(g[1] for g in got) % 2**64 == want_sum and all(g[2] for g in got))
                if not ok:
                    raise SystemExit(f"{gb} GB, rep {rep}: output check failed: {got}")
                correct.append(ok)
                time.sleep(0.5)  # let the run's cleanup reach the workers
                stats = client.run(stats_probe)
            gb_gpu = args.inputs * nrows * 32 / 1e9
            row = {"method": "mpshuffle-dask", "gb_per_gpu": gb_gpu, "seconds": secs,
                   "best_gbps": gb_gpu / min(secs), "median_gbps": gb_gpu / sorted(secs)[len(secs) // 2],
                   "correct": correct, "stats": stats}
            print(json.dumps(row), flush=True)
            results.append(row)
            del futs
            time.sleep(0.5)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
