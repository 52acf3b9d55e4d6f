"""Edge cases of the device run, on CPU: one rank, and several ranks with a stand-in for NCCL.

:class:`mpshuffle.shuffler.device.DeviceRun` runs here with NumPy device tables
(the host twin). One rank needs nothing else. Several ranks run in one
process: each has a :class:`_MemComm` (a host communicator that hands messages
to the peer's progress thread) and a :class:`_FakeState` whose transport
copies NumPy arrays between the ranks' threads. The transport keeps NCCL's
rule strictly: the arrays rank ``a`` sends ``b`` in one call must match, by
count and byte size, what ``b`` receives from ``a`` in its matching call.
The only code that is not the GPU run's is the transport and the pack
kernel (the host twin gathers with ``take``).

Every output is compared with an independent expectation: the rows of each
input whose :meth:`DeviceAdapter.partition_ids` is the partition, inputs in
index order, rows in input order, with the meta's dtypes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from mpshuffle.comm import LocalCommunicator
from mpshuffle.comm.base import Communicator, Frames, Tag
from mpshuffle.errors import ShuffleError
from mpshuffle.memory import BufferResource, MemoryType
from mpshuffle.shuffler.device import DeviceRun, DeviceState
from mpshuffle.shuffler.device import buffers as buffers_module
from mpshuffle.table.device import DeviceAdapter, DeviceTable, partition_order

Table = dict[str, np.ndarray]


# -- data and expectations -----------------------------------------------------


def _table(
    seed: int, n: int, dtypes: tuple[str, ...] = ("int64", "float32", "bool", "uint64", "int8")
) -> Table:
    """Columns ``c0..`` of the given dtypes (float keys with NaN, -0.0 and 0.0), and ``row``."""
    rng = np.random.default_rng(seed)
    t: Table = {}
    for c, name in enumerate(dtypes):
        dt = np.dtype(name)
        if dt.kind == "b":
            t[f"c{c}"] = rng.integers(0, 2, n).astype(bool)
        elif dt.kind == "f":
            v = rng.normal(size=n).astype(dt)
            if n:
                v[rng.integers(0, n, max(1, n // 8))] = np.nan
                v[rng.integers(0, n, max(1, n // 8))] = -0.0
                v[rng.integers(0, n, max(1, n // 8))] = 0.0
            t[f"c{c}"] = v
        else:
            info = np.iinfo(dt)
            t[f"c{c}"] = rng.integers(info.min, info.max, n, dtype=dt, endpoint=True)
    t["row"] = np.arange(n, dtype=np.int64) + seed * 10**6
    return t


def _expected(inputs: list[Table], on: list[str], npart: int) -> list[Table]:
    """Per partition: its rows of every input, inputs in index order, rows in order."""
    adapter = DeviceAdapter()
    ids = [adapter.partition_ids(DeviceTable(t), on, npart) for t in inputs]
    return [
        {
            k: np.concatenate([t[k][i == j] for t, i in zip(inputs, ids, strict=True)])
            for k in inputs[0]
        }
        for j in range(npart)
    ]


def _assert_partition(pieces: list[Any], want: Table, j: int) -> None:
    got = DeviceAdapter().unpack(pieces, DeviceTable(want).empty_like()).columns
    assert list(got) == list(want)
    for k, w in want.items():
        assert got[k].dtype == w.dtype, f"partition {j}, column {k}"
        np.testing.assert_array_equal(got[k], w, err_msg=f"partition {j}, column {k}")


def _assert_clean(resources: list[BufferResource], spill_dir: Any) -> None:
    assert os.listdir(spill_dir) == []
    for r in resources:
        assert [r.used(mt) for mt in MemoryType] == [0, 0, 0]
    deadline = time.monotonic() + 5
    while [t for t in threading.enumerate() if t.name.startswith("mpshuffle-device")]:
        assert time.monotonic() < deadline, "an exchange thread was left behind"
        time.sleep(0.01)


def _resource(spill_dir: Any, device: int | None = None, host: int | None = None) -> BufferResource:
    return BufferResource(
        {MemoryType.DEVICE: device, MemoryType.HOST: host},
        spill_dir=str(spill_dir),
        owner="test",
        spill_prefix="mpshuffle-b",
    )


def _one_rank(comm: LocalCommunicator, resource: BufferResource) -> DeviceRun:
    run = DeviceRun(comm, 3, resource=resource, state=None, key="b", timeout=10)
    comm.register_handler("mpsd", run.receive)
    return run


# -- partition_order at the narrow key types' edges --------------------------------


@pytest.mark.parametrize("npart", [1, 2, 255, 256, 257, 65536, 65537])
@pytest.mark.parametrize("nranks", [1, 2, 3])
def test_partition_order_is_a_stable_rank_major_sort_at_every_key_width(
    npart: int, nranks: int
) -> None:
    # The keys are uint8 up to 256 values, uint16 up to 65536, then uint32:
    # the largest id of each width, and ids of an empty key range between.
    rng = np.random.default_rng(npart * 7 + nranks)
    ids = rng.integers(0, npart, 3000)
    ids[:5] = npart - 1
    ids[5:8] = 0
    order, counts = partition_order(ids, npart, nranks)
    np.testing.assert_array_equal(counts, np.bincount(ids, minlength=npart))
    np.testing.assert_array_equal(
        order, np.lexsort((np.arange(len(ids)), ids // nranks, ids % nranks))
    )
    order0, counts0 = partition_order(ids[:0], npart, nranks)
    assert len(order0) == 0 and counts0.tolist() == [0] * npart


# -- one rank ----------------------------------------------------------------------

# (npartitions, input sizes, key columns, device budget, host budget)
_CASES = {
    # Many more partitions than rows: most are empty, and one input has no rows.
    "mostly-empty-partitions": (1000, [40, 0, 7], ["c0"], None, None),
    "one-partition": (1, [300, 0, 50], ["c0"], None, None),
    "256-partitions": (256, [900, 513], ["c3"], None, None),
    "257-partitions": (257, [900, 513], ["c3"], None, None),
    # Float keys: NaN rows (one partition) and -0.0 with 0.0.
    "float-key": (7, [400, 1, 300], ["c1"], None, None),
    # A bool key: every row in one of two partitions of 9.
    "bool-key": (9, [200, 333, 64], ["c2"], None, None),
    "two-keys": (13, [250, 250, 250], ["c4", "c2"], None, None),
    # Four buffers of 18752 bytes fit; what is left has room for one slot a
    # round (a slot counts twice its buffer), then for two.
    "one-slot-per-round": (5, [600, 600, 600, 600], ["c0"], 100_000, None),
    "two-slots-per-round": (5, [600, 600, 600, 600], ["c0"], 160_000, None),
    # Spilled device -> host -> disk, so never consolidated.
    "spill-to-disk": (5, [600, 600, 600], ["c0"], 5_000, 5_000),
}


@pytest.mark.parametrize("case", list(_CASES))
def test_one_rank_output_is_every_input_row_in_order(
    comm: LocalCommunicator, tmp_path: Any, case: str
) -> None:
    npart, sizes, on, device, host = _CASES[case]
    inputs = [_table(i, n) for i, n in enumerate(sizes)]
    resource = _resource(tmp_path, device, host)
    run = _one_rank(comm, resource)
    # Out of index order: the output is in index order all the same.
    for i in reversed(range(len(inputs))):
        run.insert(i, DeviceTable(inputs[i]), on, npart)
    run.barrier(npart)
    stats = dict(run.statistics)
    for j, want in enumerate(_expected(inputs, on, npart)):
        _assert_partition(run.extract(j), want, j)
    assert run.closed
    if case == "one-slot-per-round":
        # No room left for a second copy of the 75 kB: the pieces stay as they are.
        assert (
            stats["rounds"] == 4
            and stats["bytes_spilled_host"] == 0
            and stats["bytes_consolidated"] == 0
        )
    elif case == "two-slots-per-round":
        assert (
            stats["rounds"] == 2 and stats["bytes_spilled_host"] == 0 and stats["bytes_consolidated"] > 0
        )
    elif case == "spill-to-disk":
        assert stats["bytes_spilled_disk"] > 0 and stats["bytes_consolidated"] == 0
    else:
        assert stats["rounds"] == 1 and stats["bytes_consolidated"] > 0
    _assert_clean([resource], tmp_path)


def test_all_rows_in_one_partition(comm: LocalCommunicator, tmp_path: Any) -> None:
    inputs = [_table(i, n) for i, n in enumerate([500, 3, 200])]
    for t in inputs:
        t["c0"][:] = 42  # one key: total skew
    resource = _resource(tmp_path)
    run = _one_rank(comm, resource)
    for i, t in enumerate(inputs):
        run.insert(i, DeviceTable(t), ["c0"], 8)
    run.barrier(8)
    want = _expected(inputs, ["c0"], 8)
    full = [j for j, w in enumerate(want) if len(w["row"])]
    assert len(full) == 1 and len(want[full[0]]["row"]) == 703
    for j in range(8):
        pieces = run.extract(j)
        assert len(pieces) == (1 if j in full else 0)
        _assert_partition(pieces, want[j], j)
    _assert_clean([resource], tmp_path)


def test_some_buffers_spilled_others_not_skips_consolidation(
    comm: LocalCommunicator, tmp_path: Any
) -> None:
    # Four 18.75 kB buffers under a 60 kB budget: the oldest goes to host, the
    # others stay on the device; the partitions then mix device and host pieces.
    inputs = [_table(i, 600) for i in range(4)]
    resource = _resource(tmp_path, device=60_000)
    run = _one_rank(comm, resource)
    for i, t in enumerate(inputs):
        run.insert(i, DeviceTable(t), ["c0"], 6)
    assert [o.buffer is not None and o.buffer.on_device for o in run._outbox] == [
        False,
        True,
        True,
        True,
    ]
    # Room enough now: only the spilled buffer stops the consolidation (on a
    # GPU, a batched copy from host memory would read garbage or fault).
    resource.limits[MemoryType.DEVICE] = 10**9
    run.barrier(6)
    assert run.statistics["bytes_consolidated"] == 0
    assert [i.buffer.on_device for i in run._incoming] == [False, True, True, True]
    for j, want in enumerate(_expected(inputs, ["c0"], 6)):
        pieces = run.extract(j)
        assert len(pieces) == 1  # gathered by the extract from the device and host pieces
        _assert_partition(pieces, want, j)
    assert run.statistics["bytes_gathered"] > 0
    _assert_clean([resource], tmp_path)


@pytest.mark.parametrize("spill", [False, True])
def test_a_failure_between_rounds_frees_everything(
    comm: LocalCommunicator, tmp_path: Any, spill: bool
) -> None:
    inputs = [_table(i, 600) for i in range(4)]
    resource = _resource(tmp_path, device=60_000, host=5_000 if spill else None)
    run = _one_rank(comm, resource)
    for i, t in enumerate(inputs):
        run.insert(i, DeviceTable(t), ["c0"], 6)
    real = run._spill_over_budget

    def fail_after_round_two() -> None:  # called by the exchange after each round
        real()
        if run.statistics["rounds"] == 2:
            run.fail(ShuffleError("failed by the test"))

    run._spill_over_budget = fail_after_round_two  # type: ignore[method-assign]
    with pytest.raises(ShuffleError, match="failed by the test"):
        run.barrier(6)
    assert run.statistics["rounds"] == 2
    with pytest.raises(ShuffleError, match="failed by the test"):
        run.extract(0)
    run.close()
    _assert_clean([resource], tmp_path)


def test_extract_of_a_partition_not_owned_or_twice(comm: LocalCommunicator, tmp_path: Any) -> None:
    inputs = [_table(i, 100) for i in range(2)]
    resource = _resource(tmp_path)
    run = _one_rank(comm, resource)
    for i, t in enumerate(inputs):
        run.insert(i, DeviceTable(t), ["c0"], 3)
    run.barrier(3)
    for bad in (3, -1):
        with pytest.raises(ShuffleError, match=f"partition {bad} .* not owned"):
            run.extract(bad)
    want = _expected(inputs, ["c0"], 3)
    _assert_partition(run.extract(1), want[1], 1)
    with pytest.raises(ShuffleError, match="partition 1 .* already extracted"):
        run.extract(1)
    assert not run.closed and resource.used(MemoryType.DEVICE) > 0
    run.close()  # before partitions 0 and 2 were taken
    _assert_clean([resource], tmp_path)


# -- several ranks, NCCL replaced by NumPy copies ----------------------------------


class _MemComm(Communicator):
    """One rank of an in-process group: a message goes to the peer's progress thread."""

    def __init__(self, rank: int, nranks: int, group: list[_MemComm]) -> None:
        super().__init__(rank, nranks)
        self.group = group  # filled with every rank's communicator before the first message
        self.addresses = [f"mem://{r}" for r in range(nranks)]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, daemon=True, name=f"test-memcomm-{rank}"
        )
        self._thread.start()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    async def _send(self, dest: int, tag: Tag, frames: Frames) -> None:
        peer = self.group[dest]
        peer.loop.call_soon_threadsafe(
            peer._deliver, self.rank, tag, [bytes(memoryview(f)) for f in frames]
        )

    def close(self) -> None:
        self._stop_progress(self._thread, timeout=5)


class _FakeNccl:
    """The ranks' grouped send/receive calls, matched per (sender, receiver) pair in call order."""

    def __init__(self) -> None:
        self.queues: dict[tuple[int, int], collections.deque[list[np.ndarray]]] = (
            collections.defaultdict(collections.deque)
        )
        self.changed = threading.Condition()

    def exchange(self, rank: int, sends: dict[int, list[Any]], recvs: dict[int, list[Any]]) -> None:
        assert rank not in sends and rank not in recvs  # the own range never travels
        with self.changed:
            for dest, arrays in sends.items():
                assert all(a.dtype == np.uint8 and a.flags.c_contiguous for a in arrays)
                self.queues[(rank, dest)].append([a.copy() for a in arrays])
            self.changed.notify_all()
            for src, buffers in recvs.items():
                queue = self.queues[(src, rank)]
                if not self.changed.wait_for(queue.__len__, timeout=10):
                    raise RuntimeError(f"rank {rank}: nothing came from rank {src}")
                arrays = queue.popleft()
                sizes = [a.nbytes for a in arrays], [b.nbytes for b in buffers]
                if sizes[0] != sizes[1]:
                    raise RuntimeError(
                        f"rank {rank} from {src}: sent {sizes[0]} bytes, posted {sizes[1]}"
                    )
                for a, b in zip(arrays, buffers, strict=True):
                    b[:] = a


class _FakeTransport:
    def __init__(self, net: _FakeNccl, rank: int) -> None:
        self.net, self.rank = net, rank

    def exchange(self, sends: dict[int, list[Any]], recvs: dict[int, list[Any]]) -> None:
        self.net.exchange(self.rank, sends, recvs)


class _FakeState(DeviceState):
    """A rank's "GPU": no CUDA device to make current, the NumPy transport."""

    def __init__(self, net: _FakeNccl, rank: int) -> None:
        super().__init__(0, 0, 0)
        self.net, self.rank = net, rank

    def scope(self) -> Any:
        return contextlib.nullcontext()

    def transport(self, comm: Communicator, key: str, timeout: float) -> Any:
        return _FakeTransport(self.net, self.rank)


@pytest.fixture
def host_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Received buffers and spilled sends as NumPy arrays (filled with junk: every byte must be written)."""
    monkeypatch.setattr(buffers_module, "empty_device", lambda n: np.full(n, 0xAB, dtype=np.uint8))
    monkeypatch.setattr(buffers_module, "to_device", lambda a: np.array(a, copy=True))
    monkeypatch.setattr(buffers_module, "cupy_module", lambda: np)


@contextlib.contextmanager
def _ranks(nranks: int, resources: list[BufferResource]) -> Iterator[list[DeviceRun]]:
    group: list[_MemComm] = []
    group.extend(_MemComm(r, nranks, group) for r in range(nranks))
    net = _FakeNccl()
    runs = [
        DeviceRun(group[r], 5, resource=resources[r], state=_FakeState(net, r), key="b", timeout=10)
        for r in range(nranks)
    ]
    for c, run in zip(group, runs, strict=True):
        c.register_handler("mpsd", run.receive)
    try:
        yield runs
    finally:
        for run in runs:
            run.close()
        for c in group:
            c.close()


# (ranks, npartitions, input sizes, rank of each input, device budget per rank, host budget)
_MULTI: dict[str, tuple[int, int, list[int], list[int], list[int | None], int | None]] = {
    # Rank 2 inserts nothing; large budgets (a GPU rank always has one): one
    # round, consolidated everywhere.
    "one-round": (3, 7, [500, 0, 300, 800, 1], [0, 1, 0, 1, 1], [10**9] * 3, None),
    # Fewer partitions than ranks: rank 2 owns nothing and closes after the exchange.
    "rank-owns-nothing": (3, 2, [400, 400, 400], [2, 0, 1], [10**9] * 3, None),
    # A rank without a device budget (1 slot of its own) does not limit the
    # others' rounds: one round of 2 slots.
    "unbounded-rank-sets-no-limit": (3, 7, [500, 300, 800, 200, 100], [0, 0, 1, 1, 2], [10**9, 10**9, None], None),
    # Budgets that allow two slots a round on one rank, one on another: all take one.
    "rounds-by-the-smallest-budget": (
        3,
        11,
        [900, 700, 900, 300, 900],
        [0, 1, 2, 0, 1],
        [200_000, 90_000, None],
        None,
    ),
    # Spilled to host and disk on the way: no consolidation, pieces read back.
    "spill-to-disk": (2, 5, [700, 700, 700, 700], [0, 1, 1, 0], [20_000, 20_000], 10_000),
    "many-partitions": (4, 257, [600, 50, 600], [3, 3, 1], [10**9] * 4, None),
}


@pytest.mark.parametrize("case", list(_MULTI))
def test_several_ranks_output_is_every_input_row_in_order(
    host_device: None, tmp_path: Any, case: str
) -> None:
    nranks, npart, sizes, where, device, host = _MULTI[case]
    inputs = [_table(i, n) for i, n in enumerate(sizes)]
    resources = [_resource(tmp_path, device[r], host) for r in range(nranks)]
    with _ranks(nranks, resources) as runs:
        for i in reversed(range(len(inputs))):
            runs[where[i]].insert(i, DeviceTable(inputs[i]), ["c0"], npart)
        runs[1].barrier(npart)  # the barrier task may run on any rank
        stats = [dict(r.statistics) for r in runs]
        for j, want in enumerate(_expected(inputs, ["c0"], npart)):
            _assert_partition(runs[j % nranks].extract(j), want, j)
        assert all(r.closed for r in runs)
    rounds = {s["rounds"] for s in stats}
    assert len(rounds) == 1  # every rank takes the same slots per round
    if case in ("one-round", "unbounded-rank-sets-no-limit"):
        assert rounds == {1} and all(s["bytes_consolidated"] > 0 for s in stats)
    elif case == "rounds-by-the-smallest-budget":
        assert rounds == {2}
    elif case == "spill-to-disk":
        assert all(s["bytes_spilled_disk"] > 0 and s["bytes_consolidated"] == 0 for s in stats)
    sent = sum(s["bytes_sent"] for s in stats)
    received = sum(s["bytes_received"] for s in stats)
    assert 0 < sent < received  # own ranges count as received, never as sent
    _assert_clean(resources, tmp_path)


# -- insert attempts ---------------------------------------------------------------


def test_one_rank_keeps_only_the_accepted_attempt_of_an_input(
    comm: LocalCommunicator, tmp_path: Any
) -> None:
    """An insert execution that Dask abandoned (its run restarted while it ran) inserted too.

    The host path drops its data by the attempt the barrier names; the
    device run must as well, or the input's rows come out twice.
    """
    inputs = [_table(i, n) for i, n in enumerate([300, 200])]
    resource = _resource(tmp_path)
    run = _one_rank(comm, resource)
    run.insert(0, DeviceTable(inputs[0]), ["c0"], 4, attempt="abandoned")
    run.insert(1, DeviceTable(inputs[1]), ["c0"], 4, attempt="only")
    run.insert(0, DeviceTable(inputs[0]), ["c0"], 4, attempt="kept")
    run.barrier(4, accepted=["kept", "only"])
    for j, want in enumerate(_expected(inputs, ["c0"], 4)):
        _assert_partition(run.extract(j), want, j)
    _assert_clean([resource], tmp_path)


def test_several_ranks_keep_only_the_accepted_attempt(host_device: None, tmp_path: Any) -> None:
    # The abandoned execution ran on another rank than the kept one, and went to disk there.
    inputs = [_table(i, n) for i, n in enumerate([400, 400, 400])]
    resources = [
        _resource(tmp_path, 10**9),
        _resource(tmp_path, 5_000, 5_000),
        _resource(tmp_path, 10**9),
    ]
    with _ranks(3, resources) as runs:
        runs[1].insert(2, DeviceTable(inputs[2]), ["c0"], 5, attempt="abandoned")
        for i, t in enumerate(inputs):
            runs[i].insert(i, DeviceTable(t), ["c0"], 5, attempt=f"a{i}")
        assert runs[1]._outbox[0].buffer.disk is not None  # type: ignore[union-attr]
        runs[0].barrier(5, accepted=["a0", "a1", "a2"])
        for j, want in enumerate(_expected(inputs, ["c0"], 5)):
            _assert_partition(runs[j % 3].extract(j), want, j)
    _assert_clean(resources, tmp_path)
