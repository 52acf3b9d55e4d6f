"""The device table's code path on NumPy arrays: runs without a GPU (CI).

The same functions run on CuPy arrays in tests/gpu/test_gpu.py; here they check
that the device hash equals the host hash and that split/unpack keep rows.
"""

from __future__ import annotations

import sys

import numpy as np
import pandas as pd
import pytest

from mpshuffle.table.device import DeviceAdapter, DeviceTable, partition_order, unpack_piece
from mpshuffle.table.hashing import partition_ids


def _frame(n: int = 1000) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    df = pd.DataFrame(
        {
            "a": rng.integers(-50, 50, n).astype(np.int32),
            "b": rng.normal(size=n),
            "c": rng.integers(0, 5, n).astype(np.uint16),
            "d": rng.random(n) > 0.5,
            "e": rng.normal(size=n).astype(np.float32),
        }
    )
    df.loc[3, "b"] = np.nan
    df.loc[4, "b"] = -0.0
    return df


@pytest.mark.parametrize("on", [["a"], ["b"], ["c"], ["d"], ["e"], ["a", "b"], ["c", "d", "e"]])
def test_device_hash_equals_host_hash(on: list[str]) -> None:
    df = _frame()
    t = DeviceTable.from_pandas(df, device=False)
    got = DeviceAdapter().partition_ids(t, on, 7)
    np.testing.assert_array_equal(got, partition_ids(df[on], 7))


def test_split_unpack_keep_rows_and_order() -> None:
    df = _frame()
    t = DeviceTable.from_pandas(df, device=False)
    adapter = DeviceAdapter()
    pieces = adapter.split(t, ["a", "b"], 7)
    ids = partition_ids(df[["a", "b"]], 7)
    assert sorted(pieces) == sorted(set(ids.tolist()))
    for pid, piece in pieces.items():
        pd.testing.assert_frame_equal(
            unpack_piece(piece).to_pandas(), df[ids == pid].reset_index(drop=True)
        )
    whole = adapter.unpack([pieces[p] for p in sorted(pieces)], t.empty_like())
    assert whole.nrows == len(df) and whole.dtypes == t.dtypes


def test_partition_order_is_rank_major_and_stable() -> None:
    ids = np.array([3, 0, 1, 2, 3, 1, 0, 2], dtype=np.int64)
    order, counts = partition_order(ids, 4, nranks=2)
    # rank 0 owns 0, 2; rank 1 owns 1, 3
    assert ids[order].tolist() == [0, 0, 2, 2, 1, 1, 3, 3]
    assert order.tolist() == [1, 6, 3, 7, 2, 5, 0, 4]
    assert counts.tolist() == [2, 2, 2, 2]


def test_import_does_not_load_cupy() -> None:
    if "cupy" in sys.modules:
        pytest.skip("cupy already imported in this process")
    import mpshuffle.comm.nccl
    import mpshuffle.shuffler.device
    import mpshuffle.table.cudf  # noqa: F401

    assert "cupy" not in sys.modules


def test_device_table_rejects_bad_columns() -> None:
    with pytest.raises(ValueError, match="has 3 rows"):
        DeviceTable({"a": np.zeros(2), "b": np.zeros(3)})
    with pytest.raises(TypeError, match="dtype <U1|dtype object"):
        DeviceTable({"a": np.array(["x"], dtype=object)})
    with pytest.raises(TypeError, match="names must be str"):
        DeviceTable({1: np.zeros(2)})


def test_pack_sorted_rank_major_with_empty_partitions() -> None:
    from mpshuffle.table.device import pack_sorted, rank_major_pids

    df = _frame(100)  # 40 partitions for 100 rows: many are empty
    t = DeviceTable.from_pandas(df, device=False)
    ids = partition_ids(df[["a"]], 40)
    order, counts = partition_order(ids, 40, nranks=3)
    pieces = pack_sorted(t, order, counts, rank_major_pids(40, 3))
    assert sorted(pieces) == sorted(set(ids.tolist()))
    for pid, piece in pieces.items():
        got = unpack_piece(piece).to_pandas()
        pd.testing.assert_frame_equal(got, df[ids == pid].reset_index(drop=True))  # values, dtypes, order
    # One buffer; pieces laid out rank-major (rank 0's partitions first), each 64-byte aligned.
    base = next(iter(pieces.values())).data.base
    starts = {pid: p.data.__array_interface__["data"][0] - base.__array_interface__["data"][0]
              for pid, p in pieces.items()}
    assert all(p.data.base is base for p in pieces.values())
    assert all(s % 64 == 0 for s in starts.values())
    laid_out = sorted(starts, key=starts.__getitem__)
    assert laid_out == [p for p in rank_major_pids(40, 3) if p in pieces]


@pytest.mark.parametrize("adapter", ["pandas", "arrow", "device"])
@pytest.mark.parametrize(
    ("ids", "match"),
    [
        (np.array([0, 1, 5]), r"in \[0, 5\), got values from 0 to 5"),
        (np.array([0, -1, 2]), r"got values from -1 to 2"),
        (np.array([0, 1]), r"shape \(3,\), got \(2,\)"),
        (np.array([0.0, 1.0, 2.0]), "must be integers"),
    ],
)
def test_split_refuses_ids_outside_their_range(adapter: str, ids: np.ndarray, match: str) -> None:
    """Caller-given ids are checked: a row must not land in no partition, or another."""
    import pandas as pd
    import pyarrow as pa

    from mpshuffle.table.arrow import ArrowAdapter
    from mpshuffle.table.pandas import PandasAdapter

    df = pd.DataFrame({"k": [1, 2, 3], "v": [1.0, 2.0, 3.0]})
    frame, ad = {
        "pandas": (df, PandasAdapter()),
        "arrow": (pa.Table.from_pandas(df, preserve_index=False), ArrowAdapter()),
        "device": (DeviceTable.from_pandas(df, device=False), DeviceAdapter()),
    }[adapter]
    with pytest.raises(ValueError, match=match):
        ad.split(frame, ["k"], 5, ids=ids)


def test_unpack_takes_a_host_runs_memoryview_piece() -> None:
    # NumPy device tables take the host run, whose pieces reach extract as memoryviews.
    from mpshuffle.table import PackedData

    t = DeviceTable({"k": np.arange(10, dtype=np.int64), "x": np.linspace(0, 1, 10)})
    for pid, piece in DeviceAdapter().split(t, ["k"], 3).items():
        got = unpack_piece(PackedData(piece.metadata, memoryview(piece.data), piece.nrows))
        want = unpack_piece(piece)
        assert got.dtypes == want.dtypes, pid
        for name in want.columns:
            np.testing.assert_array_equal(got.columns[name], want.columns[name])
