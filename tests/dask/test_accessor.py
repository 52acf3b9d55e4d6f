"""The df.mpshuffle accessor, registered through Dask's public accessor API on import mpshuffle."""

from __future__ import annotations

import subprocess
import sys

import dask.dataframe as dd
import numpy as np
import pandas as pd
from distributed import Client

import mpshuffle  # noqa: F401  (registers the accessor)
from mpshuffle.dask.accessor import MPShuffleAccessor, register_accessor
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


def _run(code: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60
    ).stdout.strip()


def test_registered_whichever_is_imported_first_and_import_stays_light() -> None:
    after = _run(
        "import sys, mpshuffle; light = 'dask.dataframe' not in sys.modules; "
        "import dask.dataframe as dd, pandas as pd; "
        "df = dd.from_pandas(pd.DataFrame({'a': [1]}), npartitions=1); "
        "print(light, type(df.mpshuffle).__name__)"
    )
    assert after == "True MPShuffleAccessor"
    before = _run(
        "import dask.dataframe as dd, pandas as pd, mpshuffle; "
        "df = dd.from_pandas(pd.DataFrame({'a': [1]}), npartitions=1); "
        "print(type(df.mpshuffle).__name__)"
    )
    assert before == "MPShuffleAccessor"
