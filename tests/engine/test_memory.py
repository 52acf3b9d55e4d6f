"""BufferResource budgets, the postbox's spilling, spill files, and send back-pressure."""

from __future__ import annotations

import errno
import mmap
import os
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from mpshuffle.comm import LocalCommunicator
from mpshuffle.comm.base import SendFuture
from mpshuffle.errors import MPShuffleError, ShuffleError, SpillError
from mpshuffle.memory import BufferResource, MemoryType, Postbox, SpillDirectory
from mpshuffle.memory import spill as spill_module
from mpshuffle.memory.packed import PackedPieces, PieceTable, distinct_metadata, packed_nbytes
from mpshuffle.memory.postbox import Chunk
from mpshuffle.memory.store import MAP_MIN_BYTES
from mpshuffle.shuffler import host
from mpshuffle.shuffler.host import Shuffler, _batches, _chunk_frames, _received_chunk
from mpshuffle.table import PackedData, partition_owner
from mpshuffle.table.hashing import partition_owners


def _piece(values: range | list[int], meta: bytes = b"m") -> PackedData:
    data = np.asarray(values, dtype=np.int64).tobytes()
    return PackedData(metadata=meta, data=data, nrows=len(values))


def test_reservations_account_use_and_peak() -> None:
    res = BufferResource({MemoryType.HOST: 100})
    a = res.reserve(MemoryType.HOST, 60)
    b = res.reserve(MemoryType.HOST, 70)  # past the budget: accounted, not refused
    assert res.used(MemoryType.HOST) == 130
    assert res.available(MemoryType.HOST) == -30
    a.release()
    a.release()  # idempotent
    assert res.used(MemoryType.HOST) == 70
    b.release()
    assert res.used(MemoryType.HOST) == 0
    assert res.peak(MemoryType.HOST) == 130
    assert res.available(MemoryType.DISK) is None
    with pytest.raises(MPShuffleError, match="negative"):
        res.reserve(MemoryType.HOST, -1)


def test_postbox_keeps_within_budget_and_spills_the_rest(tmp_path: Any) -> None:
    res = BufferResource({MemoryType.HOST: 1000}, spill_dir=str(tmp_path), owner="rank 0 (worker w)")
    box = Postbox(res, "op1-r0")
    p1 = _piece(range(50))  # 400 bytes of data
    p2 = _piece(range(50, 100))
    p3 = _piece(range(100, 200))  # 800 bytes: does not fit any more
    box.add_chunk(Chunk.of_pieces(0, "a", 0, 0, [(0, p1), (1, p2)]))
    assert box.bytes_spilled == 0
    # The two pieces share one metadata object: counted once.
    assert res.used(MemoryType.HOST) == 801 == box.nbytes
    box.add_chunk(Chunk.of_pieces(1, "a", 0, 2, [(0, p3), (1, p1)]))
    assert box.bytes_spilled == 800 + 400
    assert res.used(MemoryType.HOST) == 801
    assert res.used(MemoryType.DISK) == 1200 == box.nbytes_spilled
    spill_dir = tmp_path / "mpshuffle-op1-r0"
    assert os.listdir(spill_dir) == ["pieces.bin"]  # one file per rank, whatever the partitions

    got = box.pop(0)
    assert [np.frombuffer(p.data, np.int64).tolist() for p in got] == [list(range(50)), list(range(100, 200))]
    assert [p.nrows for p in got] == [50, 100]
    assert [p.metadata for p in got] == [b"m", b"m"]
    # Read-back buffers are 64-byte aligned, so Arrow uses them in place.
    assert np.frombuffer(got[1].data, np.uint8).ctypes.data % 64 == 0
    assert box.bytes_unspilled == 800
    # Each chunk is accounted until its last piece is popped.
    assert res.used(MemoryType.HOST) == 801
    assert res.used(MemoryType.DISK) == 1200
    got = box.pop(1)
    assert [np.frombuffer(p.data, np.int64).tolist() for p in got] == [list(range(50, 100)), list(range(50))]
    assert box.bytes_unspilled == 1200
    assert res.used(MemoryType.HOST) == 0 and res.used(MemoryType.DISK) == 0
    box.clear()
    assert not spill_dir.exists()
    assert res.used(MemoryType.HOST) == 0 and res.used(MemoryType.DISK) == 0


def test_move_to_disk_frees_the_chunks_held_in_memory_and_reads_them_back(tmp_path: Any) -> None:
    """A paused worker's run moves its in-memory chunks to disk: filed and not yet filed ones alike."""
    res = BufferResource({MemoryType.HOST: 10_000}, spill_dir=str(tmp_path))
    box = Postbox(res, "moved")
    for i in range(3):
        box.add_chunk(Chunk.of_pieces(i, "a", 0, 0, [(p, _piece([i, p] * (1 + p))) for p in range(4)]))
    assert [np.frombuffer(x.data, np.int64).tolist() for x in box.pop(0)] == [[i, 0] for i in range(3)]  # files them
    box.add_chunk(Chunk.of_pieces(3, "a", 0, 0, [(p, _piece([3, p] * (1 + p))) for p in range(4)]))  # not filed yet
    held = res.used(MemoryType.HOST)
    assert held == box.nbytes > 0 and box.bytes_spilled == 0
    moved = box.move_to_disk()
    assert moved == box.bytes_spilled == res.used(MemoryType.DISK) == box.nbytes_spilled
    assert res.used(MemoryType.HOST) == 0 == box.nbytes
    assert moved == 4 * 8 * (2 + 4 + 6 + 8)  # the 4 chunks' frames, whole (popped pieces' bytes too)
    assert box.move_to_disk() == 0  # nothing left in memory
    for p in (3, 1, 2):
        got = [np.frombuffer(x.data, np.int64).tolist() for x in box.pop(p)]
        assert got == [[i, p] * (1 + p) for i in range(4)]
    assert [np.frombuffer(x.data, np.int64).tolist() for x in box.pop(0)] == [[3, 0]]  # came after the first pop
    assert res.used(MemoryType.DISK) == 0 and box.bytes_unspilled == 4 * 8 * (4 + 6 + 8) + 16
    box.clear()
    assert os.listdir(tmp_path) == []


def test_spilled_chunks_of_many_partitions_share_one_file_read_back_by_range(tmp_path: Any) -> None:
    res = BufferResource({MemoryType.HOST: 0}, spill_dir=str(tmp_path))
    box = Postbox(res, "many")
    nparts, ninputs = 300, 4
    for i in range(ninputs):
        box.add_chunk(Chunk.of_pieces(i, "a", 0, 0, [(p, _piece([i, p] * (1 + p % 3))) for p in range(nparts)]))
    assert os.listdir(tmp_path / "mpshuffle-many") == ["pieces.bin"]
    for p in reversed(range(nparts)):
        got = box.pop(p)
        assert [np.frombuffer(x.data, np.int64).tolist() for x in got] == [[i, p] * (1 + p % 3) for i in range(ninputs)]
    assert res.used(MemoryType.DISK) == 0
    box.clear()
    assert os.listdir(tmp_path) == []


def _rss_file_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile:"))


def test_spill_directory_maps_each_range_alone_and_the_mappings_outlive_the_file(tmp_path: Any) -> None:
    d = SpillDirectory(str(tmp_path / "s"), owner="me")
    payload = [bytes([k]) * (5000 + 3 * k) for k in range(6)]  # ranges across page boundaries
    offsets = d.append(payload)
    filler = d.append([b"f" * (8 << 20)])  # 8 MiB between the ranges mapped below
    (last,) = d.append([b"z" * 4096])
    mapped = d.map_ranges([(offsets[4], 5012), (offsets[1], 5003), (filler[0], 0), (last, 4096)])
    assert mapped is not None
    (a, at_a), (b, at_b), (empty, _), (z, at_z) = mapped
    assert not a.flags.writeable and not b.flags.writeable
    assert bytes(a[at_a : at_a + 5012]) == payload[4] and bytes(b[at_b : at_b + 5003]) == payload[1]
    assert bytes(z[at_z:]) == b"z" * 4096 and len(empty) == 0
    # Each mapping covers its own pages only, never the 8 MiB between them.
    assert (a.nbytes - at_a, z.nbytes - at_z) == (5012, 4096) and max(at_a, at_z) < mmap.PAGESIZE
    assert [(a.ctypes.data + at_a) % 64, (b.ctypes.data + at_b) % 64] == [0, 0]
    d.remove()
    assert not (tmp_path / "s").exists()
    assert bytes(a[at_a : at_a + 5012]) == payload[4]  # the mapping keeps its pages


def test_mapped_ranges_are_unmapped_once_no_view_of_them_is_left(tmp_path: Any) -> None:
    d = SpillDirectory(str(tmp_path / "s"), owner="me")
    (at,) = d.append([b"x" * (16 << 20)])
    before = _rss_file_kib()
    mapped = d.map_ranges([(at, 16 << 20)])
    assert mapped is not None
    view = pa.py_buffer(mapped[0][0])
    del mapped
    assert _rss_file_kib() - before >= 15 << 10  # populated: 16 MiB of the page cache mapped
    del view
    assert _rss_file_kib() - before < 1 << 10
    d.remove()


def test_spill_directory_map_ranges_refuses_a_range_past_the_end_and_falls_back_without_mapping(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = SpillDirectory(str(tmp_path / "s"), owner="me")
    (at,) = d.append([b"abc"])
    with pytest.raises(SpillError, match="ends before byte 68"):
        d.map_ranges([(at, 68)])
    monkeypatch.setattr(spill_module, "MADV_POPULATE_READ", -1)  # EINVAL, as from a kernel before 5.14
    assert d.map_ranges([(at, 3)]) is None
    res = BufferResource({MemoryType.HOST: 0}, spill_dir=str(tmp_path))
    box = Postbox(res, "fallback")
    for i in range(2):
        box.add(0, (i, "a", 0, 0), _piece(range(i, i + 100)))
    table = box.pop(0)  # read into fresh memory instead: one buffer for both pieces
    assert [np.frombuffer(p.data, np.int64).tolist() for p in table] == [list(range(i, i + 100)) for i in range(2)]
    assert len(table.buffers) == 1 and box.bytes_unspilled == 1600
    box.clear()
    d.remove()


def test_spilled_pieces_are_popped_as_views_of_the_mapped_spill_file(tmp_path: Any) -> None:
    res = BufferResource({MemoryType.HOST: 0}, spill_dir=str(tmp_path))
    box = Postbox(res, "mapped")
    n = MAP_MIN_BYTES // 8 + 100  # int64 values: pieces past the size that is mapped
    for i in range(3):
        box.add(5, (i, "a", 0, 0), _piece(range(i, i + n)))
    table = box.pop(5)
    assert [np.frombuffer(p.data, np.int64).tolist() for p in table] == [list(range(i, i + n)) for i in range(3)]
    assert table.mapped is None  # never given to release_pages: that would punch holes in the file
    assert len(table.buffers) == 3 and all(not np.frombuffer(b, np.uint8).flags.writeable for b in table.buffers)
    assert box.bytes_unspilled == 3 * 8 * n and res.used(MemoryType.DISK) == 0
    box.clear()
    assert os.listdir(tmp_path) == []


def test_small_spilled_pieces_are_read_back_into_one_buffer(tmp_path: Any) -> None:
    res = BufferResource({MemoryType.HOST: 0}, spill_dir=str(tmp_path))
    box = Postbox(res, "small")
    for i in range(3):
        box.add(5, (i, "a", 0, 0), _piece(range(i, i + 1000)))
    box.add(5, (3, "a", 0, 0), _piece(range(MAP_MIN_BYTES // 8)))  # one large piece among them
    table = box.pop(5)
    assert [np.frombuffer(p.data, np.int64).tolist() for p in table] == [
        *(list(range(i, i + 1000)) for i in range(3)), list(range(MAP_MIN_BYTES // 8))
    ]
    assert table.mapped is None
    assert len(table.buffers) == 2  # the three small pieces share one read buffer; the large one is mapped
    assert box.bytes_unspilled == 3 * 8000 + MAP_MIN_BYTES and res.used(MemoryType.DISK) == 0
    box.clear()
    assert os.listdir(tmp_path) == []


def test_pieces_of_a_partition_come_back_in_order_across_memory_and_disk(tmp_path: Any) -> None:
    res = BufferResource({MemoryType.HOST: 500}, spill_dir=str(tmp_path))
    box = Postbox(res, "x")
    pieces = [_piece(range(i * 10, i * 10 + 10 + i)) for i in range(8)]
    for i in reversed(range(8)):
        box.add(3, (i, "a", 0, 0), pieces[i])
    assert 0 < box.bytes_spilled < sum(p.nbytes for p in pieces)
    got = box.pop(3)
    assert [bytes(memoryview(p.data)) for p in got] == [p.data for p in pieces]
    assert box.pop(3) == []
    box.clear()


def test_unbounded_postbox_never_spills(tmp_path: Any) -> None:
    res = BufferResource({}, spill_dir=str(tmp_path))
    box = Postbox(res, "u")
    box.add(0, (0, "a", 0, 0), _piece(range(10_000)))
    assert box.bytes_spilled == 0 and box.nbytes == 80_001
    box.clear()
    assert os.listdir(tmp_path) == []


def test_disk_full_while_spilling_names_directory_and_owner_and_removes_files(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    res = BufferResource({MemoryType.HOST: 10}, spill_dir=str(tmp_path), owner="rank 1 (worker tcp://h:1)")
    box = Postbox(res, "op7-r1")
    box.add(0, (0, "a", 0, 0), _piece(range(100)))  # spilled fine
    assert os.listdir(tmp_path / "mpshuffle-op7-r1") == ["pieces.bin"]

    def full(fd: int, parts: Any, at: int, want: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(spill_module, "_pwritev_all", full)
    with pytest.raises(SpillError) as info:
        box.add(1, (1, "a", 0, 0), _piece(range(100)))
    msg = str(info.value)
    assert "disk is full" in msg
    assert str(tmp_path / "mpshuffle-op7-r1") in msg
    assert "rank 1 (worker tcp://h:1)" in msg
    assert not (tmp_path / "mpshuffle-op7-r1").exists()
    assert res.used(MemoryType.DISK) == 0
    # The postbox stays failed: extract raises the same error instead of returning partial data.
    with pytest.raises(SpillError, match="disk is full"):
        box.pop(0)


def test_spill_directory_roundtrip_and_unwritable_dir(tmp_path: Any) -> None:
    d = SpillDirectory(str(tmp_path / "s"), owner="me")
    assert d.append([b"abc"]) == [0]
    assert d.append([b"defg"]) == [64]
    buf, at = d.read_ranges([(64, 4), (0, 3)])
    assert at == [0, 64] and bytes(buf[0:4]) == b"defg" and bytes(buf[64:67]) == b"abc"
    assert d.nbytes == 68 and os.listdir(tmp_path / "s") == ["pieces.bin"]
    d.remove()
    assert not (tmp_path / "s").exists() and d.nbytes == 0
    with pytest.raises(SpillError, match="already removed"):
        d.append([b"x"])
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    bad = SpillDirectory(str(blocker / "sub"), owner="me")
    with pytest.raises(SpillError, match="could not write to spill directory .*file/sub on me"):
        bad.append([b"x"])


# -- back-pressure ---------------------------------------------------------


class _LazyFuture(SendFuture):
    """A send that completes only when someone waits for it (the transport reads the caller's buffers)."""

    def __init__(self, comm: _RecordingComm, dest: int) -> None:
        super().__init__()
        self._comm, self._dest = comm, dest

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            self._comm.in_flight[self._dest] -= 1
            self.set_result(None)
        return super().result(timeout)


class _RecordingComm:
    """Stands in for a communicator of 2 ranks; records chunks in flight per destination."""

    rank = 0
    nranks = 2
    addresses = ("a", "b")

    def __init__(self) -> None:
        self.in_flight = {0: 0, 1: 0}
        self.most_in_flight = 0
        self.chunks = 0

    def send_nowait(self, dest: int, tag: Any, frames: Any) -> _LazyFuture:
        self.in_flight[dest] += 1
        self.chunks += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight[dest])
        return _LazyFuture(self, dest)


@pytest.mark.parametrize("bytes_bound", [False, True])
def test_insert_bounds_the_chunks_in_flight_per_destination(tmp_path: Any, monkeypatch: Any, bytes_bound: bool) -> None:
    """At most :data:`IN_FLIGHT_MOST` chunks per destination in flight; :data:`IN_FLIGHT` once the bytes in
    flight pass :data:`IN_FLIGHT_BYTES`."""
    monkeypatch.setattr(host, "SMALL_CHUNK_BYTES", -1)  # every chunk sent as it is made (as a large one is)
    monkeypatch.setattr(host, "MEDIUM_CHUNK_BYTES", 0)
    if bytes_bound:
        monkeypatch.setattr(host, "IN_FLIGHT_BYTES", 3 * 1601)  # two pieces in flight and the next one pass it
    comm = _RecordingComm()
    res = BufferResource({MemoryType.HOST: 10**9}, spill_dir=str(tmp_path))
    s = Shuffler(comm, 1, resource=res, timeout=5, batch_bytes=1000)  # type: ignore[arg-type]
    pieces = {pid: _piece(range(pid * 100, pid * 100 + 200)) for pid in range(40)}  # 1601 bytes each
    s.insert(0, pieces)
    assert comm.chunks == 40  # every piece passes batch_bytes on its own
    assert (host.IN_FLIGHT, host.IN_FLIGHT_MOST) == (2, 4)
    assert comm.most_in_flight == (2 if bytes_bound else 4)
    assert comm.in_flight == {0: 0, 1: 0}
    # The pieces were accounted while insert held them, and released after.
    assert res.peak(MemoryType.HOST) == packed_nbytes(pieces.values())
    assert res.used(MemoryType.HOST) == 0
    assert s.statistics["bytes_inserted"] == sum(len(p.data) for p in pieces.values())
    assert s.statistics["bytes_sent"] == sum(len(p.data) for pid, p in pieces.items() if pid % 2 == 1)
    s.close()


def test_failed_run_frees_its_spill_files(tmp_path: Any) -> None:
    comm = _RecordingComm()
    res = BufferResource({MemoryType.HOST: 1}, spill_dir=str(tmp_path), spill_prefix="mpshuffle-g")
    s = Shuffler(comm, 9, resource=res, timeout=5)  # type: ignore[arg-type]
    s.postbox.add(0, (0, "a", 0, 0), _piece(range(100)))
    assert sorted(os.listdir(tmp_path)) == ["mpshuffle-g-op9-r0", "mpshuffle-g-op9-r0.lock"]  # and its owner's lock
    s.fail(ShuffleError("peer lost"))
    assert os.listdir(tmp_path) == []
    with pytest.raises(ShuffleError, match="peer lost"):
        s.wait(1)
    s.close()


def test_chunk_of_many_pieces_in_one_frame_pops_each_partition_in_order(tmp_path: Any) -> None:
    """One frame holding the pieces of many partitions, in memory and spilled, two attempts."""
    res = BufferResource({MemoryType.HOST: 500}, spill_dir=str(tmp_path))
    box = Postbox(res, "frames")
    nparts = 7

    def chunk(input_index: int, attempt: str, src: int) -> tuple[Chunk, dict[int, list[int]]]:
        # Partition p gets p % 3 + 1 int64 values; pieces of pids in reversed order.
        pids = list(reversed(range(nparts)))
        values = {p: [input_index * 1000 + src * 100 + p * 10 + i for i in range(p % 3 + 1)] for p in pids}
        data = np.concatenate([np.array(values[p], np.int64) for p in pids])
        sizes = np.array([8 * len(values[p]) for p in pids], np.int64)
        c = Chunk(
            input_index, attempt, src, 50,
            pids=np.array(pids), nrows=sizes // 8, meta_of=np.zeros(nparts, np.int32),
            frame_of=np.zeros(nparts, np.int32), offset=np.cumsum(sizes) - sizes, size=sizes,
            metas=[b"meta"], frames=[data.tobytes()],
        )
        return c, values

    expected: dict[int, list[tuple[int, int, list[int]]]] = {p: [] for p in range(nparts)}
    for input_index in (2, 0, 1):
        for src in (1, 0):
            for attempt in ("b", "a"):
                c, values = chunk(input_index, attempt, src)
                box.add_chunk(c)
                if attempt == "a":
                    for p in range(nparts):
                        expected[p].append((input_index, src, values[p]))
    assert box.bytes_spilled > 0 and box.nbytes > 0  # some chunks in memory, some on disk
    for p in range(nparts):
        got = box.pop(p, keep=lambda order: order[1] == "a")
        want = [v for _, _, v in sorted(expected[p])]
        assert [np.frombuffer(g.data, np.int64).tolist() for g in got] == want
        assert [g.nrows for g in got] == [len(v) for v in want]
        assert all(g.metadata == b"meta" for g in got)
        assert box.pop(p) == []
    assert res.used(MemoryType.HOST) == 0 and res.used(MemoryType.DISK) == 0
    assert box.nbytes == 0 and box.nbytes_spilled == 0
    box.clear()


def test_pop_asks_keep_once_per_chunk_even_as_a_bound_method(tmp_path: Any) -> None:
    """A run passes its bound method: a new object at every access, still one question per chunk."""
    box = Postbox(BufferResource({MemoryType.HOST: 1 << 20}, spill_dir=str(tmp_path)), "keep")
    nparts, asked = 5, []

    class Run:
        def keep(self, order: tuple[Any, ...]) -> bool:
            asked.append(order)
            return order[1] == "a"

    run = Run()
    for input_index in range(4):
        for attempt in ("a", "b"):
            data = np.arange(nparts, dtype=np.int64) + 100 * input_index
            box.add_chunk(Chunk(
                input_index, attempt, 0, 0, pids=np.arange(nparts), nrows=np.ones(nparts, np.int64),
                meta_of=np.zeros(nparts, np.int32), frame_of=np.zeros(nparts, np.int32),
                offset=np.arange(nparts) * 8, size=np.full(nparts, 8), metas=[b"m"], frames=[data.tobytes()],
            ))
    for p in range(nparts - 1):
        got = box.pop(p, keep=run.keep)
        assert [int(np.frombuffer(g.data, np.int64)[0]) for g in got] == [p + 100 * i for i in range(4)]
    assert sorted(asked) == sorted((i, a, 0, 0) for i in range(4) for a in ("a", "b"))  # once each
    asked.clear()
    got = box.pop(nparts - 1, keep=lambda order: asked.append(order) or order[1] == "b")
    assert [int(np.frombuffer(g.data, np.int64)[0]) for g in got] == [nparts - 1 + 100 * i for i in range(4)]
    assert len(asked) == 8  # another function: asked again
    assert box.nbytes == 0
    box.clear()


def test_chunk_with_bad_arrays_is_refused() -> None:
    ok = {"pids": np.array([0, 1]), "nrows": np.array([1, 1]), "meta_of": np.zeros(2, np.int32),
          "frame_of": np.zeros(2, np.int32), "offset": np.array([0, 8]), "size": np.array([8, 8])}
    Chunk(0, "a", 0, 0, **ok, metas=[b"m"], frames=[bytes(16)])
    with pytest.raises(ValueError, match="differ in length"):
        Chunk(0, "a", 0, 0, **{**ok, "nrows": np.array([1])}, metas=[b"m"], frames=[bytes(16)])
    with pytest.raises(ValueError, match="outside its frame"):
        Chunk(0, "a", 0, 0, **ok, metas=[b"m"], frames=[bytes(12)])


def _table(values: dict[int, list[int]], metas: list[bytes] | None = None) -> PieceTable:
    """A PieceTable of int64 pieces lying back to back in one buffer, partition ids as given."""
    pids = list(values)
    data = np.concatenate([np.array(values[p], np.int64) for p in pids]) if pids else np.zeros(0, np.int64)
    sizes = np.array([8 * len(values[p]) for p in pids], np.int64)
    metas = metas or [b"m"]
    return PieceTable(
        pids=pids, nrows=sizes // 8, meta_of=[i % len(metas) for i in range(len(pids))], metas=metas,
        buffer_of=np.zeros(len(pids), np.int32), offset=np.cumsum(sizes) - sizes, size=sizes,
        buffers=[data.tobytes()],
    )


def test_piece_table_builds_each_piece_on_demand_and_checks_its_arrays() -> None:
    t = _table({5: [1, 2], 2: [3], 9: [4, 5, 6]}, metas=[b"a", b"b"])
    assert len(t) == 3
    assert [np.frombuffer(p.data, np.int64).tolist() for p in t] == [[1, 2], [3], [4, 5, 6]]
    assert [p.nrows for p in t] == [2, 1, 3] and [p.metadata for p in t] == [b"a", b"b", b"a"]
    assert t[-1] == t[2] and np.frombuffer(t[2].data, np.int64).tolist() == [4, 5, 6]
    assert t[1:].pids.tolist() == [2, 9] and list(t[1:]) == list(t)[1:]
    assert t == list(t) and t != list(t)[:2]
    assert (t.address - t.address[0]).tolist() == [0, 16, 24]
    assert t.nbytes == 48 + 2 and packed_nbytes(t) == 48 + 2
    assert distinct_metadata(t) == [b"a", b"b"] and distinct_metadata(list(t)) == [b"a", b"b"]
    with pytest.raises(IndexError):
        t[3]
    ok = {"pids": [0, 1], "nrows": [1, 1], "meta_of": [0, 0], "metas": [b"m"], "buffer_of": [0, 0],
          "offset": [0, 8], "size": [8, 8], "buffers": [bytes(16)]}
    PieceTable(**ok)  # type: ignore[arg-type]
    for bad, match in (({"nrows": [1]}, "differ in length"), ({"meta_of": [0, 1]}, "meta_of"),
                       ({"buffer_of": [0, 1]}, "buffer_of"), ({"offset": [0, 9]}, "outside its buffer")):
        with pytest.raises(ValueError, match=match):
            PieceTable(**{**ok, **bad})  # type: ignore[arg-type]


def test_packed_pieces_is_a_mapping_by_ascending_partition_id() -> None:
    pieces = PackedPieces(_table({1: [10], 4: [40, 41], 7: [70]}))
    assert list(pieces) == [1, 4, 7] and len(pieces) == 3
    assert np.frombuffer(pieces[4].data, np.int64).tolist() == [40, 41]
    assert 4 in pieces and 5 not in pieces and "x" not in pieces
    with pytest.raises(KeyError):
        pieces[5]
    assert {k: v.nrows for k, v in pieces.items()} == {1: 1, 4: 2, 7: 1}
    with pytest.raises(ValueError, match="ascending"):
        PackedPieces(_table({4: [1], 1: [2]}))


def test_batches_follow_the_owner_rule_and_close_at_batch_bytes() -> None:
    # 10 partitions, piece p of p + 1 int64 values, 3 ranks, chunks close at 130 bytes.
    t = _table({p: list(range(p + 1)) for p in range(10)})
    batches = _batches(t, 3, 130)
    got: dict[int, list[int]] = {}
    for dest, ix in batches:
        pids = t.pids[ix].tolist()
        assert all(partition_owner(p, 3) == dest for p in pids)
        # A chunk closes at the piece that brings it to 130 bytes: only its last piece may pass.
        sizes = t.size[ix]
        assert sizes[:-1].sum() < 130
        got.setdefault(dest, []).extend(pids)
    assert got == {0: [0, 3, 6, 9], 1: [1, 4, 7], 2: [2, 5, 8]}  # every piece once, in table order per rank
    # Closed chunks go in the order they closed (their last piece's place in the table), open ones after.
    closes = [int(ix[-1]) for _, ix in batches if t.size[ix].sum() >= 130]
    assert closes == [8, 9] and [d for d, _ in batches] == [2, 0, 1]  # rank 1's 120 bytes stay open, go last
    assert _batches(_table({}), 3, 40) == []


def test_batches_cut_each_destination_into_ranges_of_partitions(monkeypatch: pytest.MonkeyPatch) -> None:
    """An insert's pieces for one rank go in RELEASE_GROUPS chunks, each a range of neighbouring partitions."""
    monkeypatch.setattr(host, "RELEASE_MIN_BYTES", 1024)
    nparts, nranks = 4 * host.RELEASE_GROUPS * 2, 2  # 4 partitions per group per rank
    t = _table({p: [p] * 128 for p in range(nparts)})  # pieces of 1024 bytes
    batches = _batches(t, nranks, 2**30)
    for dest in range(nranks):
        ranges = [t.pids[ix].tolist() for d, ix in batches if d == dest]
        owned = list(range(dest, nparts, nranks))
        assert ranges == [owned[4 * g : 4 * g + 4] for g in range(host.RELEASE_GROUPS)]
    # batch_bytes still caps a chunk: one piece each.
    assert len(_batches(t, nranks, 1024)) == nparts
    # Fewer groups where they would be under RELEASE_MIN_BYTES: 2.5 KiB per rank, two groups of
    # 1280 bytes (a chunk closes at the piece that reaches it).
    few = _table({p: [p] * 64 for p in range(10)})  # pieces of 512 bytes
    assert [(d, few.pids[ix].tolist()) for d, ix in _batches(few, nranks, 2**30)] == [
        (0, [0, 2, 4]), (1, [1, 3, 5]), (0, [6, 8]), (1, [7, 9])]
    # Under RELEASE_MIN_BYTES per rank: one chunk per rank, whatever its number of partitions.
    small = _table({p: [p] for p in range(100)})
    assert [(d, len(ix)) for d, ix in _batches(small, nranks, 2**30)] == [(0, 50), (1, 50)]


def test_a_chunk_and_its_memory_go_once_its_partitions_are_popped(tmp_path: Any) -> None:
    """Chunks of partition ranges are freed one by one as their partitions are popped in order."""
    res = BufferResource({MemoryType.HOST: 2**30}, spill_dir=str(tmp_path))
    box = Postbox(res, "release")
    nparts, per_chunk, values = 12, 4, 2**14  # pieces of 128 KiB, chunks of 4 partitions
    base = pa.total_allocated_bytes()
    for input_index in range(2):
        for first in range(0, nparts, per_chunk):
            frame = pa.allocate_buffer(per_chunk * 8 * values)  # from Arrow's pool: its release is counted
            data = np.frombuffer(frame, np.int64).reshape(per_chunk, values)
            data[:] = np.arange(first, first + per_chunk)[:, None] + 1000 * input_index
            sizes = np.full(per_chunk, 8 * values, np.int64)
            box.add_chunk(Chunk(
                input_index, "a", 0, first, pids=np.arange(first, first + per_chunk), nrows=sizes // 8,
                meta_of=np.zeros(per_chunk, np.int32), frame_of=np.zeros(per_chunk, np.int32),
                offset=np.cumsum(sizes) - sizes, size=sizes, metas=[b"m"], frames=[frame],
            ))
            del frame, data
    chunk_bytes = per_chunk * 8 * values
    assert pa.total_allocated_bytes() - base == 6 * chunk_bytes
    assert box.nbytes == res.used(MemoryType.HOST) == 6 * (chunk_bytes + 1)
    for p in range(nparts):
        got = box.pop(p)
        assert [int(np.frombuffer(g.data, np.int64)[0]) for g in got] == [p, 1000 + p]
        del got
        left = 2 * (nparts - per_chunk * ((p + 1) // per_chunk)) // per_chunk  # chunks not fully popped
        assert box.nbytes == res.used(MemoryType.HOST) == left * (chunk_bytes + 1)
        assert pa.total_allocated_bytes() - base == left * chunk_bytes
    box.clear()


def test_extracts_in_partition_order_free_received_memory_as_they_go(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through a shuffler: each extract frees the chunks whose last partition it was, not all at the end."""
    monkeypatch.setattr(host, "RELEASE_MIN_BYTES", 1)
    comm = LocalCommunicator()
    comm.register_handler("mps", lambda src, tag, frames: s.receive(src, tag, frames))
    s = Shuffler(comm, 1, resource=BufferResource({}, spill_dir=str(tmp_path)), timeout=5)
    nparts, ninputs, values = 4 * host.RELEASE_GROUPS, 3, 1000
    for i in range(ninputs):
        s.insert(i, {p: _piece([1000 * i + p] * values) for p in range(nparts)})
    s.barrier(nparts)
    piece = 8 * values
    assert s.postbox.nbytes == ninputs * (nparts * piece + host.RELEASE_GROUPS)  # one metadata per chunk
    held = []
    for p in range(nparts):
        got = s.extract(p)
        assert [int(np.frombuffer(g.data, np.int64)[0]) for g in got] == [1000 * i + p for i in range(ninputs)]
        held.append(s.postbox.nbytes)
    # Every 4th extract frees one chunk of each input: 4 partitions' pieces and the chunk's metadata.
    group = nparts // host.RELEASE_GROUPS
    assert held == [ninputs * (host.RELEASE_GROUPS - (p + 1) // group) * (group * piece + 1) for p in range(nparts)]
    assert s.closed
    comm.close()


def test_chunk_frames_of_a_table_round_trip_through_the_postbox(tmp_path: Any) -> None:
    """A chunk of a table's pieces in two buffers and two metadata: sent, received, popped back equal."""
    values = {p: [p * 10 + i for i in range(p % 3 + 1)] for p in range(6)}
    first, second = _table({p: values[p] for p in range(3)}, [b"x"]), _table({p: values[p] for p in range(3, 6)}, [b"y"])
    t = PieceTable(
        pids=np.concatenate([first.pids, second.pids]), nrows=np.concatenate([first.nrows, second.nrows]),
        meta_of=[0, 0, 0, 1, 1, 1], metas=[b"x", b"y"], buffer_of=[0, 0, 0, 1, 1, 1],
        offset=np.concatenate([first.offset, second.offset]), size=np.concatenate([first.size, second.size]),
        buffers=[first.buffers[0], second.buffers[0]],
    )
    ix = np.array([1, 2, 3, 5])  # a gap in the second buffer: three frames
    frames, nbytes = _chunk_frames(4, "a", 100, t, ix)
    assert nbytes == int(t.size[ix].sum()) and len(frames) == 1 + 2 + 3
    box = Postbox(BufferResource({}, spill_dir=str(tmp_path)), "rt")
    box.add_chunk(_received_chunk(1, frames))
    for k in ix.tolist():
        (piece,) = box.pop(int(t.pids[k]))
        assert piece == t[k]
    box.clear()


def test_partition_owners_is_partition_owner_of_each_id() -> None:
    ids = np.arange(50).reshape(5, 10)
    assert partition_owners(ids, 7).tolist() == [[partition_owner(int(p), 7) for p in row] for row in ids.tolist()]
    with pytest.raises(ValueError, match="nranks"):
        partition_owners(ids, 0)
    with pytest.raises(ValueError, match=">= 0"):
        partition_owners(np.array([3, -1]), 2)


def test_the_postbox_files_a_piece_in_about_twenty_bytes(tmp_path: Any) -> None:
    """Pieces filed under their partitions are arrays of narrow dtypes, not 8 int64 words a piece."""
    box = Postbox(BufferResource({}, spill_dir=str(tmp_path)), "narrow")
    nparts, ninputs = 2000, 20
    for i in range(ninputs):
        data = np.arange(nparts, dtype=np.int64) + 10_000 * i
        sizes = np.full(nparts, 8, np.int64)
        box.add_chunk(Chunk(
            i, "a", 0, 0, pids=np.arange(nparts), nrows=np.ones(nparts, np.int64), meta_of=np.zeros(nparts),
            frame_of=np.zeros(nparts), offset=np.cumsum(sizes) - sizes, size=sizes, metas=[b"m"],
            frames=[data.tobytes()],
        ))
    assert [int(np.frombuffer(g.data, np.int64)[0]) for g in box.pop(0)] == [10_000 * i for i in range(ninputs)]
    segments = {id(s): s for entries in box._where.values() for s, _ in entries}
    (segment,) = segments.values()
    per_piece = sum(getattr(segment, k).itemsize for k in segment.__slots__)
    per_piece += max(ix.itemsize for entries in box._where.values() for _, ix in entries)
    assert per_piece <= 22  # was 64: seven int64 arrays and an int64 index
    box.clear()


def test_release_pages_gives_back_only_whole_pages_of_popped_pieces_in_shared_mappings(tmp_path: Any) -> None:
    """A received chunk over a shared mapping: one partition's pieces, popped and released, read as zeros
    in their whole pages; the other partition's pieces, and bytes of pages they share, are untouched."""
    import mmap

    from mpshuffle.memory.postbox import compact_pieces

    page = mmap.PAGESIZE
    sizes = [3 * page + 100, 2 * page, 5 * page + 7, page - 1]  # pieces of partitions 0, 1, 0, 1, back to back
    offsets = np.cumsum([0, *sizes[:-1]])
    total = int(sum(sizes))
    mapping = mmap.mmap(-1, total)  # shared and anonymous: shmem, as a /dev/shm message
    values = (np.arange(total) % 251 + 1).astype(np.uint8)
    mapping[:] = values.tobytes()
    frame = memoryview(mapping)[0:total]
    data = compact_pieces(np.array([0, 1, 0, 1]), np.array(sizes), np.zeros(4), np.zeros(4), offsets, np.array(sizes))
    res = BufferResource({MemoryType.HOST: 10 * total}, spill_dir=str(tmp_path))
    box = Postbox(res, "shm")
    box.add_chunk(Chunk.received(0, "a", 1, 0, pieces=data, metas=[b"m"], frames=[frame]))
    table = box.pop(0)
    assert [bytes(p.data) for p in table] == [values[o : o + n].tobytes() for o, n in zip(offsets[[0, 2]], [sizes[0], sizes[2]], strict=True)]
    released = table.release_pages()
    after = np.frombuffer(mapping, np.uint8).copy()
    freed = np.zeros(total, bool)
    for o, n in ((offsets[0], sizes[0]), (offsets[2], sizes[2])):
        lo, hi = -(-o // page) * page, (o + n) // page * page
        freed[lo:hi] = True
    assert released == int(freed.sum()) > 0
    assert (after[freed] == 0).all() and (after[~freed] == values[~freed]).all()
    assert table.release_pages() == 0  # once
    rest = box.pop(1)
    assert [bytes(p.data) for p in rest] == [values[o : o + n].tobytes() for o, n in zip(offsets[[1, 3]], [sizes[1], sizes[3]], strict=True)]
    # Pieces in private memory (a frame of bytes) have nothing to give back.
    box2 = Postbox(res, "heap")
    box2.add_chunk(Chunk.received(0, "a", 1, 0, pieces=data, metas=[b"m"], frames=[values.tobytes()]))
    heap = box2.pop(0)
    assert heap.mapped is None and heap.release_pages() == 0
    del table, rest, heap, frame


def test_popped_tables_carry_their_frames_addresses(tmp_path: Any) -> None:
    """A pop's table has each buffer's address from the postbox (many chunks, filed at two times); spilled pieces' from their buffers."""
    res = BufferResource({}, spill_dir=str(tmp_path))
    box = Postbox(res, "addr")
    nparts, values = 5, {}
    for input_index in range(40):  # past the address array's first 16 entries, filed in two batches
        pieces = []
        for p in range(nparts):
            values[(input_index, p)] = [input_index * 100 + p, -p]
            pieces.append((p, _piece(values[(input_index, p)])))
        box.add_chunk(Chunk.of_pieces(input_index, "a", 0, 0, pieces))
        if input_index == 20:
            got = box.pop(0)
            assert got.bases is not None
            assert got.bases.tolist() == [b.address for b in got.buffers]
    for p in range(1, nparts):
        got = box.pop(p)
        assert got.bases is not None and len(got.bases) == len(got.buffers) == 40
        np.testing.assert_array_equal(
            got.address, np.array([b.address for b in got.buffers], np.uint64)[got.buffer_of] + got.offset.astype(np.uint64)
        )
        assert [np.frombuffer(g.data, np.int64).tolist() for g in got] == [values[(i, p)] for i in range(40)]
    box.clear()
    # With spilled pieces the table asks its buffers.
    small = Postbox(BufferResource({MemoryType.HOST: 100}, spill_dir=str(tmp_path)), "addr-spilled")
    small.add_chunk(Chunk.of_pieces(0, "a", 0, 0, [(0, _piece(range(5)))]))
    small.add_chunk(Chunk.of_pieces(1, "a", 0, 1, [(0, _piece(range(50)))]))  # 400 bytes: to disk
    got = small.pop(0)
    assert small.bytes_spilled > 0 and got.bases is None
    assert [np.frombuffer(g.data, np.int64).tolist() for g in got] == [list(range(5)), list(range(50))]
    small.clear()


def _private_pages(npages: int) -> tuple[mmap.mmap, np.ndarray]:
    """Private anonymous memory of ``npages`` pages as a writable uint8 array (madvise(DONTNEED) zeroes it)."""
    mapping = mmap.mmap(-1, npages * mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return mapping, np.frombuffer(mapping, np.uint8)


def test_pages_shared_by_pieces_of_many_partitions_go_once_the_last_of_them_is_released(tmp_path: Any) -> None:
    """A given chunk of small pieces: partition 0 alone in its first part, partitions 1 and 2 in turn after.
    After each pop and release, a page given back had no piece left that is not popped, the pieces not popped
    are intact, and a page the frame shares with memory outside it never goes; in the end every page
    wholly inside the frame went back."""
    page = mmap.PAGESIZE
    npages = 40
    mapping, memory = _private_pages(npages)
    values = (np.arange(len(memory)) % 251 + 1).astype(np.uint8)
    memory[:] = values
    lo, hi = 100, (npages - 1) * page + 50  # the frame: its first and last pages are partly outside it
    size = 200
    offsets = np.arange(0, hi - lo - size + 1, size)
    pids = np.where(offsets < 16 * page, 0, 1 + np.arange(len(offsets)) % 2)
    res = BufferResource({}, spill_dir=str(tmp_path))
    box = Postbox(res, "edges")
    box.add_chunk(Chunk(0, "a", 0, 0, pids=pids, nrows=np.ones(len(pids), np.int64),
                        meta_of=np.zeros(len(pids), np.int64), frame_of=np.zeros(len(pids), np.int64),
                        offset=offsets, size=np.full(len(pids), size), metas=[b"m"], frames=[memory[lo:hi]],
                        given=True))
    popped = np.zeros(len(pids), bool)
    freed = np.zeros(npages, bool)
    for p in range(3):
        table = box.pop(p)
        assert [bytes(x.data) for x in table] == [values[lo + o : lo + o + size].tobytes() for o in offsets[pids == p]]
        popped |= pids == p
        released = table.release_pages()
        assert table.release_pages() == 0  # once
        zero = (memory.reshape(npages, page) == 0).all(axis=1)
        assert released == int((zero & ~freed).sum()) * page
        freed = zero
        starts, ends = lo + offsets[~popped], lo + offsets[~popped] + size
        for q in np.flatnonzero(freed).tolist():
            assert 1 <= q < npages - 1  # inside the frame
            assert not ((starts < (q + 1) * page) & (ends > q * page)).any()  # no piece left on it
        for o in offsets[~popped].tolist():
            assert (memory[lo + o : lo + o + size] == values[lo + o : lo + o + size]).all()
        if p == 0:
            assert released >= 8 * page  # partition 0's own pages went back
    assert freed[1:-1].all() and not freed[0] and not freed[-1]
    assert (memory[:page] == values[:page]).all() and (memory[-page:] == values[-page:]).all()
    del table
    box.clear()
    # A chunk not given keeps its memory whole.
    memory[:] = values
    box.add_chunk(Chunk(0, "a", 0, 0, pids=pids, nrows=np.ones(len(pids), np.int64),
                        meta_of=np.zeros(len(pids), np.int64), frame_of=np.zeros(len(pids), np.int64),
                        offset=offsets, size=np.full(len(pids), size), metas=[b"m"], frames=[memory[lo:hi]]))
    for p in range(3):
        table = box.pop(p)
        assert table.give_back is None and table.release_pages() == 0
    assert (memory == values).all()
    del table, memory
    box.clear()
    mapping.close()


def test_a_table_popped_before_a_clear_gives_nothing_back_after_it(tmp_path: Any) -> None:
    """The postbox's page counts start again at a clear: an older table's release must not touch them."""
    mapping, memory = _private_pages(4)
    memory[:] = 7
    box = Postbox(BufferResource({}, spill_dir=str(tmp_path)), "epoch")
    sizes = np.full(2, 2 * mmap.PAGESIZE)
    box.add_chunk(Chunk(0, "a", 0, 0, pids=[0, 1], nrows=[1, 1], meta_of=[0, 0], frame_of=[0, 0],
                        offset=[0, 2 * mmap.PAGESIZE], size=sizes, metas=[b"m"], frames=[memory], given=True))
    table = box.pop(0)
    box.clear()
    assert table.release_pages() == 0 and (memory == 7).all()
    del table, memory
    mapping.close()


def test_filing_chunks_holds_little_more_than_the_filed_arrays(tmp_path: Any) -> None:
    """The first pop files every chunk at once: it makes the segment at its final dtypes and fills it chunk
    by chunk, instead of expanding every chunk's arrays to int64 at once (~4.7x the segment before)."""
    import tracemalloc

    box = Postbox(BufferResource({}, spill_dir=str(tmp_path)), "filing")
    nchunks, per = 200, 1000
    frame = np.zeros(per * 240, np.uint8)
    sizes = np.full(per, 240, np.int64)
    for c in range(nchunks):
        box.add_chunk(Chunk(c, "a", 0, 0, pids=np.arange(per) * 2 + c % 2, nrows=np.full(per, 10),
                            meta_of=np.zeros(per, np.int64), frame_of=np.zeros(per, np.int64),
                            offset=np.cumsum(sizes) - sizes, size=sizes, metas=[b"m"], frames=[frame]))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        table = box.pop(0)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert len(table) == nchunks // 2
    segments = {id(s): s for entries in box._where.values() for s, _ in entries}
    (segment,) = segments.values()
    filed = sum(getattr(segment, k).nbytes for k in segment.__slots__)
    assert peak < 2.5 * filed, (peak, filed)
    box.clear()
