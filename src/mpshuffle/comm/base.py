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
import functools
import logging
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from mpshuffle.errors import CommError, CommTimeoutError

__all__ = ["Communicator", "Frames", "Handler", "SendFuture", "Tag"]

logger = logging.getLogger(__name__)

Tag = tuple[Any, ...]
Frames = list[Any]
Handler = Callable[[int, Tag, Frames], None]


class SendFuture(concurrent.futures.Future[None]):
    """The future of :meth:`Communicator.send_nowait`: it ends once the message is handed to the transport.

    Attributes
    ----------
    copied
        ``True`` where the transport copied the message's bytes out of the
        caller's buffers before ``send_nowait`` returned (a shared-memory
        file between ranks of one host): the caller may then reuse or drop
        its buffers at once, and the future only tells when the receiver took
        the message. ``False`` (the default) where the transport still reads
        the caller's buffers until the future ends.
    nbytes
        Bytes of data the message carries, for a sender's bound on what it
        has in flight (set by the sender; 0 where it sets none).
    """

    copied: bool = False
    nbytes: int = 0


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
        # Peers that said goodbye (closed their communicator on purpose).
        self._departed: set[int] = set()
        self._lock = threading.Lock()
        self._lost_callbacks: list[Callable[[int, str], None]] = []
        self._unsent_callbacks: list[Callable[[int, Tag], None]] = []
        # Work handed to the progress thread: coroutines not started yet (with
        # the future their caller holds) and tasks running. Closing fails or
        # cancels every one of them, so that no caller waits forever on a
        # message that will never leave and no coroutine is dropped unawaited.
        self._accepting = True
        self._unstarted: dict[concurrent.futures.Future[Any], Coroutine[Any, Any, Any]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        # Starts of submitted work waiting for the progress thread, in
        # submission order, and whether a wake-up to run them is on its way:
        # work submitted back to back (an insert's chunks, one per rank)
        # wakes the loop once, not once each (each wake-up is a write to the
        # loop's self-pipe).
        self._starts: collections.deque[tuple[concurrent.futures.Future[Any], Callable[[], None], str]] = (
            collections.deque()
        )
        self._wake_pending = False
        # How messages name each rank's process; its address unless set_peer_names gave better ones.
        self._peer_names: list[str] | None = None

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
        """Close connections and stop the progress thread. Idempotent.

        Backends stop their progress thread with :meth:`_stop_progress`.
        """

    def set_peer_names(self, names: Sequence[str]) -> None:
        """Name each rank's process in messages (e.g. ``"worker tcp://..."``) instead of its address.

        Raises
        ------
        ValueError
            If there is not one name per rank.
        """
        if len(names) != self.nranks:
            raise ValueError(f"{len(names)} names for {self.nranks} ranks")
        self._peer_names = list(names)

    def describe(self, rank: int) -> str:
        """``"rank <r> (<name>)"``: how errors name rank ``rank`` (see :meth:`set_peer_names`)."""
        if self._peer_names is not None:
            return f"rank {rank} ({self._peer_names[rank]})"
        return f"rank {rank} ({self.addresses[rank] or 'address unknown'})"

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

    def on_unsent(self, callback: Callable[[int, Tag], None]) -> None:
        """Call ``callback(dest, tag)`` when a message of :meth:`send_nowait` to ``dest`` could not be sent.

        Called from the thread that completes the send (usually the progress
        thread), after the failure was logged; it must not block.
        """
        self._unsent_callbacks.append(callback)

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

        ``quiet`` marks a peer that said goodbye (see :attr:`departed`) and
        skips the warning.
        """
        if rank in self._lost:
            return
        if quiet:
            self._departed.add(rank)
        self._lost[rank] = reason
        if not quiet:
            logger.warning("mpshuffle: rank %d of %d lost: %s", rank, self.nranks, reason)
        for (src, _tag), futs in list(self._waiters.items()):
            if src == rank:
                for fut in futs:
                    if not fut.done():
                        fut.set_exception(CommError(f"{self.describe(rank)} lost: {reason}"))
        for cb in self._lost_callbacks:
            try:
                cb(rank, reason)
            except Exception:
                logger.exception("mpshuffle: peer-lost callback failed")

    @property
    def lost(self) -> dict[int, str]:
        """Ranks known to be lost, with the reason."""
        return dict(self._lost)

    @property
    def departed(self) -> frozenset[int]:
        """The lost ranks that said goodbye: they closed their communicator on purpose, no link broke."""
        return frozenset(self._departed)

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
                raise CommError(f"{self.describe(src)} lost: {self._lost[src]}")
            fut = self.loop.create_future()
            self._waiters[(src, tag)].append(fut)
            try:
                await asyncio.wait_for(fut, timeout)
            except TimeoutError:
                raise CommTimeoutError(
                    f"rank {self.rank} waited {timeout:g} s for message {tag!r} from "
                    f"{self.describe(src)}, which did not arrive",
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

    def send_nowait(self, dest: int, tag: Tag, frames: Sequence[Any]) -> SendFuture:
        """Start sending and return a :class:`SendFuture` (a :class:`concurrent.futures.Future`) at once.

        Messages to the same ``dest`` started from one thread are delivered in
        the order they were started. The future always ends: with ``None``
        once the message is handed to the transport, or with a
        :class:`CommError` (the peer is lost, the connection broke, or the
        communicator closed before the message left). A failure that nobody
        may be waiting for is logged, so no message goes unsent silently.
        """
        fut = self._submit(self._send_checked(dest, tag, list(frames)), f"send {tag!r} to rank {dest}", SendFuture())
        fut.add_done_callback(functools.partial(self._report_unsent, dest, tag))
        return fut

    def _report_unsent(self, dest: int, tag: Tag, fut: concurrent.futures.Future[None]) -> None:
        err = None if fut.cancelled() else fut.exception()
        if err is None:
            return
        # A lost peer was reported when it was lost; a closed communicator is
        # one that its owner is shutting down on purpose.
        quiet = dest in self._lost or not self._accepting
        logger.log(
            logging.DEBUG if quiet else logging.WARNING,
            "mpshuffle: rank %d: message %r to rank %d was not sent: %s", self.rank, tag, dest, err,
        )
        for cb in self._unsent_callbacks:
            try:
                cb(dest, tag)
            except Exception:
                logger.exception("mpshuffle: unsent-message callback failed")

    async def _send_checked(self, dest: int, tag: Tag, frames: Frames) -> None:
        if not 0 <= dest < self.nranks:
            raise CommError(f"destination rank {dest} is not in [0, {self.nranks})")
        if dest in self._lost:
            raise CommError(f"{self.describe(dest)} lost: {self._lost[dest]}")
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
        who = ", ".join(self.describe(r) for r in missing)
        return f"barrier {name!r}: {who} did not arrive within {timeout:g} s"

    # -- running coroutines on the progress thread -----------------------
    def _submit(
        self, coro: Coroutine[Any, Any, Any], what: str, outer: Any = None
    ) -> Any:
        """Run ``coro`` on the progress thread; the returned future (``outer``, or a new one) always ends.

        ``what`` describes the work for the error of a closed communicator.
        Unlike :func:`asyncio.run_coroutine_threadsafe`, work that the loop
        never starts (it stopped in between) is not lost: :meth:`_stop_progress`
        fails its future and closes the coroutine.
        """
        if outer is None:
            outer = concurrent.futures.Future()
        with self._lock:
            if not self._accepting:
                coro.close()
                outer.set_exception(self._closed_error(what))
                return outer
            self._unstarted[outer] = coro

        def start() -> None:
            with self._lock:
                if self._unstarted.pop(outer, None) is None:
                    return  # failed by _stop_progress already
                accepting = self._accepting
            if not accepting:
                # Closing: the tasks to cancel were collected already, so a
                # task started now could be left pending on a stopped loop.
                coro.close()
                if not outer.done():
                    outer.set_exception(self._closed_error(what))
                return
            if not outer.set_running_or_notify_cancel():
                coro.close()
                return
            task = self.loop.create_task(coro)
            self._tasks.add(task)
            task.add_done_callback(functools.partial(self._settle, outer, what))
            outer.add_done_callback(functools.partial(self._cancel_if_cancelled, task))

        with self._lock:
            self._starts.append((outer, start, what))
            wake, self._wake_pending = not self._wake_pending, True
        if wake:
            try:
                self.loop.call_soon_threadsafe(self._run_starts)
            except RuntimeError:  # the loop is closed: nothing queued will start
                with self._lock:
                    queued, self._starts, self._wake_pending = list(self._starts), collections.deque(), False
                    dropped = [(o, self._unstarted.pop(o, None), w) for o, _, w in queued]
                for o, c, w in dropped:
                    if c is not None:
                        c.close()
                    if not o.done():  # _stop_progress may have failed it first
                        o.set_exception(self._closed_error(w))
        return outer

    def _run_starts(self) -> None:
        """On the progress thread: start, in submission order, the work queued by :meth:`_submit`."""
        with self._lock:
            queued, self._starts, self._wake_pending = self._starts, collections.deque(), False
        for outer, start, what in queued:
            # One start that fails must not strand those queued after it (each
            # had a wake-up of its own before): its caller gets the error.
            try:
                start()
            except Exception as e:  # noqa: BLE001 - handed to the caller's future
                logger.warning("mpshuffle: rank %d: could not %s: %s", self.rank, what, e)
                if not outer.done():
                    outer.set_exception(CommError(f"rank {self.rank}: cannot {what}: {e}"))

    def _cancel_if_cancelled(self, task: asyncio.Task[Any], outer: concurrent.futures.Future[Any]) -> None:
        # The caller gave up (an awaiting task was cancelled): so does the work.
        if outer.cancelled() and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(task.cancel)

    def _settle(self, outer: concurrent.futures.Future[Any], what: str, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if outer.done():
            return
        if task.cancelled():
            outer.set_exception(self._closed_error(what))
        elif task.exception() is not None:
            outer.set_exception(task.exception())  # type: ignore[arg-type]
        else:
            outer.set_result(task.result())

    def _closed_error(self, what: str) -> CommError:
        return CommError(f"rank {self.rank}: cannot {what}: the communicator is closed")

    def _stop_progress(
        self,
        thread: threading.Thread,
        aclose: Callable[[], Coroutine[Any, Any, None]] | None = None,
        timeout: float = 10,
    ) -> None:
        """Stop the progress thread: every submitted call ends, none is dropped.

        Refuses new work, runs ``aclose`` (the backend's goodbyes) on the
        loop, cancels the tasks still running (their callers get a
        :class:`CommError`), stops the loop and fails whatever was submitted
        but never started. Call from any thread but the progress thread.
        """
        loop = self.loop
        if loop.is_closed():
            return
        with self._lock:
            self._accepting = False

        async def finish() -> None:
            if aclose is not None:
                try:
                    await aclose()
                except Exception:  # closing goes on regardless
                    logger.debug("mpshuffle: error while closing communicator", exc_info=True)
            current = asyncio.current_task()
            running = [t for t in self._tasks if t is not current and not t.done()]
            for t in running:
                t.cancel()
            await asyncio.gather(*running, return_exceptions=True)

        if loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(finish(), loop).result(timeout)
            except Exception:  # a stuck loop: stop it anyway
                logger.debug("mpshuffle: communicator did not close cleanly", exc_info=True)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=timeout)
        with self._lock:
            left, self._unstarted = self._unstarted, {}
        for outer, coro in left.items():
            coro.close()
            if not outer.done():
                outer.set_exception(self._closed_error("run a call submitted while it closed"))
        if not thread.is_alive():
            loop.close()

    async def _run(self, coro: Any) -> Any:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            return await coro
        return await asyncio.wrap_future(self._submit(coro, "run a call"))

    def _run_sync(self, coro: Any, timeout: float | None) -> Any:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            coro.close()
            raise RuntimeError("blocking communicator call on its own progress thread")
        fut = self._submit(coro, "run a call")
        return fut.result(None if timeout is None else timeout + 5)
