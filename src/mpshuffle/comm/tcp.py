"""The ``tcp`` communicator, built on :mod:`distributed.comm`.

Each rank listens on its own port (``tcp://`` or ``tls://``, like the Dask
cluster it runs in, with the cluster's credentials) and runs its sockets on
its own *progress thread* with its own event loop, never on the Dask worker's
event loop. A message to a peer goes over one outgoing connection per peer.
Small messages are passed to :mod:`distributed.comm` as ``Serialized``
sub-frames; a message of at least :data:`RAW_BYTES` is announced by a small
header and its frames follow on the same stream unchanged, so that the
receiver reads them into one buffer from its allocator (the worker's
:class:`~mpshuffle.memory.pool.HostPool`) instead of fresh memory per frame.

Every connection starts with a *hello* carrying the generation id, a secret
token handed out with the bootstrap, and the sender's rank and listening
address. A connection whose hello does not match (a process that is not a
rank of this generation, garbage on the port) is logged and closed; the
ranks' own connections are not disturbed. A rank that accepts a hello answers
with a *welcome*. Every accepted connection has a deadline of its own
(``hello_timeout``) for the TLS handshake, distributed's handshake and the
hello together: a stranger that connects and sends nothing is logged and
closed when it passes. Until then a connection may also make the rank read
at most :data:`~mpshuffle.comm._read_budget.HELLO_BYTES` (see
:mod:`mpshuffle.comm._read_budget`): one that announces a larger message is
logged and closed before anything is allocated for it.

Ranks of one host exchange large messages through shared memory
(:mod:`mpshuffle.comm._shm`): the hello names a probe file in ``/dev/shm``,
and the welcome says whether the accepting rank could read it. If so, a
message of at least :data:`~mpshuffle.comm._shm.MIN_BYTES` sent with
:meth:`TcpCommunicator.send_nowait` is written into a file by the *calling*
thread and only its name crosses the socket; the receiver maps the file and
acknowledges once its handler has taken the message, and the send completes
only then, so a receiver that is busy (spilling) holds its senders back as the
socket does. Everything else, and every pair of ranks on different hosts,
goes over TCP (or TLS) as before.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import json
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import distributed.comm
import numpy as np
from distributed.comm.addressing import parse_address, parse_host_port
from distributed.comm.core import CommClosedError
from distributed.protocol.serialize import Serialized
from tornado.iostream import StreamClosedError

from mpshuffle.comm import _shm
from mpshuffle.comm._read_budget import ReadBudget
from mpshuffle.comm.base import Communicator, Frames, SendFuture, Tag
from mpshuffle.errors import CommError, CommTimeoutError

__all__ = ["TcpCommunicator"]

logger = logging.getLogger(__name__)

# Wait for the socket to drain after writing messages at least this large, so
# that a sender cannot queue unbounded data in the transport's buffer.
_DRAIN_BYTES = 1 << 20

#: Messages of at least this many bytes cross a socket as *raw* frames: a
#: small header through distributed.comm, then the frames themselves, each
#: padded to 64 bytes, read by the receiver into one buffer of its own
#: choosing (see :meth:`TcpCommunicator.set_receive_allocator`).
RAW_BYTES = 64 * 1024

# Reads and writes on the stream go in pieces of at most this many bytes
# (sockets take at most a C int per call).
_IO_PIECE = 1 << 30

Allocator = Callable[[int], Any]


def _aligned_empty(nbytes: int) -> Any:
    raw = np.empty(nbytes + _shm.ALIGNMENT, dtype=np.uint8)
    start = (-raw.ctypes.data) % _shm.ALIGNMENT
    return raw[start : start + nbytes]


def _layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Offsets of frames of ``sizes`` bytes laid out at 64-byte boundaries, and the total."""
    offsets = []
    total = 0
    for n in sizes:
        offsets.append(total)
        total += n + (-n % _shm.ALIGNMENT)
    return offsets, total


class _ShmMessage:
    """A message already written to a shared-memory file, waiting to be announced."""

    __slots__ = ("nbytes", "path", "sizes")

    def __init__(self, path: str, sizes: list[int], nbytes: int) -> None:
        self.path = path
        self.sizes = sizes
        self.nbytes = nbytes


class TcpCommunicator(Communicator):
    """A rank of a communicator over :mod:`distributed.comm` (TCP or TLS).

    Create with :meth:`start`, then join the others with :meth:`rendezvous`.

    Parameters
    ----------
    rank, nranks
        This rank and the number of ranks.
    generation
        Id of the generation; peers presenting another id are refused.
    token
        Shared secret of the generation; peers presenting another are refused.
    security
        A :class:`distributed.security.Security` (the cluster's), or ``None``.
    shared_memory
        Exchange large messages with ranks of the same host through
        ``/dev/shm`` (see the module docstring); ``False`` keeps every
        message on the socket.
    hello_timeout
        Seconds an accepted connection may take to present a valid hello
        (TLS and distributed's handshakes included) before it is closed.

    Attributes
    ----------
    bytes_sent, bytes_received
        Frame bytes sent to and received from other ranks so far.
    bytes_sent_shared
        The part of ``bytes_sent`` that went through shared memory.
    """

    generation: str
    _token: str
    _listener: Any
    _out: dict[int, Any]
    _inbound: dict[int, Any]
    _connect_locks: dict[int, asyncio.Lock]
    _write_locks: dict[int, asyncio.Lock]
    _shm: _shm.ShmFiles | None
    _shm_dir: str | None
    _shm_peers: set[int]
    _acks: dict[int, collections.deque[tuple[asyncio.Future[None], str]]]

    def __init__(
        self, rank: int, nranks: int, *, generation: str, token: str, security: Any = None,
        shared_memory: bool = True,
        hello_timeout: float = 30.0,
    ) -> None:
        super().__init__(rank, nranks)
        self.generation = generation
        self._token = token
        self._security = security
        self._hello_timeout = hello_timeout
        # Accepted connections (by the peer's host and port) that have not
        # presented a valid hello yet: the timer that closes each, and its
        # stream. Expired ones are remembered a while, so that the handshake
        # that fails because of it is not reported twice.
        self._hello_deadlines: dict[tuple[str, int], tuple[asyncio.TimerHandle, Any]] = {}
        self._expired: set[tuple[str, int]] = set()
        self._listener = None
        self._out = {}
        self._inbound = {}
        self._connect_locks = {}
        self._write_locks = {}
        self._shm_dir = _shm.default_directory() if shared_memory else None
        self._shm = _shm.ShmFiles(self._shm_dir, f"mpshuffle-{generation}-r{rank}") if self._shm_dir else None
        self._shm_peers = set()
        self._acks = collections.defaultdict(collections.deque)
        self._readers: dict[int, asyncio.Task[None]] = {}
        self._allocate: Allocator = _aligned_empty
        self._closing = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"mpshuffle-progress-{generation}-r{rank}", daemon=True
        )
        self._thread.start()
        self.bytes_sent = 0
        self.bytes_sent_shared = 0
        self.bytes_received = 0

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def set_receive_allocator(self, allocate: Allocator | None) -> None:
        """Receive large messages from sockets into buffers from ``allocate(nbytes)``.

        ``allocate`` is called on the progress thread and returns a writable
        buffer of at least ``nbytes`` bytes (e.g.
        :meth:`mpshuffle.memory.pool.HostPool.allocate`, whose blocks come
        back when the last frame viewing them is gone, so that memory freed by
        sent chunks and extracted partitions is received into again instead
        of fresh pages). ``None`` restores fresh 64-byte aligned memory per
        message.
        """
        self._allocate = allocate if allocate is not None else _aligned_empty

    @classmethod
    async def start(
        cls,
        rank: int,
        nranks: int,
        *,
        generation: str,
        token: str,
        listen_address: str | Sequence[str] = "tcp://127.0.0.1:0",
        security: Any = None,
        shared_memory: bool = True,
        hello_timeout: float = 30.0,
    ) -> TcpCommunicator:
        """Create a rank and start listening (coroutine; does not block the caller's loop).

        Parameters
        ----------
        listen_address
            Where to listen, e.g. ``"tcp://10.0.0.5:0"`` or ``"tls://host:0"``
            (port 0 picks a free one), or several such addresses tried in
            order until one can be bound (a range of ports).
        shared_memory
            See the class.

        Returns
        -------
        TcpCommunicator
            The rank, with ``addresses[rank]`` set to its contact address.

        Raises
        ------
        OSError
            If no address of ``listen_address`` could be bound (naming the
            last one tried and why).
        """
        self = cls(
            rank, nranks, generation=generation, token=token, security=security,
            shared_memory=shared_memory, hello_timeout=hello_timeout,
        )
        try:
            await self._run(self._listen(listen_address))
        except BaseException:
            self.close()
            raise
        return self

    async def _listen(self, address: str | Sequence[str]) -> None:
        kwargs = self._security.get_listen_args("worker") if self._security else {}
        candidates = [address] if isinstance(address, str) else list(address)
        for i, candidate in enumerate(candidates):
            try:
                self._listener = await distributed.comm.listen(
                    candidate, self._handle_comm, deserialize=False, **kwargs
                )
                break
            except OSError as e:  # in use: the next port of the range
                if i + 1 == len(candidates):
                    what = candidate if len(candidates) == 1 else f"any of {candidates[0]} .. {candidate}"
                    raise OSError(e.errno, f"cannot listen on {what}: {e.strerror or e}") from None
        self._listener.on_connection = self._guarded_handshake(self._listener.on_connection)
        server = getattr(self._listener, "tcp_server", None)
        if server is not None:
            server.handle_stream = self._with_deadline(server.handle_stream)
        self.addresses[self.rank] = self._listener.contact_address

    def _with_deadline(self, handle_stream: Any) -> Any:
        """Give every accepted stream ``hello_timeout`` seconds and a few bytes to present a valid hello.

        Set where the server hands over a new stream, before any handshake:
        distributed's handshake read (and TLS's) has no deadline, so a
        stranger that sends nothing would otherwise hold a socket forever;
        and distributed allocates what a message announces, so a stranger
        announcing gigabytes would make this rank allocate them
        (:class:`~mpshuffle.comm._read_budget.ReadBudget`, removed once the
        hello is accepted).
        """

        def handle(stream: Any, address: Any) -> Any:
            key = (str(address[0]), int(address[1]))
            timer = self.loop.call_later(self._hello_timeout, self._expire, key)
            self._hello_deadlines[key] = (timer, stream)
            # Nor may it make this rank allocate more than a hello needs.
            ReadBudget(stream)
            return handle_stream(stream, address)

        return handle

    def _expire(self, key: tuple[str, int]) -> None:
        entry = self._hello_deadlines.pop(key, None)
        if entry is None or entry[1].closed():
            return
        self._expired.add(key)
        self.loop.call_later(self._hello_timeout + 5, self._expired.discard, key)
        logger.warning(
            "mpshuffle: refused connection from %s:%d to rank %d of generation %s: no valid hello "
            "within %g s",
            *key, self.rank, self.generation, self._hello_timeout,
        )
        entry[1].close()

    def _hello_done(self, comm: Any) -> bool:
        """Stop the deadline of ``comm``'s connection; ``False`` if it had expired (and was reported)."""
        try:
            host, port = parse_host_port(parse_address(comm.peer_address)[1])
        except (ValueError, TypeError):
            return True  # not a TCP peer: no deadline was set
        key = (host, int(port))
        entry = self._hello_deadlines.pop(key, None)
        if entry is not None:
            entry[0].cancel()
            return True
        return key not in self._expired

    # -- bootstrap -------------------------------------------------------
    async def rendezvous(self, root_address: str | None, timeout: float) -> None:
        """Learn every rank's address through the root, then meet at a barrier (coroutine).

        Rank 0 waits for a hello from every other rank and sends each the full
        address table; the others connect to ``root_address``.

        Raises
        ------
        CommTimeoutError
            If some rank did not arrive within ``timeout``; names those ranks.
        """
        await self._run(self._rendezvous(root_address, timeout))

    async def _rendezvous(self, root_address: str | None, timeout: float) -> None:
        table = ("__addresses__",)
        if self.rank == 0:
            waits = {r: asyncio.ensure_future(self._recv(r, ("__hello__",), timeout)) for r in range(1, self.nranks)}
            try:
                if waits:
                    await asyncio.wait(waits.values(), timeout=timeout)
                missing = tuple(r for r, t in waits.items() if not t.done() or t.exception() is not None)
            finally:
                # Also when the bootstrap is given up (closed) while they wait.
                for t in waits.values():
                    t.cancel()
            if missing:
                raise CommTimeoutError(
                    f"bootstrap of generation {self.generation}: rank(s) "
                    f"{', '.join(map(str, missing))} did not reach the root "
                    f"({self.addresses[0]}) within {timeout:g} s",
                    missing,
                )
            payload = [json.dumps(self.addresses).encode()]
            await asyncio.gather(*(self._send_checked(r, table, payload) for r in range(1, self.nranks)))
        else:
            if not root_address:
                raise CommError("rendezvous of a non-root rank needs the root's address")
            self.addresses[0] = root_address
            await self._connection(0, timeout)
            frames = await self._recv(0, table, timeout)
            addresses = json.loads(bytes(frames[0]))
            mine = self.addresses[self.rank]
            self.addresses = list(addresses)
            self.addresses[self.rank] = mine
        await self._barrier(("bootstrap", self.generation), timeout)

    # -- connections -----------------------------------------------------
    async def _connection(self, dest: int, timeout: float = 30) -> Any:
        comm = self._out.get(dest)
        if comm is not None and not comm.closed():
            return comm
        lock = self._connect_locks.setdefault(dest, asyncio.Lock())
        async with lock:
            comm = self._out.get(dest)
            if comm is not None and not comm.closed():
                return comm
            address = self.addresses[dest]
            if not address:
                raise CommError(f"rank {self.rank} does not know the address of rank {dest}")
            kwargs = self._security.get_connection_args("worker") if self._security else {}
            hello = {
                "op": "mpshuffle-hello",
                "generation": self.generation,
                "token": self._token,
                "rank": self.rank,
                "address": self.addresses[self.rank],
            }
            probe = self._write_probe(dest)
            if probe is not None:
                hello["shm"], hello["nonce"] = probe
            try:
                comm = await distributed.comm.connect(address, timeout=timeout, deserialize=False, **kwargs)
                await comm.write(hello)
                welcome = await asyncio.wait_for(comm.read(), timeout)
            except (OSError, CommClosedError, TimeoutError) as e:
                raise CommError(f"rank {self.rank} could not connect to {self.describe(dest)}: {e!r}") from e
            finally:
                if probe is not None:
                    _shm.remove_file(probe[0])
            if isinstance(welcome, dict) and welcome.get("shm") and self._shm is not None:
                self._shm_peers.add(dest)
            else:
                self._shm_peers.discard(dest)
            self._out[dest] = comm
            self._readers[dest] = asyncio.ensure_future(self._read_acks(dest, comm))
            return comm

    def _write_probe(self, dest: int) -> tuple[str, str] | None:
        if self._shm is None:
            return None
        try:
            return self._shm.write_probe(dest)
        except OSError as e:
            logger.info("mpshuffle: rank %d sends no shared memory (probe failed: %s)", self.rank, e)
            self._shm = None
            return None

    async def _read_acks(self, dest: int, comm: Any) -> None:
        """Complete the sends through shared memory that ``dest`` acknowledged, in order."""
        try:
            while True:
                msg = await comm.read()
                pending = self._acks.get(dest)
                if isinstance(msg, dict) and msg.get("op") == "ack" and pending:
                    fut, path = pending.popleft()
                    if self._shm is not None:
                        self._shm.acknowledged(path)
                    if not fut.done():
                        fut.set_result(None)
        except Exception as e:  # noqa: BLE001 - a closed or broken connection: fail what waits on it
            self._fail_acks(dest, CommError(f"rank {self.rank} lost {self.describe(dest)}: {e!r}"))

    def _fail_acks(self, dest: int, error: BaseException) -> None:
        pending = self._acks.pop(dest, None)
        while pending:
            fut, path = pending.popleft()
            # The connection is gone, so ``dest`` will never open this file
            # (if it did, it has unlinked it already).
            self._drop_file(path)
            if not fut.done():
                fut.set_exception(error)

    def _peer_lost(self, rank: int, reason: str, *, quiet: bool = False) -> None:
        if rank not in self._lost and self._shm_dir is not None:
            # Files ``rank`` wrote for this rank and never named on the
            # socket (it died with them in flight) would stay in memory.
            # Removed before the loss is recorded, so whoever sees the loss
            # sees them gone.
            _shm.sweep(self._shm_dir, self.generation, self.rank, rank)
        super()._peer_lost(rank, reason, quiet=quiet)

    def _guarded_handshake(self, on_connection: Any) -> Any:
        """Wrap the listener's handshake so that a stranger's failed one is logged as a refusal.

        distributed.comm reads a handshake before our handler sees the
        connection; garbage fails there and would only be logged at INFO.
        """

        async def handshake(comm: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return await on_connection(comm, *args, **kwargs)
            except Exception as e:
                if not self._hello_done(comm):
                    raise  # closed by its deadline, reported there
                logger.warning(
                    "mpshuffle: refused connection from %s to rank %d of generation %s: "
                    "no valid handshake (%s)",
                    getattr(comm, "peer_address", "?"), self.rank, self.generation, e.__cause__ or e,
                )
                raise

        return handshake

    async def _handle_comm(self, comm: Any) -> None:
        peer = comm.peer_address
        try:
            hello = await comm.read()  # the stream's deadline ends a silent stranger
        except Exception as e:  # noqa: BLE001 - garbage, a closed socket, a slow stranger
            if self._hello_done(comm):
                logger.warning("mpshuffle: refused connection from %s: no valid hello (%s)", peer, e)
            comm.abort()
            return
        if not self._hello_done(comm):
            comm.abort()
            return
        src = self._check_hello(hello)
        if src is None:
            logger.warning("mpshuffle: refused connection from %s: not a rank of generation %s", peer, self.generation)
            comm.abort()
            return
        stream = getattr(comm, "stream", None)  # inproc:// comms (processes=False clusters) have none
        if stream is not None:
            ReadBudget.remove(stream)  # a rank of the generation: its messages are chunks
        shm = _shm.check_probe(hello.get("shm"), hello.get("nonce"), self._shm_dir)
        try:
            await comm.write({"op": "mpshuffle-welcome", "shm": shm})
        except (CommClosedError, OSError) as e:
            logger.warning("mpshuffle: rank %d hung up during the handshake (%s)", src, e)
            comm.abort()
            return
        self._inbound[src] = comm
        if hello.get("address"):
            if not self.addresses[src]:
                self.addresses[src] = hello["address"]
            self._deliver(src, ("__hello__",), [hello["address"]])
        try:
            while True:
                msg = await comm.read()
                tag = tuple(msg["tag"])
                if tag == ("__bye__",):
                    # A peer that closes its communicator is gone for any run still using it.
                    self._departed.add(src)
                    self._peer_lost(src, "it closed its communicator", quiet=True)
                    continue
                path = msg.get("shm")
                if path is not None:
                    frames = _shm.open_message(path, msg["sizes"], self._shm_dir)
                    self.bytes_received += sum(msg["sizes"])
                    self._deliver(src, tag, frames)
                    # Only now may the sender send its next chunk (back-pressure).
                    await comm.write({"op": "ack"})
                    continue
                sizes = msg.get("raw")
                if sizes is not None:
                    frames = await self._read_raw(comm, sizes)
                else:
                    payload = msg.get("frames")
                    frames = list(payload.frames) if isinstance(payload, Serialized) else []
                self.bytes_received += sum(memoryview(f).nbytes for f in frames)
                self._deliver(src, tag, frames)
        except (CommClosedError, StreamClosedError, OSError) as e:
            if not self._closing and src not in self._departed:
                self._peer_lost(src, f"connection from {peer} closed ({e})")
        except Exception:
            logger.exception("mpshuffle: connection from rank %d (%s) failed", src, peer)
            if not self._closing:
                self._peer_lost(src, f"connection from {peer} failed")
        finally:
            comm.abort()

    async def _read_raw(self, comm: Any, sizes: Sequence[int]) -> list[memoryview]:
        """Read the raw frames announced with ``sizes`` into one buffer from the allocator."""
        offsets, total = _layout(sizes)
        if not total:
            return [memoryview(b"") for _ in sizes]
        view = np.frombuffer(self._allocate(total), dtype=np.uint8)[:total].data
        stream = comm.stream
        if stream is None:
            raise CommClosedError("the connection closed while a message arrived")
        for start in range(0, total, _IO_PIECE):
            await stream.read_into(view[start : start + _IO_PIECE])
        return [view[o : o + n] for o, n in zip(offsets, sizes, strict=True)]

    def _check_hello(self, hello: Any) -> int | None:
        if not isinstance(hello, dict) or hello.get("op") != "mpshuffle-hello":
            return None
        if hello.get("generation") != self.generation:
            return None
        token = hello.get("token")
        if not isinstance(token, str) or not hmac.compare_digest(token, self._token):
            return None
        rank = hello.get("rank")
        if not isinstance(rank, int) or not 0 <= rank < self.nranks or rank == self.rank:
            return None
        return rank

    def send_nowait(self, dest: int, tag: Tag, frames: Sequence[Any]) -> SendFuture:
        """Start sending, as :meth:`Communicator.send_nowait`.

        To a rank of the same host (and at least
        :data:`~mpshuffle.comm._shm.MIN_BYTES`), the frames are first written
        to a shared-memory file in the calling thread; the returned future
        completes once the receiver has taken the message. If writing the
        file fails (``/dev/shm`` full), this and later messages to ``dest``
        go over the socket. The returned future's ``copied`` says whether the
        frames went into such a file (see :class:`~mpshuffle.comm.base.SendFuture`).
        """
        frames = list(frames)
        files = self._shm
        copied = False
        if files is not None and dest in self._shm_peers and dest not in self._lost:
            nbytes = sum(memoryview(f).nbytes for f in frames)
            if nbytes >= _shm.MIN_BYTES:
                try:
                    path, sizes = files.write_message(frames, dest)
                except OSError as e:
                    logger.warning(
                        "mpshuffle: rank %d sends to rank %d over TCP from now on: writing to %s failed (%s)",
                        self.rank, dest, files.directory, e,
                    )
                    self._shm_peers.discard(dest)
                else:
                    frames = [_ShmMessage(path, sizes, nbytes)]
                    copied = True
        fut = super().send_nowait(dest, tag, frames)
        fut.copied = copied
        return fut

    async def _send(self, dest: int, tag: Tag, frames: Frames) -> None:
        if len(frames) == 1 and isinstance(frames[0], _ShmMessage):
            await self._send_shm(dest, tag, frames[0])
            return
        comm = await self._connection(dest)
        lock = self._write_locks.setdefault(dest, asyncio.Lock())
        nbytes = sum(memoryview(f).nbytes for f in frames)
        async with lock:
            try:
                stream = getattr(comm, "stream", None)
                if nbytes >= RAW_BYTES and stream is not None:
                    await self._write_raw(comm, stream, tag, frames)
                else:
                    await comm.write({"tag": list(tag), "frames": Serialized({}, frames)})
                if nbytes >= _DRAIN_BYTES and stream is not None:
                    # Tornado resolves an empty write once everything before it is on the wire.
                    await stream.write(b"")
            except (CommClosedError, StreamClosedError, OSError) as e:
                self._out.pop(dest, None)
                self._peer_lost(dest, f"sending to {self.addresses[dest]} failed ({e})")
                raise CommError(f"rank {self.rank} lost {self.describe(dest)}: {e}") from e
        self.bytes_sent += nbytes

    @staticmethod
    async def _write_raw(comm: Any, stream: Any, tag: Tag, frames: Frames) -> None:
        views = [memoryview(f).cast("B") for f in frames]
        await comm.write({"tag": list(tag), "raw": [v.nbytes for v in views]})
        # Queued behind the header on the same stream, in order; the buffers
        # are not copied (tornado keeps large ones as views).
        last = None
        for v in views:
            for start in range(0, v.nbytes, _IO_PIECE):
                last = stream.write(v[start : start + _IO_PIECE])
            pad = -v.nbytes % _shm.ALIGNMENT
            if pad:
                last = stream.write(bytes(pad))
        if last is not None:
            # Resolves once these frames are in the kernel's socket buffer.
            await last

    async def _send_shm(self, dest: int, tag: Tag, message: _ShmMessage) -> None:
        try:
            comm = await self._connection(dest)
        except BaseException:
            self._drop_file(message.path)
            raise
        lock = self._write_locks.setdefault(dest, asyncio.Lock())
        ack: asyncio.Future[None] = self.loop.create_future()
        async with lock:
            try:
                await comm.write({"tag": list(tag), "shm": message.path, "sizes": message.sizes})
            except (CommClosedError, OSError) as e:
                self._drop_file(message.path)
                self._out.pop(dest, None)
                self._peer_lost(dest, f"sending to {self.addresses[dest]} failed ({e})")
                raise CommError(f"rank {self.rank} lost {self.describe(dest)}: {e}") from e
            # Appended under the lock, so acknowledgements match in write order.
            self._acks[dest].append((ack, message.path))
        await ack
        self.bytes_sent += message.nbytes
        self.bytes_sent_shared += message.nbytes

    def _drop_file(self, path: str) -> None:
        _shm.remove_file(path)
        if self._shm is not None:
            self._shm.acknowledged(path)

    # -- shutdown --------------------------------------------------------
    async def _aclose(self) -> None:
        self._closing = True
        for dest, comm in list(self._out.items()):
            try:
                if not comm.closed():
                    await asyncio.wait_for(comm.write({"tag": ["__bye__"]}), 2)
                    await comm.close()
            except Exception:  # noqa: BLE001 - a peer already gone: drop the connection
                comm.abort()
        self._out.clear()
        for task in self._readers.values():
            task.cancel()
        self._readers.clear()
        for dest in list(self._acks):
            self._fail_acks(dest, CommError(f"rank {self.rank}: the communicator is closed"))
        if self._shm is not None:
            self._shm.remove_pending()
        for timer, stream in list(self._hello_deadlines.values()):
            timer.cancel()
            stream.close()
        self._hello_deadlines.clear()
        if self._shm_dir is not None:
            # Files of this generation still addressed to this rank: no one will open them now.
            _shm.sweep(self._shm_dir, self.generation, self.rank)
        if self._listener is not None:
            self._listener.stop()
        for comm in list(self._inbound.values()):
            comm.abort()
        self._inbound.clear()

    def close(self) -> None:
        """Say goodbye to the peers, close every socket and stop the progress thread.

        Idempotent; safe to call from any thread other than the progress thread.
        """
        if threading.current_thread() is not self._thread:
            self._stop_progress(self._thread, self._aclose)
