"""The demo's check of a shuffle's output: rows, a checksum of every row, and each key in one partition."""

from __future__ import annotations

import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest

from mpshuffle.demo import job


def _lineitem_like(n: int = 3000) -> pd.DataFrame:
    rng = np.random.default_rng(5)
    return pd.DataFrame({"l_orderkey": rng.integers(0, 400, n), "l_quantity": rng.random(n)})


def test_a_correct_shuffle_verifies(capsys: pytest.CaptureFixture[str]) -> None:
    inp = dd.from_pandas(_lineitem_like(), npartitions=6)
    out = inp.shuffle("l_orderkey", npartitions=4, shuffle_method="tasks")
    assert job._verify(inp, out) is True
    line = capsys.readouterr().out
    assert "rows 3,000/3,000, checksum equal" in line and "keys in one partition: yes" in line


def test_a_lost_row_a_changed_value_and_a_split_key_each_fail(capsys: pytest.CaptureFixture[str]) -> None:
    pdf = _lineitem_like()
    inp = dd.from_pandas(pdf, npartitions=6)
    out = inp.shuffle("l_orderkey", npartitions=4, shuffle_method="tasks")
    lost = out.map_partitions(lambda p: p.iloc[1:])
    assert job._verify(inp, lost) is False
    assert "rows 2,996/3,000" in capsys.readouterr().out
    changed = out.map_partitions(lambda p: p.assign(l_quantity=p["l_quantity"] + 1.0))
    assert job._verify(inp, changed) is False
    assert "checksum DIFFERENT" in capsys.readouterr().out
    # The input itself, not shuffled: the same rows, but keys spread over partitions.
    assert job._verify(inp, inp) is False
    line = capsys.readouterr().out
    assert "checksum equal" in line and "keys in one partition: NO" in line
