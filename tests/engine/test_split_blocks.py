"""split_table gathers large tables block by block: pieces must equal the plain gather."""

from __future__ import annotations

import numpy as np
import pandas as pd

from mpshuffle.table import PandasAdapter
from mpshuffle.table._ipc import GATHER_BLOCK_ROWS, read_ipc


def test_blocked_split_equals_row_selection() -> None:
    n = 2 * GATHER_BLOCK_ROWS + 123  # three blocks, the last one short
    rng = np.random.default_rng(7)
    frame = pd.DataFrame(
        {
            "key": rng.integers(0, 1000, n),
            "x": rng.random(n),
            "s": pd.array([f"v{i}" if i % 7 else None for i in range(n)], dtype="str"),
        }
    )
    adapter = PandasAdapter()
    ids = adapter.partition_ids(frame, ["key"], 13)
    pieces = adapter.split(frame, ["key"], 13)
    assert sorted(pieces) == sorted(set(ids.tolist()))
    for pid, piece in pieces.items():
        table = read_ipc(piece.data)
        assert table.num_rows == piece.nrows == int((ids == pid).sum())
        # One contiguous batch per piece, not one per block.
        assert all(col.num_chunks == 1 for col in table.columns)
        expected = frame[ids == pid].reset_index(drop=True)
        pd.testing.assert_frame_equal(table.to_pandas(), expected)
    out = adapter.unpack([pieces[p] for p in sorted(pieces)], frame.iloc[:0])
    assert len(out) == n
    assert sorted(out["s"].dropna()) == sorted(frame["s"].dropna())
