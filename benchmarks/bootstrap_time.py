"""Time mpshuffle's bootstrap on a LocalCluster of N workers.

Reports two figures (seconds):

* ``first``: the first ``bootstrap_dask_cluster`` call on a fresh cluster. It
  includes registering the plugins, which imports mpshuffle (and with it
  pandas and pyarrow) on every worker that has not imported them yet.
* ``round``: the bootstrap's collective round itself on warm workers — a new
  generation forced by changing an option — repeated, min / median / max.

Usage: ``python benchmarks/bootstrap_time.py --workers 2 8 16 [--repeats 5] [-o out.json]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from distributed import Client, LocalCluster


def measure(nworkers: int, repeats: int) -> dict[str, object]:
    """Bootstrap times on a fresh LocalCluster of ``nworkers`` single-threaded workers."""
    from mpshuffle.dask import bootstrap_dask_cluster

    with LocalCluster(n_workers=nworkers, threads_per_worker=1, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        t0 = time.perf_counter()
        gen = bootstrap_dask_cluster(client)
        first = time.perf_counter() - t0
        assert gen.nranks == nworkers and gen.bootstrapped
        rounds = []
        for i in range(repeats):
            t0 = time.perf_counter()
            gen = bootstrap_dask_cluster(client, timeout=300 + i + 1)  # new options: new generation
            rounds.append(time.perf_counter() - t0)
            assert gen.bootstrapped and gen.nranks == nworkers
        t0 = time.perf_counter()
        again = bootstrap_dask_cluster(client, timeout=300 + repeats)
        reuse = time.perf_counter() - t0
        assert not again.bootstrapped
    return {
        "workers": nworkers,
        "first": first,
        "round_min": min(rounds),
        "round_median": statistics.median(rounds),
        "round_max": max(rounds),
        "reuse": reuse,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("-o", "--output", default=None, help="JSON file for the results")
    args = parser.parse_args()
    results = [measure(n, args.repeats) for n in args.workers]
    for r in results:
        print(f"{r['workers']:>3} workers: first {r['first']:.3f} s, round min/median/max "
              f"{r['round_min']:.3f}/{r['round_median']:.3f}/{r['round_max']:.3f} s, "
              f"reuse {r['reuse']:.4f} s")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
