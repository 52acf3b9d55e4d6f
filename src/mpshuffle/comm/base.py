"""The communicator interface: ranks, tagged multi-frame messages, barrier.

A communicator connects ``nranks`` processes, each knowing its own ``rank``
(0 .. nranks-1); rank 0 is the *root*. Messages are lists of buffers
("frames") sent to one rank under a *tag*, a tuple of small msgpack-able
values (strings and ints). A receiver either registers a *handler* for all
tags that start with a given first element (the shuffler does this: its
handler runs on the communicator's progress thread and must return quickly),
or waits for one message from one source with :meth:`Communicator.recv`.

All blocking methods may be called from any thread except the progress
thread; each has an ``a``-prefixed coroutine twin for callers on an event
loop (such as a Dask worker's), which never blocks that loop.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from mpshuffle.errors import CommError, CommTimeoutError

__all__ = ["Communicator", "Frames", "Handler", "Tag"]

logger = logging.getLogger(__name__)

Tag = tuple[Any, ...]
Frames = list[Any]
Handler = Callable[[int, Tag, Frames], None]


class Communicator(abc.ABC):
    """A group of ``nranks`` ranks that exchange tagged multi-frame messages.

    Attributes
    ----------
    rank
        This process's rank, in ``[0, nranks)``.
    nranks
        Number of ranks.
    addresses
        Address of every rank's listener, indexed by rank (empty strings for
        backends without listeners).
    """

    rank: int
    nranks: int
    addresses: list[str]
    _handlers: dict[Any, Handler]
    _mailbox: dict[tuple[int, Tag], collections.deque[Frames]]
    _waiters: dict[tuple[int, Tag], list[asyncio.Future[None]]]
    _lost: dict[int, str]
    _lock: threading.Lock

    def __init__(self, rank: int, nranks: int) -> None:
        if not 0 <= rank < nranks:
            raise ValueError(f"rank must be in [0, {nranks}), got {rank}")
        self.rank = rank
        self.nranks = nranks
        self.addresses = [""] * nranks
        self._handlers = {}
        self._mailbox = collections.defaultdict(collections.deque)
        self._waiters = collections.defaultdict(list)
        self._lost = {}
        self._lock = threading.Lock()
        self._lost_callbacks: list[Callable[[int, str], None]] = []

    # -- to be provided by a backend -------------------------------------
    @property
    @abc.abstractmethod
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop of the progress thread that runs this communicator."""

    @abc.abstractmethod
    async def _send(self, dest: int, tag: Tag, frames: Frames) -> None:
        """Deliver ``frames`` to ``dest`` (runs on :attr:`loop`)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close connections and stop the progress thread. Idempotent."""

    # -- receiving -------------------------------------------------------
    def register_handler(self, key: Any, handler: Handler) -> None:
        """Route every message whose tag starts with ``key`` to ``handler``.

        The handler is called as ``handler(src, tag, frames)`` on the progress
        thread; it must not block. Messages with no handler go to the mailbox
        read by :meth:`recv`.
        """
        self._handlers[key] = handler

    def unregister_handler(self, key: Any) -> None:
        """Stop routing tags that start with ``key``; unknown keys are ignored."""
        self._handlers.pop(key, None)

    def on_peer_lost(self, callback: Callable[[int, str], None]) -> None:
        """Call ``callback(rank, reason)`` on the progress thread when a peer is lost."""
        self._lost_callbacks.append(callback)

    def _deliver(self, src: int, tag: Tag, frames: Frames) -> None:
        """Hand an arrived message to its handler or the mailbox (on :attr:`loop`)."""
        handler = self._handlers.get(tag[0]) if tag else None
        if handler is not None:
            try:
                handler(src, tag, frames)
            except Exception:
                logger.exception("mpshuffle: handler for tag %r from rank %d failed", tag, src)
            return
        self._mailbox[(src, tag)].append(frames)
        for fut in self._waiters.pop((src, tag), []):
            if not fut.done():
                fut.set_result(None)

    def _peer_lost(self, rank: int, reason: str, *, quiet: bool = False) -> None:
        """Record that ``rank`` is gone and wake everyone waiting on it (on :attr:`loop`).

        ``quiet`` skips the warning, for a peer that said goodbye.
        """
        if rank in self._lost:
            return
        self._lost[rank] = reason
        if not quiet:
            logger.warning("mpshuffle: rank %d of %d lost: %s", rank, self.nranks, reason)
        for (src, _tag), futs in list(self._waiters.items()):
            if src == rank:
                for fut in futs:
                    if not fut.done():
                        fut.set_exception(CommError(f"rank {rank} ({self.addresses[rank]}) lost: {reason}"))
        for cb in self._lost_callbacks:
            try:
                cb(rank, reason)
            except Exception:
                logger.exception("mpshuffle: peer-lost callback failed")

    @property
    def lost(self) -> dict[int, str]:
        """Ranks known to be lost, with the reason."""
        return dict(self._lost)

    async def arecv(self, src: int, tag: Tag, timeout: float) -> Frames:
        """Wait for one message from ``src`` with ``tag`` (coroutine).

        Raises
        ------
        CommTimeoutError
            If nothing arrived within ``timeout`` seconds; names ``src``.
        CommError
            If ``src`` is lost while waiting.
        """
        return await self._run(self._recv(src, tag, timeout))

    def recv(self, src: int, tag: Tag, timeout: float) -> Frames:
        """Blocking twin of :meth:`arecv`; not callable on the progress thread."""
        return self._run_sync(self._recv(src, tag, timeout), timeout)

    async def _recv(self, src: int, tag: Tag, timeout: float) -> Frames:
        box = self._mailbox.get((src, tag))
        if not box:
            if src in self._lost:
                raise CommError(f"rank {src} ({self.addresses[src]}) lost: {self._lost[src]}")
            fut = self.loop.create_future()
            self._waiters[(src, tag)].append(fut)
            try:
                await asyncio.wait_for(fut, timeout)
            except TimeoutError:
                raise CommTimeoutError(
                    f"rank {self.rank} waited {timeout:g} s for message {tag!r} from rank "
                    f"{src} ({self.addresses[src]}), which did not arrive",
                    missing=(src,),
                ) from None
            box = self._mailbox[(src, tag)]
        frames = box.popleft()
        if not box:
            self._mailbox.pop((src, tag), None)
        return frames

    # -- sending ---------------------------------------------------------
    async def asend(self, dest: int, tag: Tag, frames: Sequence[Any]) -> None:
        """Send ``frames`` to rank ``dest`` under ``tag`` (coroutine).

        Buffers are written without copies where the transport allows; they
        must not be modified until the call returns.

        Raises
        ------
        CommError
            If ``dest`` is lost or the connection fails.
        """
        await self._run(self._send_checked(dest, tag, list(frames)))

    def send(self, dest: int, tag: Tag, frames: Sequence[Any], timeout: float | None = None) -> None:
        """Blocking twin of :meth:`asend`; not callable on the progress thread."""
        self._run_sync(self._send_checked(dest, tag, list(frames)), timeout)

    def send_nowait(self, dest: int, tag: Tag, frames: Sequence[Any]) -> asyncio.Future[None] | Any:
        """Start sending and return a :class:`concurrent.futures.Future` at once.

        Messages to the same ``dest`` started from one thread are delivered in
        the order they were started. After :meth:`close` the future holds a
        :class:`CommError` (nothing is left scheduled on a closed loop).
        """
        coro = self._send_checked(dest, tag, list(frames))
        try:
            if self.loop.is_closed():
                raise RuntimeError("event loop is closed")
            return asyncio.run_coroutine_threadsafe(coro, self.loop)
        except RuntimeError as e:  # the progress thread's loop is gone
            coro.close()
            fut: concurrent.futures.Future[None] = concurrent.futures.Future()
            fut.set_exception(CommError(
                f"rank {self.rank}: cannot send {tag!r} to rank {dest}: the communicator is closed ({e})"
            ))
            return fut

    async def _send_checked(self, dest: int, tag: Tag, frames: Frames) -> None:
        if not 0 <= dest < self.nranks:
            raise CommError(f"destination rank {dest} is not in [0, {self.nranks})")
        if dest in self._lost:
            raise CommError(f"rank {dest} ({self.addresses[dest]}) lost: {self._lost[dest]}")
        if dest == self.rank:
            self._deliver(self.rank, tag, frames)
            return
        await self._send(dest, tag, frames)

    # -- barrier ---------------------------------------------------------
    async def abarrier(self, name: Any, timeout: float) -> None:
        """Wait until every rank has called ``barrier(name)`` (coroutine).

        Every rank reports to the root; the root answers all once the last
        has arrived, or tells those that arrived which ranks did not.

        Raises
        ------
        CommTimeoutError
            If some rank did not arrive within ``timeout`` seconds; the
            message and ``missing`` name those ranks and their addresses.
        """
        await self._run(self._barrier(name, timeout))

    def barrier(self, name: Any, timeout: float) -> None:
        """Blocking twin of :meth:`abarrier`; not callable on the progress thread."""
        self._run_sync(self._barrier(name, timeout), timeout + 5)

    async def _barrier(self, name: Any, timeout: float) -> None:
        arrive, release = ("__barrier__", name, "arrive"), ("__barrier__", name, "release")
        if self.rank != 0:
            await self._send_checked(0, arrive, [])
            # Wait past the root's own timeout so that its report of who is missing arrives.
            frames = await self._recv(0, release, timeout + 5)
            if frames and frames[0]:
                missing = tuple(int(x) for x in bytes(frames[0]).decode().split(","))
                raise CommTimeoutError(self._missing_message(name, missing, timeout), missing)
            return
        arrived = {0}
        pending = {
            r: asyncio.ensure_future(self._recv(r, arrive, timeout)) for r in range(1, self.nranks)
        }
        if pending:
            await asyncio.wait(pending.values(), timeout=timeout)
        failure: BaseException | None = None
        for r, task in pending.items():
            if task.done() and task.exception() is None:
                arrived.add(r)
            elif task.done():
                failure = failure or task.exception()
            else:
                task.cancel()
        missing = tuple(r for r in range(self.nranks) if r not in arrived)
        payload = [",".join(map(str, missing)).encode()] if missing else [b""]
        for r in sorted(arrived - {0}):
            try:
                await self._send_checked(r, release, payload)
            except CommError:
                pass
        if missing:
            raise CommTimeoutError(self._missing_message(name, missing, timeout), missing)

    def _missing_message(self, name: Any, missing: tuple[int, ...], timeout: float) -> str:
        who = ", ".join(f"rank {r} ({self.addresses[r] or 'local'})" for r in missing)
        return f"barrier {name!r}: {who} did not arrive within {timeout:g} s"

    # -- running coroutines on the progress thread -----------------------
    async def _run(self, coro: Any) -> Any:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def _run_sync(self, coro: Any, timeout: float | None) -> Any:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            coro.close()
            raise RuntimeError("blocking communicator call on its own progress thread")
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(None if timeout is None else timeout + 5)
