"""mpshuffle bench writes its JSON, and its PNG only where matplotlib is installed."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from mpshuffle.demo import bench

NOTE = (
    'matplotlib not installed (pip install -e ".[bench]" in a clone of mpshuffle, or pip install '
    '"mpshuffle[bench]"); no plot written'
)


def _case(gb: float, mb_per_s: dict[str, tuple[float, float]]) -> dict[str, Any]:
    nbytes = int(gb * 1e9)
    runs = []
    for method, speeds in mb_per_s.items():
        for speed in speeds:
            runs.append({
                "method": method, "seconds": nbytes / 1e6 / speed, "mb_per_s": speed,
                "peak_rss": [nbytes, nbytes], "peak_cluster_rss": 2 * nbytes,
                "baseline_cluster_rss": 0, "disk_write_bytes": 0, "worker_cpu_seconds": 1.0,
                "worker_cpu_user_seconds": 0.75, "worker_cpu_system_seconds": 0.25,
                "worker_cpu_s_per_gb": 1.0 / gb * (100.0 / speed),
                "load_average_1min": 0.0, **({"bytes_spilled": 0} if method == "mpshuffle" else {}),
            })
    case = {"input_bytes": nbytes, "rows": 1000, "runs": runs, "data": "synthetic", "workers": 2,
            "partitions": 4, "gb": gb, "memory_limit": 2**30, "bootstrap_seconds": 0.05}
    case["summary"] = bench.summarize(case)
    return case


def _results(output: Path) -> dict[str, Any]:
    cases = [
        _case(0.01, {"mpshuffle": (400.0, 500.0), "p2p": (100.0, 200.0), "tasks": (50.0, 100.0)}),
        _case(0.02, {"mpshuffle": (600.0, 800.0), "p2p": (200.0, 200.0), "tasks": (100.0, 100.0)}),
    ]
    return {"versions": bench.versions(), "args": {}, "plot": bench._plot_path(str(output), cases),
            "cases": cases}


def test_summary_has_medians_cpu_per_gb_and_system_share() -> None:
    case = _case(0.5, {"mpshuffle": (400.0, 500.0, 600.0), "p2p": (100.0, 200.0, 100.0),
                       "tasks": (50.0, 100.0, 150.0)})
    s = case["summary"]
    assert s["mpshuffle"]["mb_per_s_median"] == 500.0 and s["p2p"]["mb_per_s_median"] == 100.0
    assert s["mpshuffle/p2p"]["throughput_median"] == 5.0
    # CPU-s/GB as the runs recorded them: 2 * 100 / speed here.
    assert s["mpshuffle"]["worker_cpu_s_per_gb_median"] == pytest.approx(2 * 100 / 500)
    assert s["mpshuffle/p2p"]["worker_cpu_per_gb"] == pytest.approx((2 * 100 / 100) / (2 * 100 / 500))
    assert s["tasks"]["worker_cpu_system_share_median"] == 0.25
    assert "0.40" in bench.report({"cases": [case]}) and "4.0/5.0/3.0" in bench.report({"cases": [case]})


@pytest.fixture
def no_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``import matplotlib`` fail as it does without the [bench] extra."""
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)


def test_without_matplotlib_json_only_and_one_note(
    no_matplotlib: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "out" / "bench.json"
    results = _results(output)
    assert results["plot"] is None
    bench._write(results, str(output))
    bench._write(results, str(output))  # after the next case: no second note
    assert json.loads(output.read_text()) == json.loads(json.dumps(results))
    assert sorted(p.name for p in output.parent.iterdir()) == ["bench.json"]
    assert capsys.readouterr().out == NOTE + "\n"


def test_without_matplotlib_the_summary_still_prints(
    no_matplotlib: None, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    output = tmp_path / "bench.json"

    def run(args: argparse.Namespace) -> dict[str, Any]:
        results = _results(Path(args.output))
        bench._write(results, args.output)
        return results

    monkeypatch.setattr(bench, "run", run)
    assert bench.run_and_report(argparse.Namespace(output=str(output))) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == NOTE
    assert lines[-1] == f"results: {output}"
    rows = [line.split() for line in lines[2:-1] if not line.startswith(" ")]
    assert [(r[0], r[5]) for r in rows] == [
        ("0.01GB", "mpshuffle"), ("0.01GB", "p2p"), ("0.01GB", "tasks"),
        ("0.02GB", "mpshuffle"), ("0.02GB", "p2p"), ("0.02GB", "tasks"),
    ]
    # mpshuffle/p2p throughput of the first case: worst 400/100, median 450/150, best 500/200.
    assert rows[1][-1] == "4.0/3.0/2.5"
    assert not (tmp_path / "bench.png").exists()


def test_with_matplotlib_the_png_is_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")  # the [bench] extra; the dev venv has it
    output = tmp_path / "bench.json"
    results = _results(output)
    assert results["plot"] == str(tmp_path / "bench.png")
    bench._write(results, str(output))
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(output.read_text())["plot"] == str(tmp_path / "bench.png")
    assert capsys.readouterr().out == ""


def test_lineitem_only_sweep_has_no_plot_and_no_note(
    no_matplotlib: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench._plot_path("bench.json", [{"data": "lineitem"}]) is None
    assert capsys.readouterr().out == ""


def _lineitem_rows(files: list[str]) -> int:
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(f).metadata.num_rows for f in files)


def test_lineitem_reuses_only_a_finished_generation(tmp_path: Path) -> None:
    df, on = bench._lineitem(0.001, 2, str(tmp_path))
    root = tmp_path / "sf0.001-p2"
    parts = sorted(str(p) for p in (root / "lineitem").glob("*.parquet"))
    assert on == "l_orderkey" and df.npartitions == 2 and len(parts) == 2
    expected = _lineitem_rows(parts)
    assert int(df.shape[0].compute(scheduler="sync")) == expected > 5000  # about 6000 at scale factor 0.001
    # A finished generation is reused as it is.
    stamps = [Path(p).stat().st_mtime_ns for p in parts]
    bench._lineitem(0.001, 2, str(tmp_path))
    assert [Path(p).stat().st_mtime_ns for p in parts] == stamps
    # An interrupted one (a part missing, no stamp) is generated anew, not read as it is.
    Path(parts[1]).unlink()
    (root / "lineitem.done").unlink()
    df, _ = bench._lineitem(0.001, 2, str(tmp_path))
    assert df.npartitions == 2
    assert int(df.shape[0].compute(scheduler="sync")) == expected


@pytest.mark.parametrize("given", [False, True])
def test_run_removes_its_temporary_data_dir_and_keeps_a_given_one(
    given: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where TemporaryDirectory makes its folder
    given_dir = tmp_path / "data"
    seen: list[str] = []

    def fake_cases(args: Any, cases: Any, results: Any, data_dir: str) -> None:
        seen.append(data_dir)
        (Path(data_dir) / "sf1-p2").mkdir(parents=True)  # what a lineitem generation leaves

    monkeypatch.setattr(bench, "_run_cases", fake_cases)
    args = argparse.Namespace(
        data_dir=str(given_dir) if given else None, output=str(tmp_path / "out.json"), sizes=[0.01],
        workers=[2], partitions=[4], gb_per_worker=None, lineitem_sf=None, repeats=2,
    )
    results = bench.run(args)
    assert results["cases"] == [] and len(seen) == 1
    if given:
        assert seen == [str(given_dir)] and (given_dir / "sf1-p2").is_dir()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]
    else:
        assert Path(seen[0]).name.startswith("mpshuffle-bench-") and Path(seen[0]).parent == tmp_path
        assert not Path(seen[0]).exists() and list(tmp_path.iterdir()) == []


def test_lineitem_in_one_partition(tmp_path: Path) -> None:
    df, _ = bench._lineitem(0.001, 1, str(tmp_path))
    assert df.npartitions == 1
    rows = _lineitem_rows([str(tmp_path / "sf0.001-p1" / "lineitem.parquet")])
    assert int(df.shape[0].compute(scheduler="sync")) == rows > 5000
