"""Run Dask's own shuffle, merge and groupby tests (or its rechunk tests) with the method switched to mpshuffle.

The test modules ship in the dask wheel. This script copies them from the
installed dask into a temporary directory, rewrites **only the choice of
method** and runs pytest twice: with ``tasks`` (the baseline) and with
``mpshuffle``. Two suites:

* ``shuffle`` (the default): Dask's DataFrame shuffle, merge and groupby
  modules. The rewrite covers the ``shuffle_method`` fixture's parameters (in
  dask's ``conftest.py``), the lists of ``@pytest.mark.parametrize(
  "shuffle_method", ...)`` and ``("shuffle", ...)``, and the default
  ``dataframe.shuffle.method``. A rewritten list holds one parameter with the
  id ``method``, so a test has the same id in both runs.
* ``rechunk``: ``dask/array/tests/test_rechunk.py``, whose tests choose no
  method themselves: the rewrite is the default ``array.rechunk.method``.

It exits non-zero unless every test that passes with ``tasks`` passes with
``mpshuffle``, and unless mpshuffle's tasks really ran: a Dask callback counts
the executed tasks whose key starts with ``mpshuffle`` in each test, and
among them the insert tasks (those that hand data to mpshuffle's engine; a
rechunk that needs no exchange runs only its ``mpshuffle-rechunk`` output
tasks). All tests here run on Dask's local schedulers.

Usage::

    python tests/dask_suite/run_dask_tests.py [--suite rechunk] [--json OUT] [--keep DIR] [--serial] [-- PYTEST_ARGS...]

The two runs go at once in two processes (they share nothing; on 2 cores this
takes about the time of the slower one), or one after the other with ``--serial``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODULES = [
    "dataframe/tests/test_shuffle.py",
    "dataframe/tests/test_multi.py",
    "dataframe/dask_expr/tests/test_shuffle.py",
    "dataframe/dask_expr/tests/test_merge.py",
    "dataframe/dask_expr/tests/test_groupby.py",
]
RECHUNK_MODULES = ["array/tests/test_rechunk.py"]
#: Per suite: its modules, the dask.config key that chooses the method, whether
#: dask's conftest.py has a shuffle_method fixture to rewrite.
SUITES = {
    "shuffle": (MODULES, "dataframe.shuffle.method", True),
    "rechunk": (RECHUNK_MODULES, "array.rechunk.method", False),
}
METHODS = ("tasks", "mpshuffle")
ENV = "MPSHUFFLE_DASK_SUITE_METHOD"
RESULTS_ENV = "MPSHUFFLE_DASK_SUITE_RESULTS"

# A parametrize list of method names: `"shuffle_method", [...]` or `"shuffle", [...]`.
_PARAMETRIZE = re.compile(
    r"""(parametrize\(\s*["'](?:shuffle_method|shuffle)["']\s*,\s*)\[([^\[\]]*)\]""", re.DOTALL
)
_FIXTURE = re.compile(r"""@pytest\.fixture\(params=\[([^\[\]]*)\]\)\s*\ndef shuffle_method\(""")
_METHOD_NAMES = {"tasks", "disk", "p2p", "None"}
_PARAM = 'pytest.param(__import__("os").environ["' + ENV + '"], id="method")'

PLUGIN = '''
# --- added by mpshuffle's run_dask_tests.py: the default method and the task counter ---
import json as _json
import os as _os

import dask as _dask
from dask.callbacks import Callback as _Callback

_METHOD = _os.environ["{env}"]
if _METHOD == "mpshuffle":
    import mpshuffle.dask  # noqa: F401  (makes "mpshuffle" a Dask shuffle and rechunk method)
_dask.config.set({{"{config}": _METHOD}})

_RESULTS = {{}}
_CURRENT = [None]


def _key_name(key):
    return key[0] if isinstance(key, tuple) else key


class _CountMPShuffleTasks(_Callback):
    def _pretask(self, key, dsk, state):
        name = _key_name(key)
        if not isinstance(name, str) or _CURRENT[0] is None:
            return
        # An insert that Dask fused into its input's task is named by Dask's
        # rule, "<input>-mpshuffle-<token>" (MPInsert's docstring).
        fused = "-mpshuffle-" in name and not name.startswith("mpshuffle")
        if name.startswith("mpshuffle") or fused:
            _RESULTS[_CURRENT[0]]["mpshuffle_tasks"] += 1
            if "-insert-" in name or fused:
                _RESULTS[_CURRENT[0]]["mpshuffle_inserts"] += 1


_CountMPShuffleTasks().register()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    _RESULTS.setdefault(item.nodeid, {{"phases": {{}}, "mpshuffle_tasks": 0, "mpshuffle_inserts": 0, "seconds": 0.0}})
    _CURRENT[0] = item.nodeid


def pytest_runtest_logreport(report):
    entry = _RESULTS.setdefault(
        report.nodeid, {{"phases": {{}}, "mpshuffle_tasks": 0, "mpshuffle_inserts": 0, "seconds": 0.0}}
    )
    if hasattr(report, "wasxfail"):
        outcome = "xpassed" if report.passed else "xfailed"
    else:
        outcome = report.outcome
    entry["phases"][report.when] = outcome
    entry["seconds"] += report.duration
    phases = entry["phases"]
    if "failed" in phases.values():
        entry["outcome"] = "failed"
    else:
        entry["outcome"] = phases.get("call", phases.get("setup"))


def pytest_sessionfinish(session, exitstatus):
    with open(_os.environ["{results}"], "w") as f:
        _json.dump(_RESULTS, f, indent=0, sort_keys=True)
'''


def _rewrite_lists(text: str) -> tuple[str, int]:
    """Replace parametrize lists of method names by the one method of this run."""

    def repl(m: re.Match[str]) -> str:
        items = [s.strip().strip("\"'") for s in m.group(2).split(",") if s.strip()]
        if not items or not set(items) <= _METHOD_NAMES:
            return m.group(0)
        return f"{m.group(1)}[{_PARAM}]"

    return _PARAMETRIZE.subn(repl, text)


def prepare(dask_dir: Path, out: Path, suite: str = "shuffle") -> dict[str, int]:
    """Copy the test modules of ``suite`` and dask's conftest into ``out`` with the method choice rewritten.

    Returns the number of rewritten lists per file.
    """
    modules, config, fixture = SUITES[suite]
    counts = {}
    for rel in modules:
        text, n = _rewrite_lists((dask_dir / rel).read_text())
        dest = out / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text)
        counts[rel] = n
    conftest = (dask_dir / "conftest.py").read_text()
    if fixture:
        conftest, n = _FIXTURE.subn(
            f"@pytest.fixture(params=[{_PARAM}])\ndef shuffle_method(", conftest
        )
        if n != 1:
            raise SystemExit("dask's conftest.py has no shuffle_method fixture to rewrite")
        counts["conftest.py"] = n
    plugin = PLUGIN.format(env=ENV, results=RESULTS_ENV, config=config)
    (out / "conftest.py").write_text(conftest + plugin)
    (out / "pytest.ini").write_text("[pytest]\n")
    return counts


def start(
    out: Path, method: str, pytest_args: list[str], modules: list[str] = MODULES
) -> tuple[subprocess.Popen[str], float]:
    """Start the pytest run of ``method`` in a subprocess; its output goes to a log file."""
    env = dict(os.environ, **{ENV: method, RESULTS_ENV: str(out / f"results-{method}.json")})
    cmd = [
        # -P: the copied "array/" folder must not shadow the standard library's array module.
        sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(out / "pytest.ini"),
        "--rootdir", str(out), "--import-mode=importlib", "-o", "addopts=", *modules, *pytest_args,
    ]
    log = (out / f"pytest-{method}.log").open("w")
    proc = subprocess.Popen(cmd, cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    return proc, time.perf_counter()


def finish(out: Path, method: str, proc: subprocess.Popen[str], started: float) -> tuple[dict[str, dict], float]:
    """Wait for a run; return its results per test id and its seconds."""
    rc = proc.wait()
    seconds = time.perf_counter() - started
    text = (out / f"pytest-{method}.log").read_text()
    tail = text.strip().splitlines()[-1:] if text else []
    print(f"[{method}] pytest exit {rc} in {seconds:.0f} s: {' '.join(tail)}", flush=True)
    results = out / f"results-{method}.json"
    if not results.exists():
        print(text[-5000:])
        raise SystemExit(f"the {method} run wrote no results")
    return json.loads(results.read_text()), seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--suite", choices=sorted(SUITES), default="shuffle",
        help="Dask's DataFrame shuffle modules (default) or its array rechunk module",
    )
    parser.add_argument("--json", help="write the comparison as JSON to this file")
    parser.add_argument("--keep", help="prepare and keep the modules in this directory")
    parser.add_argument(
        "--serial", action="store_true",
        help="run the two methods one after the other (by default at once: two processes)",
    )
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args(argv)

    import dask

    dask_dir = Path(dask.__file__).parent
    out = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="mpshuffle-dask-suite-"))
    if args.keep and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        counts = prepare(dask_dir, out, args.suite)
        modules = SUITES[args.suite][0]
        print(f"dask {dask.__version__}: rewrote the method choice in {counts}", flush=True)
        runs = {}
        if args.serial:
            for m in METHODS:
                runs[m] = finish(out, m, *start(out, m, args.pytest_args, modules))
        else:
            started = {m: start(out, m, args.pytest_args, modules) for m in METHODS}
            runs = {m: finish(out, m, *started[m]) for m in METHODS}
        base, mps = runs["tasks"][0], runs["mpshuffle"][0]
        passed_base = sorted(k for k, v in base.items() if v["outcome"] == "passed")
        regressions = sorted(
            (k, mps.get(k, {}).get("outcome")) for k in passed_base
            if mps.get(k, {}).get("outcome") != "passed"
        )
        ran = {k: v["mpshuffle_tasks"] for k, v in mps.items() if v["mpshuffle_tasks"]}
        inserted = {k: v["mpshuffle_inserts"] for k, v in mps.items() if v["mpshuffle_inserts"]}
        slowest = sorted(
            ((round(v["seconds"], 2), round(base.get(k, {}).get("seconds", 0.0), 2), k)
             for k, v in mps.items()), reverse=True,
        )[:10]
        summary = {
            "dask": dask.__version__,
            "suite": args.suite,
            "tests": len(base),
            "passed_with_tasks": len(passed_base),
            "passed_with_mpshuffle": sum(v["outcome"] == "passed" for v in mps.values()),
            "regressions": regressions,
            "tests_running_mpshuffle_tasks": len(ran),
            "mpshuffle_tasks_executed": sum(ran.values()),
            "tests_running_mpshuffle_inserts": len(inserted),
            "mpshuffle_inserts_executed": sum(inserted.values()),
            "seconds": {m: round(r[1], 1) for m, r in runs.items()},
            "slowest_with_mpshuffle": slowest,
        }
        for k, outcome in regressions:
            print(f"REGRESSION {k}: passed with tasks, {outcome} with mpshuffle")
        for mps_s, base_s, k in slowest:
            print(f"slow: {mps_s:6.2f} s with mpshuffle, {base_s:6.2f} s with tasks: {k}")
        print(json.dumps({k: v for k, v in summary.items()
                          if k not in ("regressions", "slowest_with_mpshuffle")}))
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=1))
        if regressions:
            print(f"{len(regressions)} test(s) pass with tasks but not with mpshuffle "
                  f"(logs in {out})" if args.keep else "")
            return 1
        if not ran or not inserted:
            print("no test executed an mpshuffle task (or none an insert): the method switch did not "
                  "take effect")
            return 1
        print(f"{len(passed_base)} passed, 0 failed: every test that passes with tasks passes "
              f"with mpshuffle; {summary['mpshuffle_tasks_executed']} mpshuffle tasks ran in "
              f"{len(ran)} tests, {summary['mpshuffle_inserts_executed']} of them inserts in "
              f"{len(inserted)} tests")
        return 0
    finally:
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
