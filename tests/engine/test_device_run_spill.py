"""The device run's disk tier: device -> host -> disk under tiny budgets, on CPU.

:class:`mpshuffle.shuffler.device.DeviceRun` runs on one rank with NumPy device
tables (the host twin) and no GPU state, so these tests drive its spilling
on any machine: buffers past the ``DEVICE`` budget go to host, past the
``HOST`` budget to the run's spill directory, and extract reads them back.
"""

from __future__ import annotations

import errno
import os
import threading
from typing import Any

import numpy as np
import pytest

from conftest import check_device_output as _check_output
from conftest import host_table as _host_table
from mpshuffle.comm import LocalCommunicator
from mpshuffle.errors import ShuffleError, SpillError
from mpshuffle.memory import BufferResource, MemoryType
from mpshuffle.shuffler.device import DeviceRun
from mpshuffle.table.device import DeviceAdapter, DeviceTable

OWNER = "rank 0 (worker test)"
NPART = 5
# Each input table packs to ~26 kB; both budgets are far below one table.
LIMIT = 10_000


def _resource(spill_dir: Any, host: int | None = LIMIT) -> BufferResource:
    return BufferResource(
        {MemoryType.DEVICE: LIMIT, MemoryType.HOST: host},
        spill_dir=str(spill_dir), owner=OWNER, spill_prefix="mpshuffle-g",
    )


def _run(comm: LocalCommunicator, resource: BufferResource, done: list[int] | None = None) -> DeviceRun:
    run = DeviceRun(
        comm, 7, resource=resource, state=None, key="g", timeout=10,
        on_done=done.append if done is not None else None,
    )
    comm.register_handler("mpsd", run.receive)
    return run


def _files(root: Any) -> list[str]:
    """Spill files under ``root``; the owners' lock files (test_spill_orphans.py) are left out."""
    return sorted(
        os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs if not f.endswith(".lock")
    )


def _assert_clean(resource: BufferResource, spill_dir: Any) -> None:
    assert os.listdir(spill_dir) == []
    assert [resource.used(mt) for mt in MemoryType] == [0, 0, 0]
    assert not [t for t in threading.enumerate() if t.name.startswith("mpshuffle-device")]


def _unpack(pieces: list[Any], like: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return DeviceAdapter().unpack(pieces, DeviceTable(like).empty_like()).columns


def test_buffers_spill_to_disk_and_every_partition_comes_back(comm: LocalCommunicator, tmp_path: Any) -> None:
    resource = _resource(tmp_path)
    done: list[int] = []
    run = _run(comm, resource, done)
    inputs = [_host_table(i, 1000) for i in range(4)]
    for i, t in enumerate(inputs):
        run.insert(i, DeviceTable(t), ["key"], NPART)
    # The outbox went down to disk (the store's policy: each buffer is larger
    # than the host budget, so it passed straight to disk through a transfer
    # block, and the host never held it). On one rank every row stays here, so
    # the buffers went piece by piece (as received buffers do) into the rank's
    # one spill file, as the host path's postbox.
    stats = run.statistics
    assert stats["bytes_spilled_disk"] > 0 and resource.peak(MemoryType.HOST) <= LIMIT
    assert resource.used(MemoryType.DISK) == stats["bytes_spilled_disk"]
    assert resource.used(MemoryType.DEVICE) <= LIMIT and resource.used(MemoryType.HOST) <= LIMIT
    one_file = [os.path.join("mpshuffle-g-op7-r0", "pieces.bin")]
    assert _files(tmp_path) == one_file
    spilled = stats["bytes_spilled_disk"]

    run.barrier(NPART)
    assert stats["rounds"] == 4
    # Nothing was read back for a round, nor written again.
    assert _files(tmp_path) == one_file
    assert stats["bytes_unspilled_disk"] == 0 and stats["bytes_spilled_disk"] == spilled
    assert resource.used(MemoryType.HOST) <= LIMIT

    reads: list[int] = []
    real_read = run._disk.read

    def counting_read(ranges: Any, allocate: Any = None) -> Any:
        reads.append(len(ranges))
        return real_read(ranges, allocate)

    run._disk.read = counting_read  # type: ignore[method-assign]
    parts = []
    for j in range(NPART):
        on_disk = resource.used(MemoryType.DISK)
        pieces = run.extract(j)
        # One piece per input partition (1000 random keys each), gathered into one.
        assert len(pieces) == 1
        assert reads == [4] * (j + 1)  # one read of partition j's 4 byte ranges in its extract
        parts.append(_unpack(pieces, inputs[0]))
        if j < NPART - 1:  # (the last extract closes the run)
            assert 0 < resource.used(MemoryType.DISK) < on_disk  # partition j's pieces left the disk
    _check_output(parts, inputs, NPART)
    assert stats["bytes_unspilled_disk"] == stats["bytes_spilled_disk"]
    assert stats["seconds_spill_disk"] > 0 and stats["seconds_unspill_disk"] > 0
    assert stats["bytes_gathered"] > 0
    assert done == [7] and run.closed
    _assert_clean(resource, tmp_path)


def test_fail_removes_spill_files_before_and_after_the_exchange(comm: LocalCommunicator, tmp_path: Any) -> None:
    inputs = [_host_table(i, 1000) for i in range(3)]
    for at_barrier in (False, True):
        resource = _resource(tmp_path)
        run = _run(comm, resource)
        for i, t in enumerate(inputs):
            run.insert(i, DeviceTable(t), ["key"], NPART)
        if at_barrier:
            run.barrier(NPART)
            run.extract(0)  # one partition read back; the others still on disk
        assert _files(tmp_path) and resource.used(MemoryType.DISK) > 0
        run.fail(ShuffleError("released by the test"))
        with pytest.raises(ShuffleError, match="released by the test"):
            run.extract(1)
        run.close()
        _assert_clean(resource, tmp_path)


def test_worker_context_gives_the_device_run_its_spill_directory(tmp_path: Any) -> None:
    from mpshuffle.config import resolve_options
    from mpshuffle.shuffler.context import WorkerContext

    options = resolve_options(spill_host=LIMIT, spill_dir=str(tmp_path))
    ctx = WorkerContext(LocalCommunicator(), "gen1", options, workers=("w0",))
    try:
        # A tiny device budget, on CPU machines (the host twin) and GPU ones alike.
        ctx.resource.limits[MemoryType.DEVICE] = LIMIT
        run = ctx.shuffler(4, device=True)
        for i in range(3):
            run.insert(i, DeviceTable(_host_table(i, 1000)), ["key"], NPART)
        assert run.statistics["bytes_spilled_disk"] > 0
        assert sorted(os.listdir(tmp_path)) == ["mpshuffle-gen1-op4-r0", "mpshuffle-gen1-op4-r0.lock"]
        assert ctx.resource.owner == "rank 0 (worker w0)"
    finally:
        ctx.close()  # the worker plugin's teardown: runs still open are failed and freed
    assert os.listdir(tmp_path) == [] and ctx.shufflers == {} and run.closed
    assert [ctx.resource.used(mt) for mt in MemoryType] == [0, 0, 0]


def test_worker_context_sets_up_the_gpu_at_its_first_device_run_not_at_creation(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Setting up a GPU (CuPy, a CUDA context, the pool) took ~2 s per worker on a
    # GPU host: a context whose runs are all host runs must never do it.
    from mpshuffle.config import resolve_options
    from mpshuffle.shuffler import context as context_module
    from mpshuffle.shuffler.device import DeviceState

    calls: list[int] = []
    closed: list[int] = []

    class Recorded(DeviceState):
        def close(self) -> None:
            closed.append(self.device)
            super().close()

    def setup(options: Any, rank: int) -> DeviceState:
        calls.append(rank)
        return Recorded(0, 12345, 0)

    monkeypatch.setattr(context_module, "setup_device", setup)
    options = resolve_options(spill_dir=str(tmp_path))
    unused = context_module.WorkerContext(LocalCommunicator(), "gen2", options, workers=("w0",))
    unused.shuffler(1)  # a host run
    unused.close()
    assert calls == [] and closed == []
    ctx = context_module.WorkerContext(LocalCommunicator(), "gen3", options, workers=("w0",))
    try:
        ctx.shuffler(1)
        assert calls == [] and MemoryType.DEVICE not in ctx.resource.limits
        assert isinstance(ctx.shuffler(2, device=True), DeviceRun)
        state = ctx.device
        assert isinstance(state, Recorded) and calls == [0]
        assert ctx.device is state and calls == [0]  # once
        assert ctx.resource.limit(MemoryType.DEVICE) == 12345
    finally:
        ctx.close()
    assert closed == [0]
    # Asked for a device pool (pool_size), the context reserves it up front.
    eager = context_module.WorkerContext(
        LocalCommunicator(), "gen4", resolve_options(spill_dir=str(tmp_path), pool_size=0.25), workers=("w0",)
    )
    assert calls == [0, 0] and eager.resource.limit(MemoryType.DEVICE) == 12345
    eager.close()
    assert closed == [0, 0]


def _disk_full_after(monkeypatch: pytest.MonkeyPatch, ok_writes: int) -> dict[str, int]:
    from mpshuffle.memory import spill as spill_module

    real = spill_module._pwritev_all
    calls = {"n": 0}

    def fills_up(fd: int, parts: Any, at: int, want: int) -> None:
        calls["n"] += 1  # one call per buffer written (its pieces in one writev)
        if calls["n"] > ok_writes:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, parts, at, want)

    monkeypatch.setattr(spill_module, "_pwritev_all", fills_up)
    return calls


def _check_disk_full(msg: str, tmp_path: Any) -> None:
    assert "disk is full" in msg
    assert os.path.join(str(tmp_path), "mpshuffle-g-op7-r0") in msg
    assert OWNER in msg and "spill_dir" in msg


def test_disk_full_in_insert_fails_the_run_cleanly(
    comm: LocalCommunicator, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _disk_full_after(monkeypatch, ok_writes=1)
    resource = _resource(tmp_path)
    run = _run(comm, resource)
    inputs = [_host_table(i, 1000) for i in range(4)]
    with pytest.raises(SpillError) as info:
        for i, t in enumerate(inputs):
            run.insert(i, DeviceTable(t), ["key"], NPART)
    _check_disk_full(str(info.value), tmp_path)
    assert calls["n"] == 2
    # The run failed: its buffers and files are gone, and every later call says why.
    assert os.listdir(tmp_path) == []
    assert [resource.used(mt) for mt in MemoryType] == [0, 0, 0]
    with pytest.raises(SpillError, match="disk is full"):
        run.insert(9, DeviceTable(inputs[0]), ["key"], NPART)
    with pytest.raises(SpillError, match="disk is full"):
        run.barrier(NPART)
    run.close()
    _assert_clean(resource, tmp_path)

    # Nothing else was lost: the next run on the same resource, with a working disk, is whole.
    monkeypatch.undo()
    run2 = DeviceRun(comm, 8, resource=resource, state=None, key="g", timeout=10)
    # Messages go to their run by op id, as the worker context routes them.
    comm.register_handler("mpsd", lambda src, tag, frames: run2.receive(src, tag, frames) if tag[1] == 8 else None)
    for i, t in enumerate(inputs):
        run2.insert(i, DeviceTable(t), ["key"], NPART)
    run2.barrier(NPART)
    parts = [_unpack(run2.extract(j), inputs[0]) for j in range(NPART)]
    _check_output(parts, inputs, NPART)
    assert run2.statistics["bytes_spilled_disk"] > 0
    _assert_clean(resource, tmp_path)


def test_disk_full_in_the_exchange_fails_the_barrier_and_extract(
    comm: LocalCommunicator, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No host budget while inserting: the outbox stays in host memory, and the
    # received buffers hit the (full) disk during the exchange.
    resource = _resource(tmp_path, host=None)
    run = _run(comm, resource)
    inputs = [_host_table(i, 1000) for i in range(3)]
    for i, t in enumerate(inputs):
        run.insert(i, DeviceTable(t), ["key"], NPART)
    assert run.statistics["bytes_spilled_disk"] == 0 and resource.used(MemoryType.HOST) > LIMIT
    resource.limits[MemoryType.HOST] = LIMIT
    calls = _disk_full_after(monkeypatch, ok_writes=2)  # part of one buffer's pieces get written
    with pytest.raises(ShuffleError) as info:
        run.barrier(NPART)
    _check_disk_full(str(info.value), tmp_path)
    assert calls["n"] == 3
    with pytest.raises(ShuffleError, match="disk is full"):
        run.extract(0)
    run.close()
    _assert_clean(resource, tmp_path)


def test_spilled_buffers_reuse_pooled_blocks_across_runs_within_the_host_budget(
    comm: LocalCommunicator, tmp_path: Any
) -> None:
    from mpshuffle.memory.pool import HostPool, size_class
    from mpshuffle.shuffler.device.buffers import STAGE_BYTES, HostBlocks

    # Room on the device for one table (~26 kB), on the host for three pool
    # blocks of a spilled buffer's size class (26.4-26.6 kB asked; the class is
    # the pool's smallest, 64 KiB): the host tier makes room (oldest to disk)
    # before each buffer comes down to it.
    host = 3 * size_class(26_600)
    resource = BufferResource({MemoryType.DEVICE: 30_000, MemoryType.HOST: host}, spill_dir=str(tmp_path),
                              owner=OWNER, spill_prefix="mpshuffle-g")
    spill = HostPool(host, resource, per_class=64)
    resource.add_reclaimer(MemoryType.HOST, spill.trim)
    blocks = HostBlocks(spill, HostPool(2 * STAGE_BYTES, per_class=2))
    inputs = [_host_table(i, 1000) for i in range(5)]
    for op in (1, 2):
        run = DeviceRun(comm, op, resource=resource, state=None, key="g", timeout=10, blocks=blocks)
        comm.register_handler("mpsd", run.receive)
        for i, t in enumerate(inputs):
            run.insert(i, DeviceTable(t), ["key"], NPART)
        stats = run.statistics
        assert stats["bytes_spilled_host"] > 0 and stats["bytes_spilled_disk"] > 0
        run.barrier(NPART)
        parts = [_unpack(run.extract(j), inputs[0]) for j in range(NPART)]
        _check_output(parts, inputs, NPART)
        assert run.closed and stats["bytes_gathered"] > 0
    # What the host tier held (buffers and idle blocks) never passed its budget;
    # the second run's spills went into the first run's blocks.
    assert resource.peak(MemoryType.HOST) <= host
    assert spill.stats()["reused_bytes"] > 0 and 0 < spill.idle_bytes <= host
    assert resource.used(MemoryType.HOST) == spill.idle_bytes  # kept across runs, reserved
    assert blocks.stage is not None and blocks.stage.stats()["reused_bytes"] > 0
    assert resource.reclaim(MemoryType.HOST) > 0 and resource.used(MemoryType.HOST) == 0
    assert [resource.used(mt) for mt in MemoryType] == [0, 0, 0]
    assert os.listdir(tmp_path) == []


def test_gather_stages_disk_pieces_between_host_pieces_in_one_block() -> None:
    from mpshuffle.shuffler.device.gather import Located, gather
    from mpshuffle.table.device import piece_metadata

    # One int64 column: pieces alternate disk, host, disk, device, disk.
    meta = piece_metadata(["a"], [np.dtype(np.int64)])
    values = [np.arange(10 * k, 10 * k + n, dtype=np.int64) for k, n in enumerate([3, 8, 1, 5, 9])]
    file = np.zeros(4096, np.uint8)
    where: list[Located] = []
    offset = 0
    for k, v in enumerate(values):
        raw = v.view(np.uint8)
        if k in (0, 2, 4):
            file[offset : offset + raw.nbytes] = raw
            where.append(Located(raw.nbytes, len(v), file_offset=offset))
            offset += 128
        elif k == 1:
            where.append(Located(raw.nbytes, len(v), host=np.concatenate([np.zeros(8, np.uint8), raw]), offset=8))
        else:
            where.append(Located(raw.nbytes, len(v), device=raw.copy()))

    def read(ranges: Any) -> Any:
        out, positions, at = np.zeros(4096, np.uint8), [], 0
        for off, n in ranges:
            out[at : at + n] = file[off : off + n]
            positions.append(at)
            at += n + (-n) % 64
        return out, positions

    data, nrows = gather(where, meta, xp=np, read=read, stage_bytes=1 << 20)
    assert nrows == 26
    np.testing.assert_array_equal(data[: 26 * 8].view(np.int64), np.concatenate(values))
