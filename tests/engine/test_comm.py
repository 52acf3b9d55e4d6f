"""The communicator's contract with its callers, without a cluster: every call ends."""

from __future__ import annotations

import concurrent.futures
import gc
import threading
import warnings
from typing import Any

import pytest

from mpshuffle.comm import LocalCommunicator
from mpshuffle.errors import CommError


def _outcome(fut: concurrent.futures.Future[Any]) -> str:
    """``"sent"`` or ``"refused"``; a future that never ends fails the test after 5 s."""
    try:
        fut.result(timeout=5)
    except CommError as e:
        assert "closed" in str(e), e
        return "refused"
    return "sent"


@pytest.mark.parametrize("round_", range(20))
def test_a_send_racing_close_is_sent_or_refused_never_dropped(round_: int) -> None:
    """Sends started from another thread while the communicator closes.

    A send whose coroutine the progress loop never started (it stopped in
    between) used to be dropped: its future never ended and the coroutine
    was garbage-collected unawaited (``RuntimeWarning: coroutine
    'Communicator._send_checked' was never awaited``). Each must end, either
    delivered or with a ``CommError`` saying the communicator is closed.
    """
    comm = LocalCommunicator()
    got: list[Any] = []
    comm.register_handler("t", lambda src, tag, frames: got.append(tag[1]))
    futures: list[concurrent.futures.Future[Any]] = []
    started = threading.Event()
    closed = threading.Event()

    def sender() -> None:
        # Sends until one starts after close() returned, so the close lands
        # inside the stream however the threads are scheduled (with a fixed
        # count, a loaded machine could finish every send before the close).
        for i in range(1_000_000):
            after_close = closed.is_set()
            futures.append(comm.send_nowait(0, ("t", i), [b"x"]))
            if i == 50 + 40 * round_:
                started.set()
            if after_close:
                break
        started.set()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = threading.Thread(target=sender)
        t.start()
        started.wait(5)
        comm.close()
        closed.set()
        t.join(10)
        assert not t.is_alive()
        outcomes = [_outcome(f) for f in futures]
        futures.clear()
        gc.collect()
    unawaited = [w for w in caught if "never awaited" in str(w.message)]
    assert unawaited == []
    assert len(outcomes) > 50 + 40 * round_
    # Delivered messages are exactly the ones reported sent, in order.
    assert got == [i for i, o in enumerate(outcomes) if o == "sent"]
    assert "refused" in outcomes  # the close did interrupt the stream


def test_calls_after_close_fail_at_once() -> None:
    comm = LocalCommunicator()
    comm.close()
    with pytest.raises(CommError, match="closed"):
        comm.send_nowait(0, ("t",), [b"x"]).result(timeout=1)
    with pytest.raises(CommError, match="closed"):
        comm.send(0, ("t",), [b"x"], timeout=1)
    with pytest.raises(CommError, match="closed"):
        comm.recv(0, ("t",), timeout=1)
    comm.close()  # idempotent


def test_a_wait_interrupted_by_close_ends_with_comm_error() -> None:
    comm = LocalCommunicator()
    result: list[BaseException] = []
    waiting = threading.Event()

    def waiter() -> None:
        waiting.set()
        try:
            comm.recv(0, ("never",), timeout=60)
        except BaseException as e:  # noqa: BLE001 - kept for the assertion
            result.append(e)

    t = threading.Thread(target=waiter)
    t.start()
    waiting.wait(5)
    comm.close()
    t.join(10)
    assert not t.is_alive()
    assert len(result) == 1 and isinstance(result[0], CommError)


def test_sends_submitted_back_to_back_wake_the_loop_once_and_keep_their_order() -> None:
    """Work submitted while the progress loop is busy starts in order, after one wake-up.

    Each wake-up of the loop from another thread is a write to its
    self-pipe; an insert hands over one chunk per rank back to back.
    """
    comm = LocalCommunicator()
    got: list[Any] = []
    comm.register_handler("t", lambda src, tag, frames: got.append(tag[1]))
    busy, release = threading.Event(), threading.Event()
    comm.loop.call_soon_threadsafe(lambda: (busy.set(), release.wait(5)))
    assert busy.wait(5)
    wakes = 0
    real = comm.loop.call_soon_threadsafe

    def counted(*args: Any) -> Any:
        nonlocal wakes
        wakes += 1
        return real(*args)

    comm.loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
    try:
        futures = [comm.send_nowait(0, ("t", i), [b"x"]) for i in range(50)]
    finally:
        comm.loop.call_soon_threadsafe = real  # type: ignore[method-assign]
        release.set()
    assert [_outcome(f) for f in futures] == ["sent"] * 50
    assert wakes == 1
    assert got == list(range(50))
    # Once the queued work ran, the next submission wakes the loop again.
    assert _outcome(comm.send_nowait(0, ("t", 50), [b"x"])) == "sent"
    assert got == list(range(51))
    comm.close()


def test_work_queued_when_the_loop_cannot_be_woken_fails_and_is_closed() -> None:
    """A loop that closed between the check and the wake-up: every queued call ends with ``CommError``."""
    comm = LocalCommunicator()
    real = comm.loop.call_soon_threadsafe

    def closed(*args: Any) -> Any:
        raise RuntimeError("Event loop is closed")

    comm.loop.call_soon_threadsafe = closed  # type: ignore[method-assign]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # an unawaited coroutine would warn
        fut = comm.send_nowait(0, ("t", 0), [b"x"])
        assert _outcome(fut) == "refused"
        gc.collect()
    comm.loop.call_soon_threadsafe = real  # type: ignore[method-assign]
    # Nothing stays queued: the next send is woken and delivered.
    got: list[Any] = []
    comm.register_handler("t", lambda src, tag, frames: got.append(tag[1]))
    assert _outcome(comm.send_nowait(0, ("t", 1), [b"x"])) == "sent"
    assert got == [1]
    comm.close()


def test_a_start_that_fails_does_not_strand_the_work_queued_after_it() -> None:
    """Queued work starts one after another on one wake-up; a start that raises fails only its own call."""
    comm = LocalCommunicator()
    got: list[Any] = []
    comm.register_handler("t", lambda src, tag, frames: got.append(tag[1]))
    busy, release = threading.Event(), threading.Event()
    comm.loop.call_soon_threadsafe(lambda: (busy.set(), release.wait(5)))
    assert busy.wait(5)
    real = comm.loop.create_task
    calls = 0

    def once_broken(coro: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            coro.close()
            raise RuntimeError("broken")
        return real(coro)

    comm.loop.create_task = once_broken  # type: ignore[method-assign]
    try:
        futures = [comm.send_nowait(0, ("t", i), [b"x"]) for i in range(3)]
        release.set()
        with pytest.raises(CommError, match="broken"):
            futures[0].result(timeout=5)
        assert [_outcome(f) for f in futures[1:]] == ["sent", "sent"]
    finally:
        comm.loop.create_task = real  # type: ignore[method-assign]
    assert got == [1, 2]
    comm.close()


def test_packb_packs_as_msgpack_does_from_any_thread_and_after_an_error() -> None:
    import concurrent.futures

    import msgpack

    from mpshuffle.comm._pack import packb

    values = [{"input": 3, "attempt": "a1", "pieces": b"\x00\x01" * 50}, [1, 2.5, None, "x"], b"y" * 300_000]
    with pytest.raises(TypeError):
        packb({"bad": object()})
    # The packer that failed starts clean: nothing of the failed call is in the next result.
    assert [packb(v) for v in values] == [msgpack.packb(v) for v in values]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda i: packb({"i": i, "v": values[i % 3]}), range(200)))
    assert got == [msgpack.packb({"i": i, "v": values[i % 3]}) for i in range(200)]
