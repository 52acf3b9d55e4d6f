"""The demo and the benchmark: ``mpshuffle demo`` and ``mpshuffle bench``.

Apart from the library: :mod:`mpshuffle.demo.tpch` (TPC-H data, a Q3-style
join and its DuckDB oracle), :mod:`mpshuffle.demo.job` (the demo) and
:mod:`mpshuffle.demo.bench` (mpshuffle against Dask's shuffles). Their extra
dependencies — tpchgen-cli, DuckDB and tqdm — come with the ``demo`` extra
(``pip install -e ".[demo]"``); the library never imports them. Importing
this package imports none of them either; :func:`require` says which are
missing.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from typing import Any

__all__ = ["EXTRA", "ExtraMissingError", "missing", "progress_bar", "require", "tpchgen_path"]

#: The extra that installs what the demo and the benchmark need.
EXTRA = "demo"

# Python modules of the extra (their import names).
_MODULES = ("duckdb", "tqdm")


class ExtraMissingError(RuntimeError):
    """A command of the demo runs without the dependencies of the ``demo`` extra."""


def tpchgen_path() -> str | None:
    """Path of the ``tpchgen-cli`` executable, or ``None`` if it is not installed.

    Looked for next to the Python executable first (a virtual environment
    that is not activated), then on ``PATH``.
    """
    exe = Path(sys.executable).with_name("tpchgen-cli")
    return str(exe) if exe.exists() else shutil.which("tpchgen-cli")


def _installed(module: str) -> bool:
    if module in sys.modules:
        # Present, or blocked with ``sys.modules[name] = None``.
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


def missing(extra: str = EXTRA) -> list[str]:
    """Names of an extra's requirements that are not installed.

    Parameters
    ----------
    extra
        ``"demo"`` (what ``mpshuffle demo`` and ``mpshuffle bench`` need) or
        ``"bench"`` (the demo extra and matplotlib, for the benchmark's plot).

    Returns
    -------
    list of str
        Python modules (``duckdb``, ``tqdm``), the ``tpchgen-cli``
        executable and, for ``"bench"``, ``matplotlib``, that were not
        found, in that order; empty when all are.

    Raises
    ------
    ValueError
        If ``extra`` is neither.
    """
    if extra not in (EXTRA, "bench"):
        raise ValueError(f"extra must be {EXTRA!r} or 'bench', got {extra!r}")
    names = [m for m in _MODULES if not _installed(m)]
    if tpchgen_path() is None:
        names.append("tpchgen-cli")
    if extra == "bench" and not _installed("matplotlib"):
        names.append("matplotlib")
    return names


def require(command: str) -> None:
    """Check that the ``demo`` extra is installed before ``command`` starts.

    Parameters
    ----------
    command
        The command that needs it, for the message (``"mpshuffle demo"``).

    Raises
    ------
    ExtraMissingError
        Naming the missing requirements, the extra and how to install it.
    """
    absent = missing()
    if absent:
        raise ExtraMissingError(
            f"{command} needs the {EXTRA!r} extra, which is not installed "
            f"(missing: {', '.join(absent)}); install it with "
            f"pip install -e \".[{EXTRA}]\" in a clone of mpshuffle, "
            f"or pip install \"mpshuffle[{EXTRA}]\""
        )


def progress_bar(total: int, desc: str, unit: str, off: bool) -> Any:
    """A tqdm progress bar on stderr, drawn only where stderr is a terminal.

    Parameters
    ----------
    total
        Steps to come.
    desc, unit
        tqdm's label and unit.
    off
        No bar at all (``--no-progress``).

    Returns
    -------
    tqdm.tqdm
        Disabled when ``off`` or when stderr is not a terminal (a log file,
        a pipe), where a bar's redraws would only fill the file.
    """
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=off or not sys.stderr.isatty())
