"""The df.mpshuffle accessor, registered through Dask's public accessor API when mpshuffle.dask is imported."""

from __future__ import annotations

import subprocess
import sys

import dask.dataframe as dd
import numpy as np
import pandas as pd
from distributed import Client

from mpshuffle.dask.accessor import ACCESSOR_NAME, MPShuffleAccessor, register_accessor
from mpshuffle.table import partition_ids


def _frames() -> tuple[dd.DataFrame, dd.DataFrame]:
    left = pd.DataFrame({"k": np.arange(200) % 17, "v": np.arange(200)})
    right = pd.DataFrame({"k": np.arange(30) % 20, "w": np.arange(30) * 2.0})
    return dd.from_pandas(left, npartitions=3), dd.from_pandas(right, npartitions=2)


def test_accessor_methods(client: Client) -> None:
    left, right = _frames()
    lp, rp = left.compute(), right.compute()
    assert isinstance(left.mpshuffle, MPShuffleAccessor)

    parts = client.compute(left.mpshuffle.shuffle("k", npartitions=4).to_delayed(), sync=True)
    for j, p in enumerate(parts):
        assert set(partition_ids(p[["k"]], 4)) <= {j}
    assert sorted(pd.concat(parts)["v"]) == list(range(200))

    joined = left.mpshuffle.merge(right, how="left", on="k").compute()
    exp = lp.merge(rp, how="left", on="k")
    key = ["k", "v", "w"]
    pd.testing.assert_frame_equal(
        joined.sort_values(key, na_position="last").reset_index(drop=True),
        exp.sort_values(key, na_position="last").reset_index(drop=True),
    )

    s = left.mpshuffle.sort_values("v", ascending=False).compute()
    pd.testing.assert_frame_equal(s, lp.sort_values("v", ascending=False))

    indexed = left.mpshuffle.set_index("v")
    assert indexed.known_divisions and indexed.divisions[0] == 0 and indexed.divisions[-1] == 199
    pd.testing.assert_frame_equal(indexed.compute(), lp.set_index("v").sort_index())


def test_registration_is_idempotent_and_on_dask_dataframe_class() -> None:
    register_accessor()
    register_accessor()
    assert dd.DataFrame.mpshuffle is MPShuffleAccessor  # class access gives the accessor type
    assert ACCESSOR_NAME == "mpshuffle"


def _run(code: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60
    ).stdout.strip()


def test_import_mpshuffle_alone_registers_nothing_and_imports_no_dask() -> None:
    out = _run(
        "import sys, mpshuffle\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('dask', 'distributed')))\n"
        "print([type(f).__module__ for f in sys.meta_path if 'mpshuffle' in type(f).__module__])\n"
        "import dask.dataframe as dd\n"
        "print(hasattr(dd.DataFrame, 'mpshuffle'))\n"
    )
    assert out.splitlines() == ["[]", "[]", "False"]


def test_import_of_mpshuffle_dask_registers_it_also_for_frames_made_before() -> None:
    out = _run(
        "import dask.dataframe as dd, pandas as pd\n"
        "df = dd.from_pandas(pd.DataFrame({'a': [1]}), npartitions=1)\n"
        "print(hasattr(df, 'mpshuffle'))\n"
        "import mpshuffle.dask.join\n"  # any module of the package will do
        "print(type(df.mpshuffle).__name__, df.mpshuffle.shuffle('a').npartitions)\n"
    )
    assert out.splitlines() == ["False", "MPShuffleAccessor 1"]


def test_another_mpshuffle_attribute_is_not_overwritten() -> None:
    code = (
        "import dask.dataframe as dd\n"
        "dd.DataFrame.mpshuffle = property(lambda self: 'theirs')\n"
        "import mpshuffle.dask\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "RuntimeError: dask.dataframe.DataFrame already has an attribute 'mpshuffle'" in proc.stderr
    assert "mpshuffle will not overwrite it" in proc.stderr
