"""The one store's building blocks, one by one (no GPU: a fake device tier stands in)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

from mpshuffle.errors import SpillError
from mpshuffle.memory import BufferResource, MemoryType, SpillDirectory
from mpshuffle.memory.store import MAP_MIN_BYTES, TIERS, DiskTier, admits, over, spill_down, to_host


class FakeBuffer:
    """A buffer of ``nbytes`` that moves device -> host -> disk through a resource's counts."""

    def __init__(self, name: str, resource: BufferResource, nbytes: int, disk: DiskTier) -> None:
        self.name, self.resource, self.nbytes, self.disk = name, resource, nbytes, disk
        self.tier = MemoryType.DEVICE
        self.reservation = resource.reserve(MemoryType.DEVICE, nbytes)
        self.data = np.full(nbytes, ord(name[-1]), dtype=np.uint8)
        self.ranges: list[tuple[int, int]] = []
        self.moves: list[MemoryType] = []

    def move_down(self, to: MemoryType | None = None) -> int:
        below = to or TIERS[TIERS.index(self.tier) + 1]
        self.moves.append(below)
        if below is MemoryType.DISK:
            self.ranges = self.disk.put([self.data])
            self.data = None
        self.reservation.release()
        self.reservation = self.resource.reserve(below, self.nbytes)
        self.tier = below
        return self.nbytes


def _counter() -> tuple[dict[str, float], Any]:
    stats: dict[str, float] = {}

    def count(key: str, amount: float) -> None:
        stats[key] = stats.get(key, 0) + amount

    return stats, count


def test_admits_and_over_follow_the_budget() -> None:
    r = BufferResource({MemoryType.HOST: 100})
    assert admits(r, MemoryType.HOST, 100) and not admits(r, MemoryType.HOST, 101)
    assert admits(r, MemoryType.HOST, 0) and admits(r, MemoryType.DEVICE, 10**12)  # no device budget
    res = r.reserve(MemoryType.HOST, 100)
    assert not over(r, MemoryType.HOST) and not admits(r, MemoryType.HOST, 1)
    extra = r.reserve(MemoryType.HOST, 1)
    assert over(r, MemoryType.HOST) and not over(r, MemoryType.DEVICE)
    res.release()
    extra.release()
    assert r.used(MemoryType.HOST) == 0


def test_spill_down_moves_the_oldest_first_making_room_below_first(tmp_path: Any) -> None:
    r = BufferResource({MemoryType.DEVICE: 250, MemoryType.HOST: 150}, spill_dir=str(tmp_path))
    disk = DiskTier(SpillDirectory(str(tmp_path / "run"), owner="rank 0"))
    bufs = [FakeBuffer(f"b{k}", r, 100, disk) for k in range(4)]  # oldest first; 400 on the device
    peaks: list[int] = []
    real_reserve = r.reserve

    def reserve(mt: MemoryType, nbytes: int) -> Any:
        res = real_reserve(mt, nbytes)
        peaks.append(r.used(MemoryType.HOST))
        return res

    r.reserve = reserve  # type: ignore[method-assign]
    stats, count = _counter()
    spill_down(r, bufs, count)
    # Device past 250: b0 went to host; b1 too, after b0 made room by going on to disk.
    # The host never held more than its 150.
    assert [b.tier for b in bufs] == [MemoryType.DISK, MemoryType.HOST, MemoryType.DEVICE, MemoryType.DEVICE]
    assert max(peaks) <= 150
    assert [r.used(mt) for mt in TIERS] == [200, 100, 100]
    assert stats["bytes_spilled_host"] == 200 and stats["bytes_spilled_disk"] == 100
    assert stats["seconds_spill_host"] >= 0 and stats["seconds_spill_disk"] >= 0
    assert os.listdir(tmp_path / "run") == ["pieces.bin"]
    # Within budget: a second pass moves nothing.
    spill_down(r, bufs, count)
    assert stats["bytes_spilled_host"] == 200 and stats["bytes_spilled_disk"] == 100
    # Nothing comes back on its own: the disk buffer is read by range.
    (view,) = disk.get(bufs[0].ranges)
    assert bytes(view) == b"0" * 100 and disk.bytes_read == 100 and disk.bytes_written == 100
    disk.remove()
    assert not os.path.exists(tmp_path / "run")


def test_spill_down_counts_what_moved_before_an_error(tmp_path: Any) -> None:
    r = BufferResource({MemoryType.HOST: 0}, spill_dir=str(tmp_path))
    disk = DiskTier(SpillDirectory(str(tmp_path / "run")))
    bufs = [FakeBuffer(f"b{k}", r, 10, disk) for k in range(3)]
    for b in bufs:
        b.move_down(MemoryType.HOST)  # all in host, past its budget of 0
    stats, count = _counter()
    real_put = disk.put
    calls = {"n": 0}

    def fails_second(buffers: Any) -> list[tuple[int, int]]:
        calls["n"] += 1
        if calls["n"] == 2:
            raise SpillError("the disk is full")
        return real_put(buffers)

    disk.put = fails_second  # type: ignore[method-assign]
    with pytest.raises(SpillError, match="disk is full"):
        spill_down(r, bufs, count)
    assert stats["bytes_spilled_disk"] == 10 and bufs[0].tier is MemoryType.DISK and bufs[1].tier is MemoryType.HOST
    disk.remove()


def test_a_device_buffer_the_host_cannot_take_goes_straight_to_disk(tmp_path: Any) -> None:
    # The host is full of what this store cannot move (another run's): no room is made there.
    r = BufferResource({MemoryType.DEVICE: 100, MemoryType.HOST: 150}, spill_dir=str(tmp_path))
    other = r.reserve(MemoryType.HOST, 120)
    disk = DiskTier(SpillDirectory(str(tmp_path / "run")))
    bufs = [FakeBuffer(f"b{k}", r, 100, disk) for k in range(2)]
    stats, count = _counter()
    spill_down(r, bufs, count)
    assert bufs[0].moves == [MemoryType.DISK] and bufs[1].tier is MemoryType.DEVICE
    assert stats["bytes_spilled_disk"] == 100 and stats.get("bytes_spilled_host", 0) == 0
    assert r.used(MemoryType.HOST) == 120
    other.release()
    disk.remove()


def test_idle_pooled_memory_is_room_and_is_reclaimed_before_buffers_move(tmp_path: Any) -> None:
    r = BufferResource({MemoryType.DEVICE: 100, MemoryType.HOST: 150}, spill_dir=str(tmp_path))
    disk = DiskTier(SpillDirectory(str(tmp_path / "run")))
    idle = {"res": r.reserve(MemoryType.HOST, 100)}  # a pool's free block, reserved

    def trim() -> int:
        res = idle.pop("res", None)
        if res is None:
            return 0
        res.release()
        return 100

    r.add_reclaimer(MemoryType.HOST, trim)
    reclaimed_before: list[bool] = []

    class Pooled(FakeBuffer):
        def move_down(self, to: MemoryType | None = None) -> int:
            reclaimed_before.append("res" not in idle)
            if to is MemoryType.HOST and "res" in idle:
                idle.pop("res").release()  # the move takes the free block over
            return super().move_down(to)

    # A block that the move would take over counts as room: nothing is reclaimed first.
    bufs = [Pooled(f"b{k}", r, 100, disk) for k in range(2)]
    _stats, count = _counter()
    spill_down(r, bufs, count, host_cost=lambda n: n - (100 if "res" in idle else 0))
    assert bufs[0].moves == [MemoryType.HOST] and reclaimed_before == [False]
    assert r.used(MemoryType.HOST) == 100
    bufs[0].move_down(MemoryType.DISK)
    reclaimed_before.clear()
    # No block fits the next one: idle memory goes back before any buffer moves to disk.
    idle["res"] = r.reserve(MemoryType.HOST, 100)
    bufs.append(FakeBuffer("b2", r, 100, disk))
    spill_down(r, bufs, count)
    assert bufs[1].moves == [MemoryType.HOST] and reclaimed_before == [True] and "res" not in idle
    assert r.used(MemoryType.HOST) == 100
    disk.remove()


def test_disk_tier_round_trips_aligned_ranges_in_one_file(tmp_path: Any) -> None:
    disk = DiskTier(SpillDirectory(str(tmp_path / "d"), owner="rank 3"))
    assert disk.get([]) == []
    data = [np.arange(n, dtype=np.uint8) for n in (1, 63, 64, 1000)]
    ranges = disk.put(data) + disk.put([b"xyz"])
    assert [n for _, n in ranges] == [1, 63, 64, 1000, 3]
    assert all(off % 64 == 0 for off, _ in ranges)
    assert os.listdir(tmp_path / "d") == ["pieces.bin"]
    views = disk.get(ranges[::-1])
    assert [bytes(v) for v in views] == [b"xyz"] + [d.tobytes() for d in data[::-1]]
    assert disk.bytes_written == disk.bytes_read == 1131
    disk.remove()
    disk.remove()  # idempotent
    with pytest.raises(SpillError, match="already removed"):
        disk.put([b"a"])


def test_disk_tier_view_maps_large_ranges_and_reads_small_ones_into_one_buffer(tmp_path: Any) -> None:
    disk = DiskTier(SpillDirectory(str(tmp_path / "d")))
    rng = np.random.default_rng(7)
    sizes = [MAP_MIN_BYTES + 5, 20_000, 0, MAP_MIN_BYTES - 1, 3 * MAP_MIN_BYTES, 17]
    data = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    ranges = disk.put(data)
    order = [4, 1, 2, 0, 5, 3]
    views = disk.view([ranges[k] for k in order])
    assert len(views) == len(order)
    for k, (buf, at) in zip(order, views, strict=True):
        assert bytes(np.asarray(buf)[at : at + sizes[k]]) == data[k].tobytes()
    by_size = dict(zip([sizes[k] for k in order], views, strict=True))
    small = [by_size[n][0] for n in (20_000, 0, MAP_MIN_BYTES - 1, 17)]
    assert all(b is small[0] for b in small)  # the small ranges share one read buffer
    large = [by_size[n][0] for n in (MAP_MIN_BYTES + 5, 3 * MAP_MIN_BYTES)]
    if disk.directory.map_ranges([ranges[0]]) is not None:  # this system maps spill files
        assert all(b is not small[0] for b in large) and large[0] is not large[1]
        assert all(not b.flags.writeable for b in large)
    else:
        assert all(b is small[0] for b in large)
    assert disk.bytes_read == sum(sizes)
    # Only small ranges, and only large ones: the same bytes.
    for pick in ([1, 5], [0, 4]):
        got = disk.view([ranges[k] for k in pick])
        assert [bytes(np.asarray(b)[at : at + sizes[k]]) for k, (b, at) in zip(pick, got, strict=True)] == [
            data[k].tobytes() for k in pick
        ]
    disk.remove()


def test_to_host_copies() -> None:
    a = np.arange(5, dtype=np.uint8)
    b = to_host(a)
    assert b is not a and b.tolist() == [0, 1, 2, 3, 4] and b.dtype == np.uint8
    out = np.zeros(5, dtype=np.uint8)
    assert to_host(a, out) is out and out.tolist() == [0, 1, 2, 3, 4]
