"""The command line refuses out-of-range values before anything starts, naming the option."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mpshuffle import cli
from mpshuffle.demo import bench, job

BAD = [
    # demo
    (["demo", "--workers", "-1"], "--workers", "-1"),
    (["demo", "--workers", "0"], "--workers", "0"),
    (["demo", "--workers", "two"], "--workers", "two"),
    (["demo", "--partitions", "0"], "--partitions", "0"),
    (["demo", "--partitions", "-3"], "--partitions", "-3"),
    (["demo", "-s", "-1"], "--scale-factor/-s", "-1"),
    (["demo", "--scale-factor", "0"], "--scale-factor/-s", "0"),
    (["demo", "-s", "nan"], "--scale-factor/-s", "nan"),
    (["demo", "-s", "inf"], "--scale-factor/-s", "inf"),
    # bench
    (["bench", "--sizes", "0.5", "0"], "--sizes", "0"),
    (["bench", "--sizes", "-1"], "--sizes", "-1"),
    (["bench", "--gb-per-worker", "0"], "--gb-per-worker", "0"),
    (["bench", "--workers", "2", "0"], "--workers", "0"),
    (["bench", "--workers", "-2"], "--workers", "-2"),
    (["bench", "--partitions", "0"], "--partitions", "0"),
    (["bench", "--partitions", "1.5"], "--partitions", "1.5"),
    (["bench", "--repeats", "1"], "--repeats", "1"),
    (["bench", "--repeats", "0"], "--repeats", "0"),
    (["bench", "--memory-limit", "0"], "--memory-limit", "0"),
    (["bench", "--memory-limit", "-8"], "--memory-limit", "-8"),
    (["bench", "--lineitem-sf", "0"], "--lineitem-sf", "0"),
    (["bench", "--lineitem-sf", "-0.1"], "--lineitem-sf", "-0.1"),
]


@pytest.fixture
def ran(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, argparse.Namespace]]:
    """Replace the demo and the benchmark by recorders of the parsed arguments."""
    calls: list[tuple[str, argparse.Namespace]] = []

    def record(name: str) -> Any:
        def run(args: argparse.Namespace) -> int:
            calls.append((name, args))
            return 0

        return run

    monkeypatch.setattr(job, "run", record("demo"))
    monkeypatch.setattr(bench, "run_and_report", record("bench"))
    return calls


@pytest.mark.parametrize(("argv", "option", "value"), BAD, ids=[" ".join(a) for a, _, _ in BAD])
def test_bad_value_is_an_argparse_error_naming_the_option(
    ran: list[tuple[str, argparse.Namespace]], capsys: pytest.CaptureFixture[str],
    argv: list[str], option: str, value: str,
) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {option}: " in err
    assert repr(value) in err
    assert ran == []  # nothing started


def test_bench_main_refuses_the_same_values(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        bench.main(["--repeats", "1"])
    assert info.value.code == 2
    assert "error: argument --repeats: must be an integer >= 2, got '1'" in capsys.readouterr().err


def test_good_values_are_kept(ran: list[tuple[str, argparse.Namespace]]) -> None:
    assert cli.main(["demo", "-s", "0.05", "--workers", "1", "--partitions", "1"]) == 0
    assert cli.main(["demo"]) == 0
    assert cli.main(["bench", "--sizes", "0.01", "0.5", "--workers", "1", "3", "--partitions", "1",
                     "--repeats", "2", "--memory-limit", "0.5", "--lineitem-sf", "0.01",
                     "--gb-per-worker", "0.1"]) == 0
    assert cli.main(["bench", "--no-warmup"]) == 0
    (_, demo), (_, default), (_, b), (_, cold) = ran
    assert [n for n, _ in ran] == ["demo", "demo", "bench", "bench"]
    assert (b.no_warmup, cold.no_warmup) == (False, True)
    assert (demo.scale_factor, demo.workers, demo.partitions) == (0.05, 1, 1)
    # No value means "the default", decided by the demo (not 0 or a falsy value).
    assert (default.scale_factor, default.workers, default.partitions) == (0.5, None, None)
    assert (b.sizes, b.workers, b.partitions, b.repeats) == ([0.01, 0.5], [1, 3], [1], 2)
    assert (b.memory_limit, b.lineitem_sf, b.gb_per_worker) == (0.5, 0.01, 0.1)


def test_console_entry_exits_2_without_starting_a_cluster() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mpshuffle.cli", "demo", "--workers", "-1"],
        check=False, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "mpshuffle demo: error: argument --workers: must be an integer >= 1, got '-1'" in proc.stderr
    assert proc.stdout == ""


def test_version_is_the_installed_distributions() -> None:
    import importlib.metadata

    import mpshuffle

    proc = subprocess.run(
        [sys.executable, "-m", "mpshuffle.cli", "--version"],
        check=False, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"mpshuffle {mpshuffle.__version__}\n"
    assert mpshuffle.__version__ == importlib.metadata.version("mpshuffle")
    assert mpshuffle.__version__.count(".") >= 2


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_without_the_demo_extra_the_command_names_it_and_starts_nothing(
    ran: list[tuple[str, argparse.Namespace]], capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch, command: str,
) -> None:
    import mpshuffle.demo

    # As on a machine where only `pip install mpshuffle` ran: no tqdm, no tpchgen-cli.
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setattr(mpshuffle.demo, "tpchgen_path", lambda: None)
    assert mpshuffle.demo.missing() == ["tqdm", "tpchgen-cli"]
    assert cli.main([command]) == 2
    err = capsys.readouterr().err
    assert f"mpshuffle {command} needs the 'demo' extra, which is not installed (missing: tqdm, tpchgen-cli)" in err
    assert 'pip install -e ".[demo]"' in err
    assert ran == []  # nothing started
    with pytest.raises(mpshuffle.demo.ExtraMissingError, match="'demo' extra"):
        bench.main(["--repeats", "2"])


def test_the_library_and_info_work_without_the_demo_extra() -> None:
    # duckdb, tqdm and matplotlib made unimportable; a shuffle on Dask's sync scheduler.
    code = (
        "import sys\n"
        "for name in ('duckdb', 'tqdm', 'matplotlib'):\n"
        "    sys.modules[name] = None\n"
        "import dask, dask.dataframe as dd, pandas as pd\n"
        "from mpshuffle.dask import shuffle\n"
        "df = dd.from_pandas(pd.DataFrame({'k': range(100), 'v': range(100)}), npartitions=4)\n"
        "with dask.config.set(scheduler='sync'):\n"
        "    out = shuffle(df, 'k', npartitions=3).compute()\n"
        "assert sorted(out['v']) == list(range(100)), out\n"
        "from mpshuffle.cli import main\n"
        "sys.exit(main(['info']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "demo extra  no (missing: duckdb, tqdm)" in proc.stdout
    assert "bench extra no (missing: duckdb, tqdm, matplotlib)" in proc.stdout
    assert "\nnumba " in proc.stdout


def test_bench_help_shows_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, run in ((["bench", "--help"], cli.main), (["--help"], bench.main)):
        with pytest.raises(SystemExit) as done:
            run(argv)
        assert done.value.code == 0
        out = " ".join(capsys.readouterr().out.split())
        assert "(default: [0.25, 0.5, 1.0, 2.0])" in out and "(default: 8.0)" in out, out


def test_no_progress_bar_without_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    from mpshuffle.demo import progress_bar

    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)  # a log file
    assert progress_bar(3, "shuffle", "partition", off=False).disable
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # a terminal
    with progress_bar(3, "shuffle", "partition", off=False) as bar:
        assert not bar.disable
    assert progress_bar(3, "shuffle", "partition", off=True).disable


_KERNELS_CACHED = """
import pandas as pd

from mpshuffle.demo.job import kernels_cached
from mpshuffle.table import PandasAdapter

assert kernels_cached() is False  # an empty cache: a run would compile
pieces = PandasAdapter().split_for(pd.DataFrame({"k": range(50)}), ["k"], 4, None, rank=0, nranks=2)
assert sum(p.nrows for p in pieces.values()) == 50
assert kernels_cached() is True  # the insert compiled its kernels into it
print("ok")
"""


def test_demo_knows_whether_this_run_compiles_the_kernels(tmp_path: Path) -> None:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    proc = subprocess.run([sys.executable, "-c", _KERNELS_CACHED], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ok")
