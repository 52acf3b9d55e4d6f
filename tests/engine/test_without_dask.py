"""The engine imports without Dask at run time, as the lint-imports contracts say statically.

lint-imports follows import statements; this runs them: every module of the
engine packages is imported in a fresh interpreter in which ``dask`` and
``distributed`` cannot be imported (package ``__init__`` files run too, which a
static graph does not model), and a frame goes through the pandas adapter.
"""

from __future__ import annotations

import subprocess
import sys

# The engine: what the "engine-without-dask" contract of pyproject.toml names,
# and the communicator modules other than the tcp backend (which is distributed's).
_CHECK = r"""
import importlib, pkgutil, sys

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("dask", "distributed"):
            raise ImportError(f"engine imported {name}")
        return None

sys.meta_path.insert(0, Refuse())
import mpshuffle
names = ["mpshuffle.errors", "mpshuffle.options"]
for pkg in ("shuffler", "table", "memory", "comm"):
    mod = importlib.import_module(f"mpshuffle.{pkg}")
    names.append(mod.__name__)
    names += [m.name for m in pkgutil.walk_packages(mod.__path__, mod.__name__ + ".")]
names = [n for n in names if n != "mpshuffle.comm.tcp"]
for name in names:
    importlib.import_module(name)

import pandas as pd
from mpshuffle.table import PandasAdapter
frame = pd.DataFrame({"k": range(50), "v": range(50)})
pieces = PandasAdapter().split(frame, ["k"], 4)
back = pd.concat([PandasAdapter().unpack([p], frame.iloc[:0]) for p in pieces.values()])
assert sorted(back["v"]) == list(range(50)), back
print(len(names), sorted(m for m in sys.modules if m.split(".")[0] in ("dask", "distributed")))
"""


def test_engine_modules_import_and_split_without_dask_or_distributed() -> None:
    proc = subprocess.run([sys.executable, "-c", _CHECK], check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    count, loaded = proc.stdout.split(maxsplit=1)
    assert int(count) >= 20  # every engine module, not an empty walk
    assert loaded.strip() == "[]"
