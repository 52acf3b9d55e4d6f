"""Command line: ``mpshuffle demo | bench | info`` and ``mpshuffle --version``.

``mpshuffle demo`` is the README's main job (:mod:`mpshuffle.demo.job`) and
``mpshuffle bench`` the benchmark (:mod:`mpshuffle.demo.bench`); both need the
``demo`` extra and, without it, stop before anything starts with a message
naming the extra (exit status 2). ``mpshuffle info`` needs nothing beyond the
library.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mpshuffle.demo import ExtraMissingError, bench, job, missing, require
from mpshuffle.demo._cliargs import DefaultsHelpFormatter, positive_float, positive_int

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``mpshuffle`` command line.

    Parameters
    ----------
    argv
        Arguments without the program name; by default ``sys.argv[1:]``.

    Returns
    -------
    int
        The exit status: 0 on success, 1 if a verification failed, 2 if the
        ``demo`` extra that ``demo`` and ``bench`` need is not installed
        (argparse exits with 2 itself for bad arguments).
    """
    import mpshuffle

    parser = argparse.ArgumentParser(
        prog="mpshuffle",
        description="mpshuffle: fast, memory-bounded shuffles of dataframe partitions across a Dask cluster",
    )
    parser.add_argument("--version", action="version", version=f"mpshuffle {mpshuffle.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="shuffle TPC-H lineitem on a LocalCluster and report throughput",
        description="Generate TPC-H lineitem and orders (tpchgen-cli), start a LocalCluster, shuffle lineitem "
                    "on l_orderkey as a Dask user does (shuffle_method='mpshuffle'), verify the output, time "
                    "the same shuffle with Dask's P2P, and check TPC-H Q3's join against DuckDB.",
    )
    demo.add_argument("--scale-factor", "-s", type=positive_float, default=0.5,
                      help="TPC-H scale factor, > 0 (default 0.5: 3M rows; about 30-45 s on 2 idle cores, "
                           "data generation, the P2P comparison and the DuckDB check included)")
    demo.add_argument("--workers", type=positive_int, default=None,
                      help="workers, >= 1 (default: one per core, at least 2)")
    demo.add_argument("--partitions", type=positive_int, default=None,
                      help="output partitions, >= 1 (default: as many as input)")
    demo.add_argument("--data-dir", default=None,
                      help="where to write the generated data (default: a temporary dir, deleted after); "
                           "lineitem and orders that an earlier run left there are deleted and generated anew")
    demo.add_argument("--no-compare", action="store_true",
                      help="skip the same shuffle with Dask's P2P (which gives the demo's MB/s a yardstick)")
    demo.add_argument("--no-progress", action="store_true",
                      help="do not draw progress bars (they are never drawn when stderr is not a terminal)")
    sub.add_parser("info", help="print versions and available backends")
    bench.add_arguments(sub.add_parser(
        "bench", help="mpshuffle vs Dask's P2P and task shuffles (JSON; a PNG too with the bench extra's matplotlib)",
        description="Time mpshuffle, Dask's P2P and Dask's task shuffle on the same persisted data, taking "
                    "turns, on a LocalCluster per worker count; every output is verified. Prints per case "
                    "MB/s (min/median/max), peak memory, the workers' CPU-s per GB and its system share, and "
                    "each method's time over mpshuffle's ('x mps'); writes the runs as JSON.",
        formatter_class=DefaultsHelpFormatter,
    ))
    args = parser.parse_args(argv)
    if args.command == "info":
        return _info()
    try:
        require(f"mpshuffle {args.command}")
    except ExtraMissingError as e:
        print(f"mpshuffle: error: {e}", file=sys.stderr)
        return 2
    if args.command == "bench":
        return bench.run_and_report(args)
    return job.run(args)


def _info() -> int:
    import importlib
    import platform

    import mpshuffle

    print(f"mpshuffle   {mpshuffle.__version__}")
    print(f"python      {platform.python_version()} ({sys.executable})")
    for name in ("dask", "distributed", "pandas", "pyarrow", "numpy", "numba", "psutil"):
        mod = importlib.import_module(name)
        print(f"{name:<11} {getattr(mod, '__version__', '?')}")
    print("communicators:")
    print("  tcp         yes (distributed.comm: tcp://, tls://)")
    print("  local       yes (one process)")
    print("frame types:")
    print("  pandas      yes")
    print("  pyarrow     yes")
    for name, what in (("cupy", "GPU device tables, NCCL transport"), ("cudf", "cudf DataFrames")):
        try:
            importlib.import_module(name)
            print(f"  {name:<11} yes ({what})")
        except ImportError:
            print(f"  {name:<11} no  ({what}; not installed)")
        except Exception as e:  # noqa: BLE001 - e.g. CuPy installed but no CUDA driver: say so, go on
            print(f"  {name:<11} no  ({what}; import failed: {type(e).__name__}: {e})")
    print(f"demo extra  {_have(missing())}  (mpshuffle demo and bench)")
    print(f"bench extra {_have(missing('bench'))}  (the PNG plot of mpshuffle bench)")
    return 0


def _have(absent: list[str]) -> str:
    return "yes" if not absent else f"no (missing: {', '.join(absent)})"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
