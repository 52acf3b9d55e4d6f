"""mpshuffle bench writes its JSON, and its PNG only where matplotlib is installed."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from mpshuffle import bench

NOTE = "matplotlib not installed (pip install mpshuffle[bench]); no plot written"


def _case(gb: float, mb_per_s: dict[str, tuple[float, float]]) -> dict[str, Any]:
    nbytes = int(gb * 1e9)
    runs = []
    for method, speeds in mb_per_s.items():
        for speed in speeds:
            runs.append({
                "method": method, "seconds": nbytes / 1e6 / speed, "mb_per_s": speed,
                "peak_rss": [nbytes, nbytes], "peak_cluster_rss": 2 * nbytes,
                "baseline_cluster_rss": 0, "disk_write_bytes": 0, "worker_cpu_seconds": 1.0,
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
    # mpshuffle/p2p throughput of the first case: worst 400/100, best 500/200.
    assert rows[1][-1] == "4.0-2.5"
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
