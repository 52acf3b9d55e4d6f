"""The tcp communicator's own deadline for every accepted connection (issue 18, fault 4).

distributed's server-side handshake read has no deadline: a stranger that
connects to a rank's port and sends nothing held a socket and a pending
handshake for as long as it liked, unlogged. Two real ranks on loopback,
over TCP and TLS; the strangers are raw sockets.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from mpshuffle.comm.tcp import TcpCommunicator

_HELLO = 0.5  # seconds a connection may take to say hello, in these tests


def _security(protocol: str) -> Any:
    if protocol == "tcp":
        return None
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
