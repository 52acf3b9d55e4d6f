"""Where a fresh cluster's first config-line shuffle of TPC-H lineitem loses time against the next ones.

Not a test. Generates lineitem (``--sf``, ``--parts`` parquet parts; the
``demo`` extra's tpchgen-cli), starts one ``LocalCluster`` (2 workers x 1
thread, 8 GiB each), persists the table, and reports before the first
shuffle whether each worker's kernel warm-up
(:func:`mpshuffle.table.warm.warm_up`, started by the client preload) has
finished and how long it took. Then, optionally after ``--sleep`` seconds and
an explicit :func:`mpshuffle.dask.bootstrap_dask_cluster` (``--bootstrap``,
timed), it runs ``--repeats`` shuffles on ``l_orderkey`` through the config
line (``dataframe.shuffle.method`` = ``"mpshuffle"``, persisted), each with
its wall seconds, every worker process's CPU seconds, the engine's
``seconds_*`` statistics per rank and, with ``--signatures``, the compiled
kernel signatures each worker loaded during the shuffle beyond those it had
before (none: the warm-up covered the table's column types).

    python benchmarks/first_shuffle_lineitem.py [--sf 1] [--sleep 0] [--bootstrap] [--signatures]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from distributed import Client, LocalCluster, wait

import mpshuffle.dask  # noqa: F401 -- installs the shuffle method
from mpshuffle.dask import bootstrap_dask_cluster, gather_statistics

sys.path.insert(0, str(Path(__file__).resolve().parent))
from config_line_bench import lineitem, shuffled


def _cpu() -> float:
    import psutil

    t = psutil.Process().cpu_times()
    return float(t.user + t.system)


def _warmed() -> float | None:
    from mpshuffle.table.warm import warmed_up

    return warmed_up()


def _signatures() -> dict[str, list[str]]:
    from mpshuffle.table._kernels import kernels

    return {name: [str(s) for s in getattr(f, "signatures", [])] for name, f in vars(kernels()).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sf", type=float, default=1.0)
    parser.add_argument("--parts", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds of rest before the first shuffle")
    parser.add_argument("--bootstrap", action="store_true", help="bootstrap explicitly (timed) before it")
    parser.add_argument("--signatures", action="store_true", help="report kernel signatures each shuffle loaded")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        table, on = lineitem(args.sf, args.parts, Path(tmp) / "lineitem")
        with (
            LocalCluster(n_workers=2, threads_per_worker=1, memory_limit="8GiB", dashboard_address=":0") as cluster,
            Client(cluster) as client,
        ):
            df = table.persist()
            wait(df)
            print("warm-up seconds per worker at the first shuffle (None: not finished):", client.run(_warmed))
            time.sleep(args.sleep)
            if args.bootstrap:
                t = time.perf_counter()
                bootstrap_dask_cluster(client)
                print(f"bootstrap {time.perf_counter() - t:.3f} s")
            for i in range(args.repeats):
                before: Any = client.run(_signatures) if args.signatures else None
                cpu0 = client.run(_cpu)
                t = time.perf_counter()
                out = shuffled("config", df, on, df.npartitions).persist()
                wait(out)
                seconds = time.perf_counter() - t
                cpu1 = client.run(_cpu)
                print(f"shuffle {i}: {seconds:.2f} s, workers' CPU-s "
                      f"{[round(cpu1[w] - cpu0[w], 2) for w in sorted(cpu1)]}")
                for w, runs in sorted(gather_statistics(client).items()):
                    print("   ", w, {k: round(v, 3) for k, v in runs[-1].items() if k.startswith("seconds")})
                if before is not None:
                    for w, sigs in sorted(client.run(_signatures).items()):
                        new = {k: [s for s in v if s not in before[w].get(k, [])] for k, v in sigs.items()}
                        print("    new signatures", w, {k: v for k, v in new.items() if v} or "none")
                del out
                time.sleep(2)


if __name__ == "__main__":
    main()
