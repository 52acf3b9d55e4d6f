"""A/B of two versions of mpshuffle's rechunk in one invocation: a LocalCluster each, runs alternated.

Not a test. Cluster ``before`` runs the code of ``--before-src`` (a
worktree of the older commit's ``src``: its worker processes import
mpshuffle from there; its graph is built here by that ``src``'s
``mpshuffle/dask/rechunk.py``, loaded as module ``mpshuffle_before_rechunk``,
which the before workers alias to their own :mod:`mpshuffle.dask.rechunk`
so its tasks' functions resolve there; since session 18 the graphs differ
in functions the older code lacks), and for code older than session 16 with
``--before-unaligned``, which switches off
:func:`mpshuffle.dask.rechunk.aligned_per_partition` as that code built
it; session 16 always switched it off: right for the main of then, wrong
for main since the merge), cluster
``after`` this checkout's code; P2P and tasks run on a third cluster
(``dask``, this checkout's code) of their own: while they ran on ``after``,
its workers' memory was churned by them between its runs and ``before``'s
was not (in the first space-to-time A/B of session 17, ``before`` on
main's code took 4.6 CPU-s in median against ``after``'s 6.4). Variant ``after-copysent`` is
``after`` with the pieces for other ranks copied, never sent as views
(``VIEW_SEND_SLACK`` set to 0 on the workers for the run); ``after-norelease``
is ``after`` without giving received memory back at extract
(``NDArrayAdapter.copies_pieces`` false on the workers). Each cluster is ``--workers`` (2) workers x 1 thread of
16 GiB with the same persisted input; the variants take turns in rotated
order, one at a time (the other cluster idles). Every output block is
checked, CPU and peak are each cluster's own (``rechunk_bench._one``).

Run: ``python benchmarks/rechunk_code_ab.py time-to-space --before-src /tmp/main/src --repeat 3``
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dask
from distributed import Client, LocalCluster, wait
from distributed.diagnostics import MemorySampler
from rechunk_bench import _one, check, source

import mpshuffle
import mpshuffle.dask
import mpshuffle.dask.rechunk as rc


def _cluster(tmp: str, prepend: str | None, workers: int = 2) -> tuple[LocalCluster, Client]:
    # Spawned workers take the parent's sys.path: put the older code first while they start.
    saved = list(sys.path)
    if prepend:
        sys.path.insert(0, prepend)
    try:
        cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=":0",
                               memory_limit="16GiB", local_directory=tmp)
    finally:
        sys.path[:] = saved
    return cluster, Client(cluster, set_as_default=False)


def _before_module(src: str) -> Any:
    """``src``'s ``mpshuffle/dask/rechunk.py`` as module ``mpshuffle_before_rechunk`` (graph building only)."""
    spec = importlib.util.spec_from_file_location(
        "mpshuffle_before_rechunk", os.path.join(src, "mpshuffle", "dask", "rechunk.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pickled by reference under this name
    spec.loader.exec_module(module)
    return module


def _alias_before() -> None:
    import mpshuffle.dask.rechunk

    sys.modules["mpshuffle_before_rechunk"] = mpshuffle.dask.rechunk


def _send_slack(value: float) -> None:
    import mpshuffle.table.ndarray as nd

    nd.VIEW_SEND_SLACK = value


def _release(value: bool) -> None:
    from mpshuffle.table.ndarray import NDArrayAdapter

    NDArrayAdapter.copies_pieces = value


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("case", choices=("time-to-space", "space-to-time"))
    p.add_argument("--before-src", required=True)
    p.add_argument("--t", type=int, default=400)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--workers", type=int, default=2, help="workers x 1 thread per cluster")
    p.add_argument("--side", type=int, default=1000, help="spatial side S (a multiple of 20)")
    p.add_argument("--partition-mib", type=float, default=0,
                   help="output partition size of both versions' graphs (rechunk.PARTITION_BYTES; 0: their own)")
    p.add_argument("--variants", default="after,before,p2p,tasks")
    p.add_argument("--name", default="")
    p.add_argument("--warm", type=int, default=1,
                   help="untimed full-size rounds first (the VM's first fresh pages cost ~2x: the first timed "
                        "run of an A/A took 6.7-6.8 CPU-s against 4.2-5.9 for the rest)")
    p.add_argument("--before-first", action="store_true",
                   help="start the before cluster (and persist its input) first; for A/A checks of the slots")
    p.add_argument("--before-unaligned", action="store_true",
                   help="build the before graph without aligned_per_partition (code older than session 16)")
    a = p.parse_args()
    side, small = a.side, a.side // 20
    variants = a.variants.split(",")
    rows = []
    load = [os.getloadavg()]
    with tempfile.TemporaryDirectory() as tmp:
        if a.before_first:
            clusters = {"before": _cluster(tmp, a.before_src, a.workers), "after": _cluster(tmp, None, a.workers)}
        else:
            clusters = {"after": _cluster(tmp, None, a.workers), "before": _cluster(tmp, a.before_src, a.workers)}
        if any(v in ("p2p", "tasks") for v in variants):
            clusters["dask"] = _cluster(tmp, None, a.workers)
        try:
            inputs, pids = {}, {}
            clusters["before"][1].run(_alias_before)
            before_rc = _before_module(a.before_src)
            if a.partition_mib:
                rc.PARTITION_BYTES = before_rc.PARTITION_BYTES = int(a.partition_mib * 2**20)
            built_by = rc.rechunk
            for name, (_, client) in clusters.items():
                rc.rechunk = before_rc.rechunk if name == "before" else built_by
                where = client.run(lambda: __import__("mpshuffle").__file__)
                print(name, "imports", sorted(set(where.values())), flush=True)
                with client.as_current():
                    pids[name] = list(client.run(os.getpid).values())
                    mpshuffle.dask.bootstrap_dask_cluster(client)
                    warm = source((8, 40, 40), (1, 40, 40)).persist()
                    for m in ("mpshuffle", "p2p", "tasks"):
                        with dask.config.set({"array.rechunk.method": m}):
                            assert int(client.compute(check(warm.rechunk((8, 2, 2)))).result()) == 0
                    del warm
                    if a.case == "time-to-space":
                        x, target = source((a.t, side, side), (1, side, side)).persist(), (a.t, small, small)
                    else:
                        x, target = source((a.t, side, side), (a.t, small, small)).persist(), (1, side, side)
                    wait(x)
                    inputs[name] = x
            rc.rechunk = built_by
            sampler = MemorySampler()
            aligned = before_rc.aligned_per_partition
            for r in range(-a.warm, a.repeat):  # rounds < 0: untimed, not recorded
                for v in variants[r % len(variants):] + variants[: r % len(variants)]:
                    name = "before" if v == "before" else "dask" if v in ("p2p", "tasks") else "after"
                    slack = 0.0 if v == "after-copysent" else 1.125
                    if name == "after":
                        clusters["after"][1].run(_release, v != "after-norelease")
                    method = v if v in ("p2p", "tasks") else "mpshuffle"
                    client = clusters[name][1]
                    if v == "before":
                        rc.rechunk = before_rc.rechunk  # what Dask's rechunk, wrapped, calls
                    if v == "before" and a.before_unaligned:
                        before_rc.aligned_per_partition = lambda target, nout: target
                    elif name == "after":
                        clusters["after"][1].run(_send_slack, slack)
                    try:
                        with client.as_current():
                            row = _one(client, a.case, method, inputs[name], target, pids[name], sampler, f"{v}-{r}")
                    finally:
                        rc.rechunk = built_by
                        before_rc.aligned_per_partition = aligned
                    row.update(variant=v, round=r, load=os.getloadavg()[0])
                    if r >= 0:
                        rows.append(row)
                    print(f"{a.case} {r} {v:7s} {row['seconds']:6.2f} s cpu {row['cpu_seconds']:5.1f} "
                          f"peak {row['peak_bytes'] / 2**30:.2f} rss {row['peak_rss_bytes'] / 2**30:.2f} "
                          f"(start {row['start_rss_bytes'] / 2**30:.2f}) GiB load {row['load']:.1f}", flush=True)
            load.append(os.getloadavg())
        finally:
            for cluster, client in clusters.values():
                client.close()
                cluster.close()
    summary = {}
    for v in variants:
        mine = [x for x in rows if x["variant"] == v]
        summary[v] = {k: [min(vals), statistics.median(vals), max(vals)] for k, vals in (
            ("seconds", [x["seconds"] for x in mine]), ("cpu_seconds", [x["cpu_seconds"] for x in mine]),
            ("peak_gib", [round(x["peak_bytes"] / 2**30, 2) for x in mine]),
            ("peak_rss_gib", [round(x["peak_rss_bytes"] / 2**30, 2) for x in mine]))}
    by = {(x["variant"], x["round"]): x["seconds"] for x in rows}
    for v in variants:
        if v != "after":
            ratios = [by[v, r] / by["after", r] for r in range(a.repeat)]
            summary[f"x_{v}"] = [round(min(ratios), 2), round(statistics.median(ratios), 2), round(max(ratios), 2)]
    print(json.dumps(summary, indent=1))
    out = Path(__file__).resolve().parent / "results" / f"{a.name or 'rechunk-code-ab-' + a.case}.json"
    out.write_text(json.dumps({"case": a.case, "t": a.t, "side": side, "workers": a.workers,
                               "partition_mib": a.partition_mib, "before_src": a.before_src, "load": load,
                               "summary": summary, "rows": rows}, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
