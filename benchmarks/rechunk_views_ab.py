"""A/B of the rechunk's kept pieces on one LocalCluster: views of the input block against copies, and P2P.

Not a test. The ``copy`` variant builds the same graph with ``views=False``
on every insert's adapter (patched on the client, where the graph is built),
so the kept pieces are copied into pooled buffers as before session 15;
``views`` is the default. Variants take turns in rotated order; every output
block is checked (``rechunk_bench._one``). 2 workers x 1 thread of 16 GiB.

Run: ``python benchmarks/rechunk_views_ab.py time-to-space 400 3 views,copy,p2p``
(case, time steps, rounds, variants); writes ``results/rechunk-views-ab-<case>.json``.
"""
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dask
from distributed import Client, LocalCluster, wait
from distributed.diagnostics import MemorySampler
from rechunk_bench import _one, check, source

import mpshuffle.dask
import mpshuffle.dask.rechunk as rc
from mpshuffle.table.ndarray import NDArrayAdapter


def main():
    case, t, repeat = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    variants = sys.argv[4].split(",")
    side = 1000
    with tempfile.TemporaryDirectory() as tmp, LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
            dashboard_address=":0", memory_limit="16GiB", local_directory=tmp) as cluster, Client(cluster) as client:
        pids = list(client.run(os.getpid).values())
        mpshuffle.dask.bootstrap_dask_cluster(client)
        warm = source((8, 40, 40), (1, 40, 40)).persist()
        for m in ("mpshuffle", "p2p"):
            with dask.config.set({"array.rechunk.method": m}):
                assert int(client.compute(check(warm.rechunk((8, 2, 2)))).result()) == 0
        if case == "time-to-space":
            x, target = source((t, side, side), (1, side, side)).persist(), (t, 50, 50)
        else:
            x, target = source((t, side, side), (t, 50, 50)).persist(), (1, side, side)
        wait(x)
        sampler = MemorySampler()
        rows = []
        for r in range(repeat):
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            for v in order:
                method = "p2p" if v == "p2p" else "mpshuffle"
                if v == "copy":
                    rc.NDArrayAdapter = lambda *a, views=False, **k: NDArrayAdapter(*a, **k)
                try:
                    row = _one(client, case, method, x, target, pids, sampler, f"{v}-{r}")
                finally:
                    rc.NDArrayAdapter = NDArrayAdapter
                row["variant"] = v
                rows.append(row)
                print(f"{case} {r} {v:6s} {row['seconds']:6.2f} s cpu {row['cpu_seconds']:5.1f} peak {row['peak_bytes']/2**30:.2f} GiB load {os.getloadavg()[0]:.1f}", flush=True)
        for v in variants:
            mine = [x for x in rows if x["variant"] == v]
            s = sorted(x["seconds"] for x in mine); c = sorted(x["cpu_seconds"] for x in mine); p = sorted(x["peak_bytes"]/2**30 for x in mine)
            print(v, "s", s, "cpu", c, "peak", [round(q, 2) for q in p])
        out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"rechunk-views-ab-{case}.json")
        with open(out, "w") as f:
            json.dump({"case": case, "t": t, "load_average_end": os.getloadavg(), "rows": rows}, f, indent=1)

if __name__ == "__main__":
    main()
