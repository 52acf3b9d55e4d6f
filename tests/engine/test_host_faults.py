"""Host shuffler on several in-process ranks, one of which stops reading (issue 18, fault 2).

A rank that stops reading (its process is stopped, not dead) leaves its
peers' sends incomplete: the transport's buffers are full. The error must
name that rank, not the one reporting it. The fault is a communicator
subclass whose sends to the frozen rank never complete until released.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pandas as pd
import pytest

from mpshuffle.comm.base import Communicator, Frames, SendFuture, Tag
from mpshuffle.errors import ShuffleTimeoutError
from mpshuffle.memory import BufferResource
from mpshuffle.shuffler import host
from mpshuffle.shuffler.host import Shuffler
from mpshuffle.table import PandasAdapter


class _Group(Communicator):
    """One rank of an in-process group; sends to ``frozen`` ranks wait until ``thaw`` is set."""

    def __init__(self, rank: int, nranks: int, group: list[_Group], frozen: set[int], thaw: threading.Event) -> None:
        super().__init__(rank, nranks)
        self.group, self.frozen, self.thaw = group, frozen, thaw
        self.addresses = [f"mem://{r}" for r in range(nranks)]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name=f"test-group-{rank}")
        self._thread.start()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    async def _send(self, dest: int, tag: Tag, frames: Frames) -> None:
        if dest in self.frozen:
            # The frozen rank's socket buffer is full: the write never completes.
            await asyncio.to_thread(self.thaw.wait)
            return
        peer = self.group[dest]
        peer.loop.call_soon_threadsafe(peer._deliver, self.rank, tag, [bytes(memoryview(f)) for f in frames])

    def close(self) -> None:
        self._stop_progress(self._thread, timeout=5)


class _CopyingGroup(_Group):
    """As :class:`_Group`, but a send copies its frames before returning, as a shared-memory file does."""

    def send_nowait(self, dest: int, tag: Tag, frames: Sequence[Any]) -> SendFuture:
        fut = super().send_nowait(dest, tag, [bytes(memoryview(f)) for f in frames])
        fut.copied = True
        return fut


@pytest.fixture(params=["waits", "copies"])
def ranks(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[list[Shuffler], set[int], threading.Event]]:
    # These tests send chunks of a few hundred bytes to see how sends wait and
    # fail; chunks that small are held and sent together at the end of the
    # inputs (tested on their own below), so here every chunk is sent as it is
    # made, as a large one is.
    monkeypatch.setattr(host, "SMALL_CHUNK_BYTES", -1)
    monkeypatch.setattr(host, "MEDIUM_CHUNK_BYTES", 0)
    nranks, frozen, thaw = 3, set[int](), threading.Event()
    group: list[_Group] = []
    kind = _CopyingGroup if request.param == "copies" else _Group
    group.extend(kind(r, nranks, group, frozen, thaw) for r in range(nranks))
    shufflers = [Shuffler(c, 7, resource=BufferResource(), timeout=5, batch_bytes=64) for c in group]
    for c, s in zip(group, shufflers, strict=True):
        c.register_handler("mps", s.receive)
    yield shufflers, frozen, thaw
    thaw.set()
    for s in shufflers:
        s.close()
    for c in group:
        c.close()


def _pieces(n: int, npartitions: int) -> dict[int, object]:
    frame = pd.DataFrame({"k": range(n), "v": range(n)})
    return PandasAdapter().split(frame, ["k"], npartitions)


@pytest.mark.parametrize("ranks", ["waits"], indirect=True)
@pytest.mark.parametrize("batches", ["one-chunk", "several-chunks"])
def test_a_send_that_does_not_complete_names_the_rank_that_stopped_reading(
    ranks: tuple[list[Shuffler], set[int], threading.Event], batches: str
) -> None:
    shufflers, frozen, _ = ranks
    frozen.add(2)
    # With batch_bytes=64 every piece is its own chunk: the second chunk to
    # rank 2 waits for the first (back-pressure), the case of a large input.
    pieces = _pieces(60 if batches == "several-chunks" else 30, 6)
    assert {2, 5} & set(pieces)  # some piece goes to rank 2
    if batches == "one-chunk":
        shufflers[1]._batch_bytes = 1 << 30
    shufflers[1].timeout = 0.3
    t0 = time.monotonic()
    with pytest.raises(ShuffleTimeoutError) as info:
        shufflers[1].insert(0, pieces)
    elapsed = time.monotonic() - t0
    message = str(info.value)
    assert info.value.missing == (2,)
    assert "rank 2 (mem://2) did not take a chunk from rank 1 within 0.3 s" in message
    assert "rank 0" not in message  # a healthy peer is never blamed
    assert elapsed < 0.3 * 2 + 1  # one wait, not one per chunk


@pytest.mark.parametrize("ranks", ["waits"], indirect=True)
def test_sends_to_every_rank_that_stopped_reading_are_named(
    ranks: tuple[list[Shuffler], set[int], threading.Event],
) -> None:
    shufflers, frozen, _ = ranks
    frozen.update({0, 2})
    shufflers[1]._batch_bytes = 1 << 30
    shufflers[1].timeout = 0.3
    with pytest.raises(ShuffleTimeoutError) as info:
        shufflers[1].insert(0, _pieces(6, 6))
    assert info.value.missing == (0, 2)
    assert "rank 0 (mem://0), rank 2 (mem://2) did not take a chunk from rank 1" in str(info.value)


@pytest.mark.parametrize("ranks", ["waits"], indirect=True)
def test_a_chunk_for_the_own_rank_that_is_not_filed_blames_its_own_progress_thread(
    ranks: tuple[list[Shuffler], set[int], threading.Event],
) -> None:
    # A rank's own chunks go through its own progress thread (a tiny timeout
    # on a busy worker); the error said "rank 1 did not take a chunk from
    # rank 1 (it stopped reading)". The message the insert raises, for its
    # own rank and a peer that stopped reading:
    shufflers, _, _ = ranks
    with pytest.raises(ShuffleTimeoutError) as info:
        shufflers[1]._raise_unsent([2, 1], 0.3)
    message = str(info.value)
    assert info.value.missing == (1, 2)
    assert "rank 2 (mem://2) did not take a chunk from rank 1 within 0.3 s (it stopped reading)" in message
    assert "rank 1's own progress thread did not file a chunk for rank 1 within 0.3 s" in message
    assert "did not take a chunk from rank 1 within 0.3 s (it stopped reading)" not in message.split(";")[1]
    with pytest.raises(ShuffleTimeoutError) as info:
        shufflers[1]._raise_unsent([1], 0.3)
    assert "did not take" not in str(info.value) and info.value.missing == (1,)


def test_healthy_ranks_shuffle_exactly(ranks: tuple[list[Shuffler], set[int], threading.Event]) -> None:
    """The same group without a frozen rank: every row arrives once (the harness is sound).

    Ten inserts over three ranks: with a copying transport the inserts return
    before their chunks are taken, more than :data:`IN_FLIGHT` of them per rank.
    """
    shufflers, _, _ = ranks
    adapter = PandasAdapter()
    frame = pd.DataFrame({"k": range(300), "v": range(300)})
    for i in range(10):
        part = frame.iloc[i * 30 : (i + 1) * 30]
        shufflers[i % 3].insert(i, adapter.split(part, ["k"], 6))
    shufflers[0].barrier(6)
    rows = []
    for j in range(6):
        rows.extend(adapter.unpack(shufflers[j % 3].extract(j), frame.iloc[:0])["v"].tolist())
    assert sorted(rows) == list(range(300))
    sent = sum(s.statistics["chunks_sent"] for s in shufflers)
    assert sent >= 10 * 3 and sent == sum(s.statistics["chunks_received"] for s in shufflers)


def test_copied_sends_stay_in_flight_across_inserts_within_the_bound(
    ranks: tuple[list[Shuffler], set[int], threading.Event],
) -> None:
    """A chunk the transport copied is not waited for at the end of its insert, but counts for the next ones.

    Rank 2 stops reading. With one small chunk per destination and insert
    (far under :data:`IN_FLIGHT_BYTES`), the first :data:`IN_FLIGHT_MOST`
    inserts return (their chunks to rank 2 were copied, so their pieces are
    free); the next finds that many chunks to rank 2 still untaken and times
    out naming rank 2. A transport that reads the caller's buffers makes the
    first insert wait and time out instead.
    """
    from mpshuffle.shuffler.host import IN_FLIGHT_MOST

    returned, info = _inserts_until_rank_2_stalls(ranks, IN_FLIGHT_MOST + 1)
    copies = isinstance(ranks[0][1].comm, _CopyingGroup)
    assert returned == (IN_FLIGHT_MOST if copies else 0)
    assert info.value.missing == (2,)
    assert "rank 2 (mem://2) did not take a chunk from rank 1 within 0.3 s" in str(info.value)


def test_bytes_in_flight_hold_copied_sends_to_two_per_destination(
    ranks: tuple[list[Shuffler], set[int], threading.Event], monkeypatch: Any,
) -> None:
    """Past :data:`IN_FLIGHT_BYTES` in flight, a destination gets :data:`IN_FLIGHT` chunks, not more."""
    from mpshuffle.shuffler import host

    monkeypatch.setattr(host, "IN_FLIGHT_BYTES", 1)
    returned, info = _inserts_until_rank_2_stalls(ranks, host.IN_FLIGHT_MOST + 1)
    copies = isinstance(ranks[0][1].comm, _CopyingGroup)
    assert returned == (host.IN_FLIGHT if copies else 0)
    assert info.value.missing == (2,)


def _inserts_until_rank_2_stalls(
    ranks: tuple[list[Shuffler], set[int], threading.Event], inserts: int,
) -> tuple[int, Any]:
    """Rank 1 inserts up to ``inserts`` times while rank 2 reads nothing; how many returned, and the timeout."""
    shufflers, frozen, _ = ranks
    frozen.add(2)
    s = shufflers[1]
    s._batch_bytes = 1 << 30
    s.timeout = 0.3
    pieces = _pieces(6, 6)
    assert {2, 5} & set(pieces)
    returned = 0
    with pytest.raises(ShuffleTimeoutError) as info:
        for i in range(inserts):
            s.insert(i, _pieces(6, 6))
            returned += 1
    return returned, info


class _CountingGroup(_Group):
    """As :class:`_Group`, counting the messages each rank sends to each other rank, by kind."""

    def send_nowait(self, dest: int, tag: Tag, frames: Sequence[Any]) -> SendFuture:
        self.sent_kinds.setdefault((dest, tag[2]), 0)
        self.sent_kinds[dest, tag[2]] += 1
        return super().send_nowait(dest, tag, frames)


def _counting_ranks(nranks: int = 3) -> tuple[list[Shuffler], list[_CountingGroup], set[int], threading.Event]:
    frozen, thaw = set[int](), threading.Event()
    group: list[_Group] = []
    comms = [_CountingGroup(r, nranks, group, frozen, thaw) for r in range(nranks)]
    group.extend(comms)
    for c in comms:
        c.sent_kinds = {}
    shufflers = [Shuffler(c, 8, resource=BufferResource(), timeout=5) for c in comms]
    for c, s in zip(comms, shufflers, strict=True):
        c.register_handler("mps", s.receive)
    return shufflers, comms, frozen, thaw


def _close(shufflers: list[Shuffler], comms: list[_CountingGroup], thaw: threading.Event) -> None:
    thaw.set()
    for s in shufflers:
        s.close()
    for c in comms:
        c.close()


def test_small_chunks_are_held_and_sent_together_at_the_end_of_the_inputs() -> None:
    """Inserts of a few rows send nothing to other ranks while they run; each rank gets one message at the barrier.

    Every row still arrives exactly once, in its partition, in input order;
    the run's chunk counts are per chunk, not per message.
    """
    shufflers, comms, _, thaw = _counting_ranks()
    try:
        adapter = PandasAdapter()
        frame = pd.DataFrame({"k": range(600), "v": range(600)})
        for i in range(20):
            shufflers[i % 3].insert(i, adapter.split(frame.iloc[i * 30 : (i + 1) * 30], ["k"], 6), attempt=f"a{i}")
        # Nothing went through the communicators yet: every chunk for another
        # rank was small and is held; each rank's own went to its postbox.
        assert all(not c.sent_kinds for c in comms)
        assert all(s._held and s.postbox.resource.used(host.MemoryType.HOST) > 0 for s in shufflers)
        shufflers[0].barrier(6, accepted=[f"a{i}" for i in range(20)])
        for c in comms:
            for dest in range(3):
                if dest != c.rank:
                    assert c.sent_kinds.get((dest, "chunks")) == 1
                    assert (dest, "chunk") not in c.sent_kinds
        expected = adapter.split(frame, ["k"], 6)
        for j in range(6):
            got = adapter.unpack(shufflers[j % 3].extract(j), frame.iloc[:0])
            want = adapter.unpack([expected[j]], frame.iloc[:0]) if j in expected else frame.iloc[:0]
            assert got["v"].tolist() == want["v"].tolist()  # input order kept: inputs are row ranges in order
        sent = sum(s.statistics["chunks_sent"] for s in shufflers)
        assert sent == 20 * 3 == sum(s.statistics["chunks_received"] for s in shufflers)
        assert all(s.closed and s.postbox.resource.used(host.MemoryType.HOST) == 0 for s in shufflers)
    finally:
        _close(shufflers, comms, thaw)


def test_held_chunks_go_once_they_reach_the_release_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host, "HELD_BYTES", 4000)
    shufflers, comms, _, thaw = _counting_ranks(2)
    try:
        adapter = PandasAdapter()
        frame = pd.DataFrame({"k": range(2000), "v": range(2000)})
        for i in range(20):
            shufflers[0].insert(i, adapter.split(frame.iloc[i * 100 : (i + 1) * 100], ["k"], 4), attempt=f"a{i}")
        # ~1.6 KB for rank 1 per insert: a message every third insert or so, not one per insert.
        messages = comms[0].sent_kinds.get((1, "chunks"), 0)
        assert 3 <= messages <= 10
        assert comms[0].sent_kinds.get((1, "chunk")) is None
        shufflers[0].barrier(4, accepted=[f"a{i}" for i in range(20)])
        rows = []
        for j in range(4):
            rows.extend(adapter.unpack(shufflers[j % 2].extract(j), frame.iloc[:0])["v"].tolist())
        assert sorted(rows) == list(range(2000))
    finally:
        _close(shufflers, comms, thaw)


def test_held_chunks_for_a_rank_that_stopped_reading_fail_the_barrier_naming_it() -> None:
    shufflers, comms, frozen, thaw = _counting_ranks()
    try:
        frozen.add(2)
        adapter = PandasAdapter()
        frame = pd.DataFrame({"k": range(60), "v": range(60)})
        shufflers[1].insert(0, adapter.split(frame, ["k"], 6))  # returns: its chunk for rank 2 is held
        shufflers[0].timeout = 0.5
        with pytest.raises(ShuffleTimeoutError) as info:
            shufflers[0].barrier(6)
        assert info.value.missing == (2,)
        assert "rank 2 (mem://2)" in str(info.value)
    finally:
        _close(shufflers, comms, thaw)


def test_a_failed_run_releases_its_held_chunks() -> None:
    from mpshuffle.errors import ShuffleError

    shufflers, comms, _, thaw = _counting_ranks(2)
    try:
        s = shufflers[0]
        s.insert(0, PandasAdapter().split(pd.DataFrame({"k": range(50), "v": range(50)}), ["k"], 4))
        held = s.postbox.resource.used(host.MemoryType.HOST)
        assert s._held and held > 0
        s.fail(ShuffleError("peer lost"))
        assert not s._held
        assert s.postbox.resource.used(host.MemoryType.HOST) == 0
    finally:
        _close(shufflers, comms, thaw)


def test_large_chunks_go_as_they_are_made_this_ranks_own_through_its_progress_thread() -> None:
    """Chunks of MEDIUM_CHUNK_BYTES and more are not held, and this rank's own large one goes through the
    communicator (its progress thread files it, past the budget spills it, while the insert goes on)."""
    shufflers, comms, _, thaw = _counting_ranks(2)
    try:
        adapter = PandasAdapter()
        n = 3 * host.MEDIUM_CHUNK_BYTES // 16 * 2  # two int64 columns: ~3x MEDIUM_CHUNK_BYTES per rank
        frame = pd.DataFrame({"k": range(n), "v": range(n)})
        shufflers[0].insert(0, adapter.split(frame, ["k"], 4), attempt="a0")
        assert comms[0].sent_kinds.get((0, "chunk"), 0) >= 1 and comms[0].sent_kinds.get((1, "chunk"), 0) >= 1
        assert not shufflers[0]._held
        shufflers[0].barrier(4, accepted=["a0"])
        rows = []
        for j in range(4):
            rows.extend(adapter.unpack(shufflers[j % 2].extract(j), frame.iloc[:0])["v"].tolist())
        assert sorted(rows) == list(range(n))
    finally:
        _close(shufflers, comms, thaw)


def test_held_chunks_sent_together_count_their_bytes_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """A message of held chunks carries their bytes (``SendFuture.nbytes``), so the bound on the bytes in
    flight (``IN_FLIGHT_BYTES``) counts it; rows arrive exactly once."""
    monkeypatch.setattr(host, "HELD_MEDIUM_BYTES", 2**20)
    seen: list[tuple[int, int]] = []
    send_chunks = host.Shuffler._send_chunks

    def recorded(self: Shuffler, dest: int, held: Any) -> Any:
        nbytes = held.nbytes
        fut = send_chunks(self, dest, held)
        seen.append((nbytes, fut.nbytes))
        return fut

    monkeypatch.setattr(host.Shuffler, "_send_chunks", recorded)
    shufflers, comms, _, thaw = _counting_ranks(2)
    try:
        adapter = PandasAdapter()
        rows_each = 2 * host.SMALL_CHUNK_BYTES // 16 * 2  # 128 KiB per rank and insert: medium chunks
        frame = pd.DataFrame({"k": range(12 * rows_each), "v": range(12 * rows_each)})
        for i in range(12):
            shufflers[0].insert(i, adapter.split(frame.iloc[i * rows_each : (i + 1) * rows_each], ["k"], 4))
        shufflers[0].barrier(4)
        rows = []
        for j in range(4):
            rows.extend(adapter.unpack(shufflers[j % 2].extract(j), frame.iloc[:0])["v"].tolist())
        assert sorted(rows) == list(range(12 * rows_each))
        assert len(seen) >= 2 and all(sent == held > 0 for held, sent in seen)
    finally:
        _close(shufflers, comms, thaw)


def test_medium_chunks_are_held_apart_and_go_once_the_next_would_not_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks between SMALL_CHUNK_BYTES and MEDIUM_CHUNK_BYTES are copied into one buffer per destination,
    which goes as one message when the next chunk would not fit in it; rows arrive exactly once, in order."""
    monkeypatch.setattr(host, "HELD_MEDIUM_BYTES", 2**20)
    shufflers, comms, _, thaw = _counting_ranks(2)
    try:
        adapter = PandasAdapter()
        rows_each = 2 * host.SMALL_CHUNK_BYTES // 16 * 2  # two int64 columns: 256 KiB an insert, 128 KiB per rank
        frame = pd.DataFrame({"k": range(20 * rows_each), "v": range(20 * rows_each)})
        for i in range(20):
            part = frame.iloc[i * rows_each : (i + 1) * rows_each]
            shufflers[0].insert(i, adapter.split(part, ["k"], 4), attempt=f"a{i}")
        # ~128 KiB for rank 1 per insert into buffers of 1 MiB: 8 chunks per message (the 9th starts the
        # next buffer), and no chunk alone.
        assert comms[0].sent_kinds.get((1, "chunk")) is None
        assert comms[0].sent_kinds.get((1, "chunks")) == 2
        assert shufflers[0]._held[(1, True)].buffer is not None
        shufflers[0].barrier(4, accepted=[f"a{i}" for i in range(20)])
        assert comms[0].sent_kinds.get((1, "chunks")) == 3  # the rest at the barrier
        expected = adapter.split(frame, ["k"], 4)
        for j in range(4):
            got = adapter.unpack(shufflers[j % 2].extract(j), frame.iloc[:0])
            assert got["v"].tolist() == adapter.unpack([expected[j]], frame.iloc[:0])["v"].tolist()
        assert sum(s.statistics["chunks_received"] for s in shufflers) == sum(s.statistics["chunks_sent"] for s in shufflers)
        assert all(s.closed and s.postbox.resource.used(host.MemoryType.HOST) == 0 for s in shufflers)
    finally:
        _close(shufflers, comms, thaw)
