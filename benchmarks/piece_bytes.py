"""Bytes per piece at each stage of one insert: packed data, chunk header, postbox entry.

Not a test. One input partition of ``--rows`` rows (``benchmarks/inputs.py``'s
``int64`` key and ``float64`` value, its ``RangeIndex`` travelling as the
config line's shuffle keeps it) is split into ``--partitions`` output
partitions for rank 0 of ``--ranks`` (``PandasAdapter.split_for``, as an
insert does); then, per destination, its chunk's frames are built
(``_chunk_frames``, as the shuffler sends them), received into a
``Postbox`` and filed (its first pop). Reported: the frame's data bytes
(its columns and index, 8 bytes a value), the packed bytes (every piece's
data, the metadata once), the chunk headers' bytes and the postbox's
per-piece arrays, each per piece, and the packed bytes of a whole
``n -> n`` shuffle extrapolated (``--inputs`` such partitions).
Works on the code before and after the piece-layout change (run with
``PYTHONPATH`` at either ``src``), so the two can be compared::

    python benchmarks/piece_bytes.py --rows 500 --partitions 2000 --inputs 2000
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from typing import Any

import mpshuffle
from mpshuffle.memory import BufferResource, Postbox
from mpshuffle.memory.packed import PackedPieces
from mpshuffle.shuffler.host import _batches, _chunk_frames, _received_chunk
from mpshuffle.table import PandasAdapter

try:
    import inputs
except ImportError:
    from benchmarks import inputs


def measure(rows: int, partitions: int, ranks: int, inputs_n: int) -> dict[str, Any]:
    frame = inputs.make_partition(0, rows)
    data_bytes = 8 * rows * (frame.shape[1] + 1)  # columns and the index, 8 bytes a value
    pieces = PandasAdapter(index=True).split_for(frame, ["key"], partitions, rank=0, nranks=ranks)
    assert isinstance(pieces, PackedPieces)
    table = pieces.table
    npieces = len(table)
    packed = int(table.size.sum()) + sum(len(m) for m in table.metas)
    header = meta = 0
    with tempfile.TemporaryDirectory() as tmp:
        box = Postbox(BufferResource({}, spill_dir=tmp), "bytes")
        for dest, ix in _batches(table, ranks, 2**40):
            frames, _ = _chunk_frames(0, "a", 0, table, ix)
            header += len(frames[0])
            meta += sum(len(f) for f in frames[1 : 1 + len(table.metas)])
            box.add_chunk(_received_chunk(dest, [memoryview(bytes(f)) for f in frames]))
        box.pop(int(table.pids[0]))  # files every chunk
        segments = {id(s): s for entries in box._where.values() for s, _ in entries}
        entry = sum(getattr(s, k).nbytes for s in segments.values() for k in s.__slots__)
        entry += sum(ix.nbytes for entries in box._where.values() for _, ix in entries)
        filed = sum(len(ix) for entries in box._where.values() for _, ix in entries)
        box.clear()
    return {
        "rows": rows, "partitions": partitions, "ranks": ranks, "pieces": npieces,
        "rows_per_piece": rows / npieces, "data_bytes": data_bytes, "packed_bytes": packed,
        "piece_data_bytes": int(table.size.sum()),
        "packed_over_data": packed / data_bytes, "packed_bytes_per_piece": packed / npieces,
        "metadata_bytes": sum(len(m) for m in table.metas),
        "chunk_header_bytes_per_piece": header / npieces,
        "postbox_bytes_per_filed_piece": entry / max(filed, 1),
        "shuffle_packed_mb": packed * inputs_n / 1e6,
        "shuffle_piece_data_mb": int(table.size.sum()) * inputs_n / 1e6, "shuffle_data_mb": data_bytes * inputs_n / 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[500, 2000])
    parser.add_argument("--partitions", type=int, default=2000)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--inputs", type=int, default=2000)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = {"mpshuffle": mpshuffle.__file__, "python": sys.version.split()[0],
              "runs": [measure(r, args.partitions, args.ranks, args.inputs) for r in args.rows]}
    for r in result["runs"]:
        print(json.dumps(r))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
