"""HostPool: reuse, lifetimes through slices and views, bounds, accounting; pack's groups."""

from __future__ import annotations

import gc
import itertools
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from mpshuffle.memory import BufferResource, MemoryType
from mpshuffle.memory.pool import HostPool, size_class
from mpshuffle.table import ArrowAdapter, PandasAdapter

MiB = 2**20


def test_size_classes_waste_at_most_an_eighth() -> None:
    for n in (1, 64 * 1024, 100_000, 3 * MiB + 7, 17_300_000, 2**31 + 5):
        c = size_class(n)
        assert c >= n and (c - n) <= max(c // 8, 64 * 1024)


def test_freed_block_is_reused_and_views_keep_it() -> None:
    pool = HostPool(64 * MiB)
    buf = pool.allocate(3 * MiB)
    array = np.frombuffer(buf, np.uint8)
    array[:] = 7  # writable through numpy
    piece = buf.slice(100, 50)
    del buf, array
    gc.collect()
    assert pool.idle_bytes == 0  # the slice still holds the block
    view = memoryview(piece)
    del piece
    assert pool.idle_bytes == 0
    del view
    assert pool.idle_bytes == size_class(3 * MiB)
    again = pool.allocate(3 * MiB - 10)
    assert pool.stats()["reused_bytes"] == 3 * MiB - 10 and pool.idle_bytes == 0
    assert np.frombuffer(again, np.uint8)[0] == 7  # the same memory, not fresh


def test_limit_retain_and_close_bound_what_is_kept() -> None:
    pool = HostPool(5 * MiB)
    bufs = [pool.allocate(2 * MiB) for _ in range(3)]
    del bufs
    assert pool.idle_bytes == 2 * size_class(2 * MiB)  # the third did not fit under 5 MiB
    pool.retain = False
    b = pool.allocate(2 * MiB)
    del b
    assert pool.idle_bytes == size_class(2 * MiB)  # freed while not retaining: dropped
    assert pool.trim() == size_class(2 * MiB) and pool.idle_bytes == 0
    few = HostPool(64 * MiB, per_class=2)
    bufs = [few.allocate(MiB) for _ in range(5)]
    del bufs
    assert few.idle_bytes == 2 * size_class(MiB)  # freed in bulk: only per_class kept
    pool.retain = True
    pool.close()
    b = pool.allocate(MiB)
    del b
    assert pool.idle_bytes == 0


def test_idle_bytes_count_against_the_host_budget() -> None:
    resource = BufferResource({MemoryType.HOST: 10 * MiB})
    pool = HostPool(8 * MiB, resource)
    b = pool.allocate(4 * MiB)
    del b
    assert resource.used(MemoryType.HOST) == pool.idle_bytes == size_class(4 * MiB)
    pool.allocate(4 * MiB)  # taken again (and dropped at once: nothing holds it)
    assert resource.used(MemoryType.HOST) == pool.idle_bytes
    # Over budget: a freed block is given back instead of kept.
    held = resource.reserve(MemoryType.HOST, 9 * MiB)
    pool.trim()
    b = pool.allocate(4 * MiB)
    del b
    assert pool.idle_bytes == 0 and resource.used(MemoryType.HOST) == 9 * MiB
    held.release()
    assert resource.used(MemoryType.HOST) == 0


def _frame(n: int = 20_000) -> pd.DataFrame:
    rng = np.random.default_rng(3)
    return pd.DataFrame(
        {
            "key": rng.integers(0, 500, n),
            "x": rng.random(n),
            "s": pd.array([f"v{i}" if i % 5 else None for i in range(n)], dtype="str"),
        }
    )


@pytest.mark.parametrize("adapter", [PandasAdapter(), ArrowAdapter()], ids=["pandas", "pyarrow"])
def test_split_for_keeps_pieces_apart_and_equal_to_split(adapter: object, monkeypatch: pytest.MonkeyPatch) -> None:
    from mpshuffle.table import _columns

    # Every kept piece in a group of its own (small groups of neighbours share a block otherwise).
    monkeypatch.setattr(_columns, "KEPT_GROUP_BYTES", 1)
    frame = _frame()
    if isinstance(adapter, ArrowAdapter):
        import pyarrow as pa

        frame = pa.Table.from_pandas(frame, preserve_index=False)
    pool = HostPool(256 * MiB)
    plain = adapter.split(frame, ["key"], 12)  # type: ignore[attr-defined]
    pooled = adapter.split_for(frame, ["key"], 12, rank=1, nranks=3, pool=pool)  # type: ignore[attr-defined]
    assert sorted(plain) == sorted(pooled)
    meta = frame.iloc[:0] if isinstance(frame, pd.DataFrame) else frame.schema
    for pid in plain:
        a = adapter.unpack([plain[pid]], meta)  # type: ignore[attr-defined]
        b = adapter.unpack([pooled[pid]], meta)  # type: ignore[attr-defined]
        assert a.equals(b)
    kept = {p: v for p, v in pooled.items() if p % 3 == 1}
    sent = {p: v for p, v in pooled.items() if p % 3 != 1}
    # The sent pieces share one block per destination, each destination's
    # pieces one contiguous range; every kept piece has one of its own.
    assert len({v.data.parent.address for v in sent.values()}) == 2
    for dest in (0, 2):
        ranges = sorted((v.data.address, v.data.size) for p, v in sent.items() if p % 3 == dest)
        assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(ranges))
    assert len({v.data.parent.address for v in kept.values()}) == len(kept)
    del pooled, plain, sent, a, b  # b may be a zero-copy view of a sent piece
    gc.collect()
    idle = pool.idle_bytes
    assert idle > 0  # the sent pieces' block is back while the kept ones live
    first = min(kept)
    kept.pop(first)  # extracted: its memory goes at once, not with the last one
    gc.collect()
    assert pool.idle_bytes > idle
    assert all(v.nrows for v in kept.values())


@pytest.mark.parametrize("chosen", [None, "jemalloc"])
def test_worker_processes_get_the_system_allocator_unless_the_user_chose(chosen: str | None) -> None:
    # In a fresh interpreter: the switch is process-wide.
    env = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    if chosen:
        env["ARROW_DEFAULT_MEMORY_POOL"] = chosen
    code = (
        "import pyarrow as pa; from mpshuffle.memory.allocator import use_system_allocator;"
        "before = pa.default_memory_pool().backend_name; after = use_system_allocator();"
        "print(before, after, pa.default_memory_pool().backend_name)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    if chosen:
        assert out == [chosen, chosen, chosen]
    else:
        assert out[1:] == ["system", "system"]


@pytest.mark.parametrize(("npartitions", "rank", "nranks"), [(60, 0, 2), (7, 2, 3), (1000, 1, 2), (5, 0, 1)])
@pytest.mark.parametrize("piece_bytes", [0, 100, 2**18, 2**21])
def test_owner_groups_share_blocks_by_bytes_and_destination(
    npartitions: int, rank: int, nranks: int, piece_bytes: int
) -> None:
    from mpshuffle.table._columns import KEPT_GROUP_BYTES, KEPT_GROUPS, owner_groups

    sizes = np.full(npartitions, piece_bytes, np.int64)
    groups = owner_groups(sizes, rank, nranks)
    dest = np.arange(npartitions) % nranks
    kept = dest == rank
    # One group per other destination, apart from the kept groups.
    for d in set(range(nranks)) - {rank}:
        assert len(set(groups[dest == d].tolist())) <= 1
    assert len(set(groups[~kept].tolist())) == len(set(dest[~kept].tolist()))
    assert not set(groups[~kept].tolist()) & set(groups[kept].tolist())
    kept_groups = groups[kept]
    n = len(set(kept_groups.tolist()))
    m = int(kept.sum())
    target = max(KEPT_GROUP_BYTES, -(-m * piece_bytes // KEPT_GROUPS))
    assert n <= KEPT_GROUPS
    # A kept piece starts a group when the bytes before it cross a multiple of the target.
    assert n == len({k * piece_bytes // target for k in range(m)})
    assert np.all(np.diff(kept_groups) >= 0)  # neighbours share
