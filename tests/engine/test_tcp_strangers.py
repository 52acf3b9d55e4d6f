"""The tcp communicator's own deadline for every accepted connection (issue 18, fault 4).

distributed's server-side handshake read has no deadline: a stranger that
connects to a rank's port and sends nothing held a socket and a pending
handshake for as long as it liked, unlogged. Two real ranks on loopback,
over TCP and TLS; the strangers are raw sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from conftest import wait_for
from mpshuffle.comm.tcp import TcpCommunicator

_HELLO = 0.5  # seconds a connection may take to say hello, in these tests


def _security(protocol: str) -> Any:
    if protocol == "tcp":
        return None
    pytest.importorskip("cryptography", reason="Security.temporary() makes its certificates with cryptography")
    from distributed.security import Security

    return Security.temporary()


@pytest.fixture(params=["tcp", "tls"])
def ranks(request: pytest.FixtureRequest) -> Iterator[list[TcpCommunicator]]:
    protocol = request.param
    security = _security(protocol)

    async def start() -> list[TcpCommunicator]:
        kw = {"generation": "g1", "token": "secret", "security": security, "hello_timeout": _HELLO}
        root = await TcpCommunicator.start(0, 2, listen_address=f"{protocol}://127.0.0.1:0", **kw)
        other = await TcpCommunicator.start(1, 2, listen_address=f"{protocol}://127.0.0.1:0", **kw)
        await asyncio.gather(root.rendezvous(None, 10), other.rendezvous(root.addresses[0], 10))
        return [root, other]

    comms = asyncio.run(start())
    yield comms
    for c in comms:
        c.close()


def _host_port(address: str) -> tuple[str, int]:
    host, port = address.split("://", 1)[1].rsplit(":", 1)
    return host, int(port)


def _closed_by_server(s: socket.socket, within: float) -> float:
    """Seconds until the server closed ``s`` (reads what it sends on the way)."""
    t0 = time.monotonic()
    s.settimeout(within)
    while True:
        try:
            data = s.recv(65536)
        except ConnectionResetError:
            return time.monotonic() - t0
        if not data:
            return time.monotonic() - t0


def test_a_silent_stranger_is_logged_and_closed_after_the_deadline(
    ranks: list[TcpCommunicator], caplog: pytest.LogCaptureFixture
) -> None:
    root, other = ranks
    caplog.set_level(logging.WARNING, logger="mpshuffle.comm.tcp")
    host, port = _host_port(root.addresses[0])
    with socket.create_connection((host, port), timeout=5) as silent:
        waited = _closed_by_server(silent, within=_HELLO + 5)
    assert _HELLO * 0.8 <= waited < _HELLO + 3
    refusals = [r.getMessage() for r in caplog.records if "refused connection" in r.getMessage()]
    assert len(refusals) == 1 and f"no valid hello within {_HELLO:g} s" in refusals[0]
    assert root._hello_deadlines == {}  # nothing pending is left behind
    # The ranks' own connection was not disturbed.
    other.send(0, ("after",), [b"still here"], timeout=5)
    assert bytes(root.recv(1, ("after",), timeout=5)[0]) == b"still here"


def test_strangers_that_send_a_little_and_stop_are_closed_too(
    ranks: list[TcpCommunicator], caplog: pytest.LogCaptureFixture
) -> None:
    """A partial handshake frame, then silence: the same deadline, one refusal each."""
    root, _ = ranks
    caplog.set_level(logging.WARNING, logger="mpshuffle.comm.tcp")
    host, port = _host_port(root.addresses[0])
    socks = [socket.create_connection((host, port), timeout=5) for _ in range(3)]
    try:
        socks[0].sendall(b"\x10")  # the start of a length prefix
        socks[1].sendall(b"\x16\x03\x01")  # the start of a TLS record
        waited = [_closed_by_server(s, within=_HELLO + 5) for s in socks]
    finally:
        for s in socks:
            s.close()
    assert max(waited) < _HELLO + 3
    refusals = [r.getMessage() for r in caplog.records if "refused connection" in r.getMessage()]
    assert len(refusals) == 3
    assert root._hello_deadlines == {}


_HUGE = 512 << 20  # what a stranger announces: bytes


async def _push(write: Any, chunk: bytes, total: int) -> None:
    """Write ``chunk`` until ``total`` bytes went or the rank closed the connection."""
    from distributed.comm.core import CommClosedError
    from tornado.iostream import StreamClosedError

    with contextlib.suppress(OSError, CommClosedError, StreamClosedError):
        for _ in range(0, total, len(chunk)):
            await write(chunk)


def _stranger(root: TcpCommunicator, how: str, chunk: bytes, payload: Any) -> None:
    """Announce ``_HUGE`` bytes to ``root`` before any valid hello, then send data until refused.

    ``how``: ``"handshake"``, the first bytes on the socket are a length
    prefix of ``_HUGE`` (in place of distributed's handshake); ``"hello"``,
    distributed's handshake passes, then the prefix comes in place of the
    hello; ``"frame"``, a well-formed message in place of the hello whose
    second buffer (announced in its header, read apart) is ``payload``.
    Between announcements, ``chunk`` is sent over and over.
    """
    import struct

    import distributed.comm
    from distributed.protocol import to_serialize

    async def run() -> None:
        if how == "handshake":
            host, port = _host_port(root.addresses[0])
            _, writer = await asyncio.open_connection(host, port)

            async def write(data: bytes) -> None:
                writer.write(data)
                await writer.drain()

            await write(struct.pack("Q", _HUGE))
            await _push(write, chunk, 96 << 20)
            writer.close()
            return
        kwargs = root._security.get_connection_args("worker") if root._security else {}
        comm = await distributed.comm.connect(root.addresses[0], timeout=10, deserialize=False, **kwargs)
        try:
            if how == "hello":
                await comm.stream.write(struct.pack("Q", _HUGE))
                await _push(comm.stream.write, chunk, 96 << 20)
            else:
                small = np.arange(16, dtype=np.uint8)
                msg = {"op": "mpshuffle-hello", "a": to_serialize(small), "b": to_serialize(payload)}
                await _push(lambda _: comm.write(msg), b"-", 1)  # one message
        finally:
            comm.abort()

    asyncio.run(run())


@pytest.mark.parametrize("how", ["handshake", "hello", "frame"])
def test_a_stranger_announcing_a_huge_message_is_refused_before_it_is_allocated(
    ranks: list[TcpCommunicator], caplog: pytest.LogCaptureFixture, how: str
) -> None:
    """A connection not yet known may make a rank read and allocate at most a hello's worth.

    distributed.comm allocates what a message's sizes announce before its
    bytes arrive: a 512 MiB length prefix in place of the handshake grew a
    worker from 309 to 821 MiB. Now the rank refuses the connection at the
    announcement, logs it, and allocates nothing of the sort; the ranks'
    own connection (large messages included) is not disturbed.
    """
    import tracemalloc

    import psutil

    from mpshuffle.comm._read_budget import HELLO_BYTES

    root, other = ranks
    if how == "handshake" and root._security is not None:
        pytest.skip("a raw socket cannot speak TLS; the other two cases cover TLS")
    caplog.set_level(logging.WARNING, logger="mpshuffle.comm.tcp")
    chunk, payload = b"\0" * (1 << 20), np.zeros(64 << 20, dtype=np.uint8)
    rss = psutil.Process().memory_info().rss
    tracemalloc.start()
    try:
        _stranger(root, how, chunk, payload)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    grown = psutil.Process().memory_info().rss - rss
    # What Python and NumPy allocated while the stranger tried, both ends of
    # the connection counted (what it sends was made before): a hello's
    # budget and some bookkeeping (1.6 MiB seen), nothing near the announced sizes.
    assert peak < 8 << 20, peak
    assert grown < 48 << 20, grown
    # On a refused handshake distributed closes the socket before the refusal is logged.
    refusals = wait_for(
        lambda: [r.getMessage() for r in caplog.records if "refused connection" in r.getMessage()],
        "the refusal to be logged",
    )
    assert len(refusals) == 1, refusals
    assert "before a valid hello" in refusals[0] and f"at most {HELLO_BYTES} bytes" in refusals[0], refusals
    assert root._hello_deadlines == {}
    big = np.arange(1 << 20, dtype=np.int64)  # 8 MiB: raw frames on the ranks' connection
    other.send(0, ("after",), [b"still here", big], timeout=10)
    got = root.recv(1, ("after",), timeout=10)
    assert bytes(got[0]) == b"still here"
    np.testing.assert_array_equal(np.frombuffer(got[1], dtype=np.int64), big)
