"""The README's code runs as written, and .ci/run runs the README's test command."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
README = (ROOT / "README.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.DOTALL)


def test_readme_opens_with_the_two_commands() -> None:
    first = _blocks("bash")[0].strip().splitlines()
    assert len(first) == 2
    assert first[0].endswith("mpshuffle demo")
    assert 'pip install -e ".[demo]"' in first[0]  # the demo's packages are an extra
    assert "pytest" in first[1]
    assert README.index("```bash") < README.index("```python")


def test_ci_runs_the_readme_test_command_first_then_the_checks() -> None:
    test_command = _blocks("bash")[0].strip().splitlines()[1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_command in ci
    # The README's command is the first to use the environment; lint, types and layers follow.
    first = ci.index(test_command)
    assert ci.index(".venv/bin/") == first + test_command.index(".venv/bin/")
    for check in (".venv/bin/ruff check src tests", ".venv/bin/mypy src", ".venv/bin/lint-imports"):
        assert ci.index(check) > first, check


def test_readme_one_line_adoption_runs(tmp_path: Path) -> None:
    first = _blocks("python")[0]
    assert 'dask.config.set({"dataframe.shuffle.method": "mpshuffle"})' in first
    assert 'dask.config.set({"array.rechunk.method": "mpshuffle"})' in first
    script = tmp_path / "adoption.py"
    script.write_text(first)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # 5000 items of price 1.0 over 1000 orders of 7 customers: 143 orders for cust 0..5, 142 for 6.
    assert eval(proc.stdout.strip().splitlines()[-1]) == [715.0] * 6 + [710.0]
    assert float(proc.stdout.strip().splitlines()[-2]) == 40 * 100 * 100  # the rechunked cube's sum


def test_readme_usage_runs(tmp_path: Path) -> None:
    usage, options = _blocks("python")[1:3]
    # The options example continues the usage example inside its `with` block.
    program = usage + textwrap.indent(options, " " * 8)
    script = tmp_path / "usage.py"
    script.write_text(program)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sizes = eval(proc.stdout.strip().splitlines()[0])
    assert len(sizes) == 8 and sum(sizes) > 0


def test_readme_accessor_example_runs(tmp_path: Path) -> None:
    accessor = next(b for b in _blocks("python") if "df.mpshuffle" in b)
    script = tmp_path / "accessor.py"
    script.write_text(accessor)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[40, 30, 20, 10]" in proc.stdout
