"""The tcp communicator between two ranks of one process: sockets and shared memory."""

from __future__ import annotations

import asyncio
import errno
import os
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from mpshuffle.comm import _shm
from mpshuffle.comm.tcp import TcpCommunicator
from mpshuffle.errors import CommError

BIG = 2 * _shm.MIN_BYTES + 3  # an odd size: the padding between frames is exercised


def _pair(
    shared_memory: tuple[bool, bool] = (True, True), generation: str = "g", security: Any = None
) -> list[TcpCommunicator]:
    proto = "tls" if security is not None else "tcp"
    # Unique per call: /dev/shm is shared with every other process (and test
    # suite) on the machine, and a closing rank removes the files of its
    # generation addressed to it.
    generation = f"{generation}-{uuid.uuid4().hex[:8]}"

    async def start(rank: int) -> TcpCommunicator:
        return await TcpCommunicator.start(
            rank, 2, generation=generation, token="secret", shared_memory=shared_memory[rank],
            listen_address=f"{proto}://127.0.0.1:0", security=security,
        )

    async def both() -> list[TcpCommunicator]:
        c0 = await start(0)
        c1 = await start(1)
        await asyncio.gather(c0.rendezvous(None, 20), c1.rendezvous(c0.addresses[0], 20))
        return [c0, c1]

    return asyncio.run(both())


class _Inbox:
    def __init__(self, comm: TcpCommunicator, gate: threading.Event | None = None) -> None:
        self.messages: list[tuple[int, Any, list[bytes]]] = []
        self.arrived = threading.Event()
        self._gate = gate
        comm.register_handler("t", self)

    def __call__(self, src: int, tag: Any, frames: list[Any]) -> None:
        if self._gate is not None:
            self._gate.wait(10)
        self.messages.append((src, tag, [bytes(f) for f in frames]))
        self.arrived.set()


def _files(generation: str) -> list[str]:
    directory = _shm.default_directory()
    return [f for f in os.listdir(directory) if f.startswith(f"mpshuffle-{generation}-")] if directory else []


@pytest.fixture
def pair() -> Iterator[list[TcpCommunicator]]:
    comms = _pair(generation="shm-pair")
    yield comms
    for c in comms:
        c.close()
    assert _files(comms[0].generation) == []


needs_shm = pytest.mark.skipif(_shm.default_directory() is None, reason="no writable /dev/shm")


@needs_shm
def test_large_messages_go_through_shared_memory_and_arrive_intact(pair: list[TcpCommunicator]) -> None:
    c0, c1 = pair
    inbox = _Inbox(c0)
    rng = np.random.default_rng(1)
    big = rng.integers(0, 255, BIG, dtype=np.uint8)
    frames = [b"head", big, b"", big[:1000]]
    c1.send_nowait(0, ("t", 1), frames).result(10)
    c1.send_nowait(0, ("t", 2), [b"small"]).result(10)  # below MIN_BYTES: the socket
    assert inbox.arrived.wait(10)
    for _ in range(100):
        if len(inbox.messages) == 2:
            break
        threading.Event().wait(0.05)
    assert inbox.messages == [
        (1, ("t", 1), [b"head", big.tobytes(), b"", big[:1000].tobytes()]),
        (1, ("t", 2), [b"small"]),
    ]
    assert 0 in c1._shm_peers and 1 in c0._shm_peers
    assert c1.bytes_sent_shared == BIG + 1004
    assert c1.bytes_sent == c1.bytes_sent_shared + len(b"small")
    assert c0.bytes_received == c1.bytes_sent
    assert _files(c0.generation) == []  # the receiver unlinked the file when it took the message


@needs_shm
def test_a_send_through_shared_memory_completes_when_the_receiver_took_it(pair: list[TcpCommunicator]) -> None:
    c0, c1 = pair
    gate = threading.Event()
    inbox = _Inbox(c0, gate)
    fut = c1.send_nowait(0, ("t", 1), [np.ones(BIG, np.uint8)])
    with pytest.raises(TimeoutError):
        fut.result(0.5)  # the receiver's handler has not returned: no acknowledgement yet
    gate.set()
    fut.result(10)
    assert inbox.messages and inbox.messages[0][2][0] == bytes(np.ones(BIG, np.uint8))


def test_without_shared_memory_on_either_side_messages_use_the_socket() -> None:
    for flags in [(True, False), (False, True), (False, False)]:
        c0, c1 = _pair(flags, generation="shm-off")
        try:
            inbox = _Inbox(c0)
            data = np.arange(BIG, dtype=np.uint8)
            c1.send_nowait(0, ("t", 1), [data]).result(10)
            assert inbox.arrived.wait(10)
            assert inbox.messages == [(1, ("t", 1), [data.tobytes()])]
            assert c1.bytes_sent_shared == 0 and c1.bytes_sent == BIG
        finally:
            c0.close()
            c1.close()
        assert _files(c0.generation) == []


@needs_shm
def test_a_full_dev_shm_falls_back_to_the_socket(pair: list[TcpCommunicator], monkeypatch: Any) -> None:
    c0, c1 = pair
    inbox = _Inbox(c0)

    def full(frames: Any, dest: int) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(c1._shm, "write_message", full)
    data = np.arange(BIG, dtype=np.uint8)
    c1.send_nowait(0, ("t", 1), [data]).result(10)
    assert inbox.arrived.wait(10)
    assert inbox.messages == [(1, ("t", 1), [data.tobytes()])]
    assert 0 not in c1._shm_peers and c1.bytes_sent_shared == 0


@needs_shm
def test_unacknowledged_files_are_removed_when_the_receiver_is_gone() -> None:
    c0, c1 = _pair(generation="shm-gone")
    gate = threading.Event()
    _Inbox(c0, gate)
    gate.set()
    c1.send_nowait(0, ("t", 1), [np.ones(BIG, np.uint8)]).result(10)
    # A file written but never announced (its receiver was lost first) is
    # removed when the sender closes.
    path, _ = c1._shm.write_message([np.ones(BIG, np.uint8)], 0)
    c0.close()
    with pytest.raises(CommError):
        c1.send_nowait(0, ("t", 2), [np.ones(BIG, np.uint8)]).result(10)
    # The receiver removed, as it closed, the file addressed to it; one
    # written after that is the sender's to remove when it closes.
    assert not os.path.exists(path)
    after, _ = c1._shm.write_message([np.ones(BIG, np.uint8)], 0)
    c1.close()
    assert not os.path.exists(after)
    assert _files(c0.generation) == []


def _die(comm: TcpCommunicator) -> None:
    """Make ``comm`` vanish as a SIGKILLed process does: sockets cut, no goodbye, no cleanup."""
    assert comm._shm is not None
    comm._shm.pending.clear()  # a dead process removes none of its files

    def cut() -> None:
        for c in [*comm._out.values(), *comm._inbound.values()]:
            c.abort()

    comm.loop.call_soon_threadsafe(cut)


@needs_shm
def test_files_of_a_killed_sender_are_removed_by_their_receiver() -> None:
    c0, c1 = _pair(generation="shm-killed")
    try:
        inbox = _Inbox(c0)
        c1.send_nowait(0, ("t", 1), [np.ones(BIG, np.uint8)]).result(10)
        assert inbox.arrived.wait(10)
        # Written, and the sender died before it named the file on the socket.
        path, _ = c1._shm.write_message([np.ones(BIG, np.uint8)], 0)
        _die(c1)
        deadline = time.monotonic() + 10
        while 1 not in c0.lost and time.monotonic() < deadline:
            time.sleep(0.01)
        assert 1 in c0.lost
        assert not os.path.exists(path)
        # One more the receiver never heard of (its sender died before the
        # receiver noticed anything): gone when the receiver closes.
        late, _ = _shm.ShmFiles(c1._shm.directory, c1._shm.prefix).write_message([b"x" * 10], 0)
        c0.close()
        assert not os.path.exists(late)
    finally:
        c0.close()
        c1.close()
    assert _files(c0.generation) == []


def test_sweep_removes_only_files_for_the_rank_and_generation(tmp_path: Any) -> None:
    directory = str(tmp_path)
    names = {
        "mpshuffle-g-r1-to0-m1-aa": True,
        "mpshuffle-g-r2-to0-probe3-bb": True,
        "mpshuffle-g-r1-to10-m1-cc": False,  # another rank
        "mpshuffle-g-r0-to1-m1-dd": False,  # written by the sweeping rank for another
        "mpshuffle-g2-r1-to0-m1-ee": False,  # another generation
        "other": False,
    }
    for name in names:
        open(os.path.join(directory, name), "wb").close()
    assert _shm.sweep(directory, "g", 0, src=2) == 1
    assert _shm.sweep(directory, "g", 0) == 1
    assert sorted(os.listdir(directory)) == sorted(n for n, gone in names.items() if not gone)
    assert _shm.sweep(str(tmp_path / "missing"), "g", 0) == 0


def test_probe_and_message_files_outside_the_directory_are_refused(tmp_path: Any) -> None:
    directory = str(tmp_path)
    files = _shm.ShmFiles(directory, "mpshuffle-x-r0")
    path, nonce = files.write_probe(1)
    assert _shm.check_probe(path, nonce, directory)
    assert not _shm.check_probe(path, "other", directory)
    assert not _shm.check_probe(path, nonce, None)
    assert not _shm.check_probe("/etc/passwd", nonce, directory)
    msg, sizes = files.write_message([b"abc", np.arange(100, dtype=np.int64)], 1)
    assert sizes == [3, 800]
    with pytest.raises(OSError, match="not in"):
        _shm.open_message(msg, sizes, "/somewhere/else")
    frames = _shm.open_message(msg, sizes, directory)
    assert bytes(frames[0]) == b"abc"
    assert np.frombuffer(frames[1], np.int64).tolist() == list(range(100))
    assert not os.path.exists(msg)  # unlinked on open; the mapping keeps the pages
    frames[1][:8] = bytes(8)  # writable, like a buffer received from a socket
    with pytest.raises(OSError):
        _shm.open_message(msg, sizes, directory)


@pytest.mark.parametrize("tls", [False, True])
def test_large_messages_on_a_socket_land_in_buffers_of_the_receivers_allocator(tls: bool) -> None:
    security = None
    if tls:
        pytest.importorskip("cryptography", reason="Security.temporary() makes its certificates with cryptography")
        from distributed.security import Security

        security = Security.temporary()
    c0, c1 = _pair((False, False), generation="raw", security=security)
    try:
        asked: list[int] = []
        blocks: list[Any] = []

        def allocate(nbytes: int) -> Any:
            asked.append(nbytes)
            block = np.full(nbytes + 64, 0xEE, dtype=np.uint8)  # poisoned: every byte must be overwritten
            blocks.append(block)
            return block[(-block.ctypes.data) % 64 :]

        c0.set_receive_allocator(allocate)
        inbox = _Inbox(c0)
        rng = np.random.default_rng(2)
        big = rng.integers(0, 255, 300_001, dtype=np.uint8)
        frames = [b"h" * 13, big, b"", big[:70_000]]
        c1.send_nowait(0, ("t", 1), frames).result(10)
        c1.send_nowait(0, ("t", 2), [b"x" * 100]).result(10)  # small: distributed.comm's own framing
        for _ in range(200):
            if len(inbox.messages) == 2:
                break
            threading.Event().wait(0.05)
        assert inbox.messages == [
            (1, ("t", 1), [b"h" * 13, big.tobytes(), b"", big[:70_000].tobytes()]),
            (1, ("t", 2), [b"x" * 100]),
        ]
        # One buffer for the whole message, each frame at a 64-byte boundary.
        assert asked == [64 + 300_032 + 0 + 70_016]
        assert c0.bytes_received == c1.bytes_sent == 13 + 300_001 + 70_000 + 100
        c0.set_receive_allocator(None)  # fresh memory again
        c1.send_nowait(0, ("t", 3), [big]).result(10)
        for _ in range(200):
            if len(inbox.messages) == 3:
                break
            threading.Event().wait(0.05)
        assert inbox.messages[2] == (1, ("t", 3), [big.tobytes()]) and len(asked) == 1
    finally:
        c0.close()
        c1.close()


def test_frames_received_from_a_socket_are_aligned_views_of_one_buffer() -> None:
    c0, c1 = _pair((False, False), generation="raw-align")
    try:
        got: list[list[Any]] = []
        done = threading.Event()

        def handler(src: int, tag: Any, frames: list[Any]) -> None:
            got.append(frames)
            done.set()

        c0.register_handler("t", handler)
        c1.send_nowait(0, ("t", 1), [b"abc", np.arange(20_000, dtype=np.int64)]).result(10)
        assert done.wait(10)
        (frames,) = got
        arrays = [np.frombuffer(f, np.uint8) for f in frames]
        assert all(a.ctypes.data % 64 == 0 for a in arrays)
        assert arrays[1].ctypes.data - arrays[0].ctypes.data == 64
        assert np.frombuffer(frames[1], np.int64).tolist() == list(range(20_000))
        assert not frames[1].readonly  # writable, as distributed.comm's buffers were
    finally:
        c0.close()
        c1.close()
