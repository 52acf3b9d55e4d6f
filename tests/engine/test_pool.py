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


def _thread_minor_faults() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
def test_fresh_pool_blocks_are_faulted_in_at_once() -> None:
    from mpshuffle.memory import _pages

    nbytes = 8 * MiB
    # Without the advice a fresh block's first write faults once per 4 KiB
    # page (or per huge page, where the kernel gives them).
    plain = np.empty(nbytes, np.uint8)
    before = _thread_minor_faults()
    plain[:] = 1
    plain_faults = _thread_minor_faults() - before
    block = np.empty(nbytes, np.uint8)
    populated = _pages.populate_write(block)
    if not _pages._populate_write_works:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    assert populated
    before = _thread_minor_faults()
    block[:] = 2
    faults = _thread_minor_faults() - before
    assert faults <= 2 and faults < max(plain_faults, 3)  # only the partial pages at the ends
    assert int(block.sum()) == 2 * nbytes and int(plain.sum()) == nbytes
    # Pool blocks come out that way too.
    pool = HostPool(64 * MiB)
    buf = pool.allocate(3 * MiB)
    before = _thread_minor_faults()
    np.frombuffer(buf, np.uint8)[:] = 3
    assert _thread_minor_faults() - before <= 2
    assert len(buf) == 3 * MiB and int(np.frombuffer(buf, np.uint8).sum()) == 9 * MiB


def test_populate_write_declines_small_blocks_and_keeps_contents() -> None:
    from mpshuffle.memory._pages import POPULATE_MIN_BYTES, populate_write

    small = np.full(POPULATE_MIN_BYTES - 1, 5, np.uint8)
    assert populate_write(small) is False
    block = np.full(4 * POPULATE_MIN_BYTES, 9, np.uint8)
    populate_write(block)  # touched already: the advice must not change a byte
    assert (block == 9).all()


@pytest.mark.parametrize("adapter", [PandasAdapter(), ArrowAdapter()], ids=["pandas", "arrow"])
def test_an_inserts_per_row_arrays_come_from_the_pool_and_are_reused(adapter: object) -> None:
    from mpshuffle.table._columns import SCRATCH_POOL_MIN, scratch_empty

    rng = np.random.default_rng(3)
    nrows = 200_000  # partition ids (1 byte a row) and ranks (4) above SCRATCH_POOL_MIN
    assert nrows >= SCRATCH_POOL_MIN
    frame = pd.DataFrame({"key": rng.integers(0, 10**9, nrows), "v": rng.random(nrows)})
    if isinstance(adapter, ArrowAdapter):
        import pyarrow as pa

        frame = pa.Table.from_pandas(frame, preserve_index=False)
    pool = HostPool(256 * MiB, per_class=64)
    plain = adapter.split(frame, ["key"], 8)  # type: ignore[attr-defined]
    pooled = adapter.split_for(frame, ["key"], 8, rank=0, nranks=2, pool=pool)  # type: ignore[attr-defined]
    piece_bytes = sum(v.data.size for v in pooled.values())
    # The pieces' blocks and the per-row arrays (ids and ranks) all came from the pool.
    assert pool.fresh_bytes >= piece_bytes + 5 * nrows
    meta = frame.iloc[:0] if isinstance(frame, pd.DataFrame) else frame.schema
    assert sorted(plain) == sorted(pooled)
    for pid in plain:
        assert adapter.unpack([plain[pid]], meta).equals(adapter.unpack([pooled[pid]], meta))  # type: ignore[attr-defined]
    del pooled
    gc.collect()
    fresh = pool.fresh_bytes
    again = adapter.split_for(frame, ["key"], 8, rank=0, nranks=2, pool=pool)  # type: ignore[attr-defined]
    assert pool.fresh_bytes == fresh  # the second insert took no fresh memory at all
    assert sorted(again) == sorted(plain)
    # Without a pool, or below the threshold, NumPy's own arrays.
    assert scratch_empty(None) is np.empty
    small = scratch_empty(pool)(10, np.uint32)
    assert small.dtype == np.uint32 and small.shape == (10,) and small.base is None
    big = scratch_empty(pool)(SCRATCH_POOL_MIN, np.uint32)
    assert big.dtype == np.uint32 and big.shape == (SCRATCH_POOL_MIN,) and big.flags.writeable


def _vm_flags(address: int) -> set[str]:
    """The ``VmFlags`` of this process's mapping that holds ``address`` (``/proc/self/smaps``)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("VmFlags:"):
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise advice and smaps are Linux's")
def test_huge_page_blocks_start_on_a_huge_page_and_keep_their_tail_in_small_pages() -> None:
    from mpshuffle.memory._pages import HUGE_PAGE, huge_page_empty

    nbytes = 2 * HUGE_PAGE + 12345
    block = huge_page_empty(nbytes)
    assert block.shape == (nbytes,) and block.dtype == np.uint8 and block.flags.writeable
    address = block.ctypes.data
    assert address % HUGE_PAGE == 0
    assert "hg" in _vm_flags(address) and "hg" in _vm_flags(address + 2 * HUGE_PAGE - 1)
    assert "nh" in _vm_flags(address + 2 * HUGE_PAGE)  # the tail: no huge page for 12345 bytes
    block[:] = 7
    assert int(block[-1]) == 7 and int(block.sum()) == 7 * nbytes
    small = huge_page_empty(1000)  # below two huge pages: plain aligned memory
    assert small.shape == (1000,) and small.ctypes.data % 64 == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise advice is Linux's")
def test_a_gathered_partition_lies_in_one_block_of_output_pages() -> None:
    import mmap

    import pyarrow as pa

    from mpshuffle.memory._pages import HUGE_PAGE, free_pages_reported
    from mpshuffle.table._columns import gather

    rng = np.random.default_rng(5)
    n = 400_000
    frame = pd.DataFrame({
        "key": rng.integers(0, 10**9, n),
        "x": rng.random(n),
        "s": pd.array([f"s{i % 977}" if i % 7 else None for i in range(n)], dtype="str"),
        "b": rng.random(n) > 0.5,
    })
    adapter = PandasAdapter()
    pieces = [adapter.split(frame.iloc[i::3], ["key"], 2)[0] for i in range(3)]
    table, _, _ = gather(pieces)  # type: ignore[misc]
    addresses = [b.address for col in table.columns for chunk in col.chunks for b in chunk.buffers() if b is not None]
    lo = min(addresses)
    assert lo % (mmap.PAGESIZE if free_pages_reported() else HUGE_PAGE) == 0  # output_empty's kind of page
    assert max(addresses) - lo < table.nbytes + 64 * len(addresses)  # one block, buffers end to end
    out = adapter.unpack(pieces, frame.iloc[:0])
    # The oracle reads each piece on its own (read_piece: no gather, no shared block).
    from mpshuffle.table._columns import read_piece

    expected = pa.concat_tables([read_piece(p)[0] for p in pieces]).to_pandas()
    assert len(out) == len(expected) > 0
    assert out.reset_index(drop=True).equals(expected.astype(frame.dtypes).reset_index(drop=True))
    assert out.dtypes.equals(frame.dtypes)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise advice and smaps are Linux's")
def test_small_page_blocks_are_faulted_in_at_once_and_output_picks_the_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    from mpshuffle.memory import _pages

    nbytes = 5 * 2**20 + 999
    block = _pages.small_page_empty(nbytes)
    assert block.shape == (nbytes,) and block.flags.writeable and block.ctypes.data % 4096 == 0
    assert "nh" in _vm_flags(block.ctypes.data)
    if _pages._populate_write_works:
        before = _thread_minor_faults()
        block[:] = 4
        assert _thread_minor_faults() - before <= 2  # faulted in already, but the partial last page
    assert int(block.sum()) == 4 * nbytes
    monkeypatch.setattr(_pages, "free_pages_reported", lambda: True)
    assert "nh" in _vm_flags(_pages.output_empty(nbytes).ctypes.data)
    monkeypatch.setattr(_pages, "free_pages_reported", lambda: False)
    assert _pages.output_empty(nbytes).ctypes.data % _pages.HUGE_PAGE == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise advice is Linux's")
def test_populate_write_on_a_kernel_without_the_advice_stops_trying_and_pools_still_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mpshuffle.memory import _pages

    monkeypatch.setattr(_pages, "_populate_write_works", True)
    monkeypatch.setattr(_pages, "MADV_POPULATE_WRITE", -1)  # EINVAL, as from a kernel before 5.14
    block = np.zeros(4 * MiB, np.uint8)
    assert _pages.populate_write(block) is False
    assert _pages._populate_write_works is False  # not tried again in this process
    assert _pages.small_page_empty(3 * MiB).nbytes == 3 * MiB
    pool = HostPool(64 * MiB)
    buf = pool.allocate(2 * MiB)
    np.frombuffer(buf, np.uint8)[:] = 1
    assert int(np.frombuffer(buf, np.uint8).sum()) == 2 * MiB
