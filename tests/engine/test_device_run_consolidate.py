"""The device run's consolidation: each output partition leaves the exchange as one piece.

Runs :class:`mpshuffle.shuffler.device.DeviceRun` on one rank with NumPy device
tables (the host twin, no GPU), which takes the very code path of a GPU run
except that :func:`mpshuffle.memory.device.batched_copy` loops on the host.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from conftest import host_table as _host_table
from mpshuffle.comm import LocalCommunicator
from mpshuffle.memory import BufferResource, MemoryType
from mpshuffle.memory.device import batched_copy
from mpshuffle.shuffler.device import DeviceRun
from mpshuffle.table.device import DeviceAdapter, DeviceTable

NPART = 6


def _shuffle(comm: LocalCommunicator, resource: BufferResource, inputs: list[dict[str, np.ndarray]]) -> tuple[
    DeviceRun, list[list[Any]]
]:
    run = DeviceRun(comm, 3, resource=resource, state=None, key="c", timeout=10)
    comm.register_handler("mpsd", run.receive)
    for i, t in enumerate(inputs):
        run.insert(i, DeviceTable(t), ["key"], NPART)
    run.barrier(NPART)
    return run, [run.extract(j) for j in range(NPART)]


def _expected(inputs: list[dict[str, np.ndarray]], j: int, like: dict[str, np.dtype[Any]]) -> dict[str, np.ndarray]:
    """Rows of partition ``j``, in input order, then row order (the shuffle's output order)."""
    adapter = DeviceAdapter()
    parts = []
    for t in inputs:
        ids = adapter.partition_ids(DeviceTable(t), ["key"], NPART)
        parts.append({k: v[ids == j] for k, v in t.items()})
    return {k: np.concatenate([p[k] for p in parts]).astype(like[k]) for k in like}


def _assert_partitions(pieces: list[list[Any]], inputs: list[dict[str, np.ndarray]]) -> None:
    meta = DeviceTable(inputs[0]).empty_like()
    for j, p in enumerate(pieces):
        got = DeviceAdapter().unpack(p, meta).columns
        want = _expected(inputs, j, meta.dtypes)
        for k, w in want.items():
            assert got[k].dtype == w.dtype
            np.testing.assert_array_equal(got[k], w, err_msg=f"partition {j}, column {k}")


def test_each_partition_comes_out_as_one_piece_in_input_order(comm: LocalCommunicator) -> None:
    # Tables of different sizes, one of them empty: every column's rows must
    # land in order, at the right offsets of the consolidated buffers.
    inputs = [_host_table(i, n) for i, n in enumerate([700, 0, 1, 333, 2048])]
    resource = BufferResource()
    run, pieces = _shuffle(comm, resource, inputs)
    assert [len(p) for p in pieces] == [1] * NPART
    assert run.statistics["bytes_consolidated"] > 0
    _assert_partitions(pieces, inputs)
    assert run.closed and [resource.used(mt) for mt in MemoryType] == [0, 0, 0]


def test_inputs_of_different_dtypes_are_not_consolidated_and_cast_at_extract(comm: LocalCommunicator) -> None:
    inputs = [_host_table(i, 500) for i in range(3)]
    inputs[1]["s"] = inputs[1]["s"].astype(np.int8)  # safely castable to the meta's int16
    run, pieces = _shuffle(comm, BufferResource(), inputs)
    assert run.statistics["bytes_consolidated"] == 0
    assert [len(p) for p in pieces] == [3] * NPART
    _assert_partitions(pieces, [inputs[0], {**inputs[1], "s": inputs[1]["s"].astype(np.int16)}, inputs[2]])


def test_no_consolidation_past_the_device_budget_each_extract_gathers(comm: LocalCommunicator) -> None:
    inputs = [_host_table(i, 1000) for i in range(3)]
    # Room for the received buffers (about 3 x 32 kB) but not for a second copy of them;
    # room for one partition's gathered piece.
    resource = BufferResource({MemoryType.DEVICE: 120_000})
    run, pieces = _shuffle(comm, resource, inputs)
    assert run.statistics["bytes_spilled_host"] == 0 and run.statistics["bytes_consolidated"] == 0
    assert run.statistics["bytes_gathered"] > 0
    assert [len(p) for p in pieces] == [1] * NPART
    _assert_partitions(pieces, inputs)
    assert [resource.used(mt) for mt in MemoryType] == [0, 0, 0]


def test_batched_copy_on_the_host_copies_every_segment_and_nothing_else() -> None:
    src = [np.arange(256, dtype=np.uint8), np.arange(100, 200, dtype=np.uint8)]
    dst = [np.zeros(64, dtype=np.uint8), np.zeros(8, dtype=np.uint8)]
    batched_copy(src, dst, np.array([[0, 10, 0, 3, 5], [1, 0, 1, 0, 8], [1, 50, 0, 60, 0]]))
    want0 = np.zeros(64, dtype=np.uint8)
    want0[3:8] = np.arange(10, 15)
    np.testing.assert_array_equal(dst[0], want0)
    np.testing.assert_array_equal(dst[1], np.arange(100, 108))


def test_a_full_device_leaves_the_pieces_as_they_are(comm: LocalCommunicator, monkeypatch: Any) -> None:
    from mpshuffle.shuffler.device import buffers
    from mpshuffle.shuffler.device import run as device_run

    def full(*args: Any, **kwargs: Any) -> Any:
        raise MemoryError("out of device memory (test)")

    monkeypatch.setattr(buffers, "allocate", full)  # the consolidation's
    monkeypatch.setattr(device_run, "gather", full)  # an extract's
    inputs = [_host_table(i, 800) for i in range(3)]
    resource = BufferResource()
    run, pieces = _shuffle(comm, resource, inputs)
    assert run.statistics["bytes_consolidated"] == 0
    assert [len(p) for p in pieces] == [3] * NPART
    _assert_partitions(pieces, inputs)
    assert [resource.used(mt) for mt in MemoryType] == [0, 0, 0]
