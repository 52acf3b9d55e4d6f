"""Where a device insert's time goes, on one GPU, without Dask.

A :class:`~mpshuffle.shuffler.device.DeviceRun` of a 2-rank run (only inserts,
which need no peer) packs ``--inserts`` tables of an int64 key and three
float64 columns. Printed per table size:

* wall milliseconds per insert (GPU synchronized after each);
* the same split into its steps (hash to partition ids, partition order,
  pack), each synchronized;
* a cProfile of the inserts, the functions with the most own time;
* with ``--cudf``: the cudf adapter's conversions (a frame's columns as a
  device table at insert; an output frame from one consolidated piece, and
  from 64 pieces, at extract).

Every timed insert's output is checked after the timing (the packed pieces
of the run's outbox, and those of each timed ``pack`` step): rows, a checksum
of every column's bits against the table's, and every row's key hashing to
its piece's partition; a failed check stops the run.

Run: ``python benchmarks/gpu_insert_profile.py --rows 100000 10000000``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
import time
import types
from typing import Any

import numpy as np


def _table(xp: Any, rows: int, seed: int) -> Any:
    from mpshuffle.table.device import DeviceTable

    rng = xp.random.default_rng(seed)
    return DeviceTable({
        "key": rng.integers(0, 2**30, rows, dtype=np.int64),
        "a": rng.random(rows), "b": rng.random(rows), "c": rng.random(rows),
    })


def _timed(fn: Any, sync: Any, reps: int = 50) -> float:
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return 1e3 * (time.perf_counter() - t0) / reps


def _checksum(xp: Any, columns: Any) -> int:
    """Sum of the columns' values taken as ``uint64`` bits, modulo 2^64 (8-byte columns)."""
    return sum(int(c.view(xp.uint64).sum(dtype=xp.uint64)) for c in columns) % 2**64


def _check_pieces(xp: Any, pieces: dict[int, Any], table: Any, npart: int, what: str) -> None:
    """Raise unless ``pieces`` hold exactly ``table``'s rows, each in its key's partition."""
    from mpshuffle.table.device import DeviceAdapter, unpack_piece

    ad = DeviceAdapter()
    parts = {p: unpack_piece(pk) for p, pk in pieces.items()}
    rows = sum(t.nrows for t in parts.values())
    total = sum(_checksum(xp, t.columns.values()) for t in parts.values()) % 2**64
    member = all(bool((ad.partition_ids(t, ["key"], npart) == p).all()) for p, t in parts.items())
    if not (rows == table.nrows and total == _checksum(xp, table.columns.values()) and member):
        raise SystemExit(f"{what}: output check failed (rows {rows} of {table.nrows}, membership {member})")


def _check_outbox(xp: Any, run: Any, tables: list[Any], first: int, npart: int) -> int:
    """Check the outbox entries of inputs ``first ...`` (input ``first + i`` is ``tables[i % 4]``)."""
    from mpshuffle.table import PackedData

    n = 0
    for out in run._outbox:
        if out.input_index < first or out.input_index >= first + 100:
            continue
        data = out.buffer.data
        pieces = {
            pid: PackedData(out.meta, data[start + off : start + off + nbytes], rows)
            for start, _end, ps in out.ranges.values() for pid, off, nbytes, rows in ps
        }
        _check_pieces(xp, pieces, tables[(out.input_index - first) % 4], npart, f"insert {out.input_index}")
        n += 1
    return n


def _cudf_costs(xp: Any, sync: Any) -> None:
    import cudf

    from mpshuffle.table.cudf import CudfAdapter, to_device_table
    from mpshuffle.table.device import DeviceAdapter

    t = _table(xp, 1_000_000, 9)
    df = cudf.DataFrame(dict(t.columns))
    meta = df.iloc[:0]
    ad, dev = CudfAdapter(), DeviceAdapter()
    one = list(dev.split(t, ["key"], 1).values())
    many = list(dev.split(t, ["key"], 64).values())
    print("cudf ms: to_device_table", round(_timed(lambda: to_device_table(df), sync), 3),
          "| unpack 1 piece", round(_timed(lambda: ad.unpack(one, meta), sync), 3),
          "| unpack 64 pieces", round(_timed(lambda: ad.unpack(many, meta), sync), 3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, nargs="+", default=[100_000, 10_000_000])
    ap.add_argument("--inserts", type=int, default=16)
    ap.add_argument("--npartitions", type=int, default=64)
    ap.add_argument("--cudf", action="store_true")
    args = ap.parse_args()

    import cupy as xp

    from mpshuffle.memory import BufferResource
    from mpshuffle.shuffler.device import DeviceRun, DeviceState
    from mpshuffle.table.device import DeviceAdapter, pack_sorted, partition_order, rank_major_pids

    sync = xp.cuda.Device().synchronize
    comm = types.SimpleNamespace(rank=0, nranks=2, addresses=["a", "b"])
    state = DeviceState(0, 10**13, 0)
    npart = args.npartitions
    for rows in args.rows:
        tables = [_table(xp, rows, s) for s in range(4)]
        run = DeviceRun(comm, 1, resource=BufferResource(spill_dir=tempfile.mkdtemp()), state=state,
                        key="p", timeout=10)
        for i in range(2):
            run.insert(i, tables[i % 4], ["key"], npart)
        sync()
        t = []
        for i in range(args.inserts):
            t0 = time.perf_counter()
            run.insert(100 + i, tables[i % 4], ["key"], npart)
            sync()
            t.append(time.perf_counter() - t0)
        checked = _check_outbox(xp, run, tables, 100, npart)
        assert checked == args.inserts, (checked, args.inserts)
        print(f"rows {rows}: insert ms min {1e3 * min(t):.2f} median {1e3 * float(np.median(t)):.2f} "
              f"({checked} outputs checked)")
        ad = DeviceAdapter()
        steps: dict[str, list[float]] = {"ids": [], "order": [], "pack": []}
        for i in range(args.inserts):
            tb = tables[i % 4]
            t0 = time.perf_counter()
            ids = ad.partition_ids(tb, ["key"], npart)
            sync()
            t1 = time.perf_counter()
            order, counts = partition_order(ids, npart, 2)
            sync()
            t2 = time.perf_counter()
            pieces = pack_sorted(tb, order, counts, rank_major_pids(npart, 2))
            sync()
            t3 = time.perf_counter()
            _check_pieces(xp, pieces, tb, npart, f"pack step {i}")
            del pieces
            steps["ids"].append(t1 - t0)
            steps["order"].append(t2 - t1)
            steps["pack"].append(t3 - t2)
        print("  steps ms (median):", {k: round(1e3 * float(np.median(v)), 3) for k, v in steps.items()})
        prof = cProfile.Profile()
        prof.enable()
        for i in range(args.inserts):
            run.insert(200 + i, tables[i % 4], ["key"], npart)
        sync()
        prof.disable()
        assert _check_outbox(xp, run, tables, 200, npart) == args.inserts
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(22)
        print("\n".join(s.getvalue().splitlines()[:40]))
        run.close()
        del tables
        xp.get_default_memory_pool().free_all_blocks()
    if args.cudf:
        _cudf_costs(xp, sync)
    # Calibration: the cost of small CuPy operations on this machine.
    small = np.arange(64, dtype=np.int64)
    d = xp.asarray(small)
    for name, fn in [("asarray(64)", lambda: xp.asarray(small)), ("get(64)", lambda: d.get()),
                     ("empty(1MB)", lambda: xp.empty(1 << 20, dtype=np.uint8)), ("d+1", lambda: d + 1)]:
        fn()
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        sync()
        print(f"  {name}: {1e6 * (time.perf_counter() - t0) / 200:.1f} us")


if __name__ == "__main__":
    main()
