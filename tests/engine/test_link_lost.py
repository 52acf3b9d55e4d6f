"""A rank's context that loses a peer to a broken link says which runs can no longer complete (issue 18).

``WorkerContext.on_link_lost(peer, reason, op_ids)`` is how the Dask worker
plugin learns what to report to the scheduler: the runs active at the loss,
each run made after it, each run whose message to the peer could not leave.
A peer that said goodbye is no broken link: nothing is reported. The
communicator here is one rank of two whose peer is lost by the test
(``_peer_lost``, as the tcp backend does when a connection breaks).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

from conftest import wait_for
from mpshuffle.comm.base import Communicator, Frames, Tag
from mpshuffle.comm.local import LocalCommunicator
from mpshuffle.errors import ShuffleError
from mpshuffle.options import Options
from mpshuffle.shuffler.context import WorkerContext


class _OneOfTwo(LocalCommunicator):
    """Rank 0 of two ranks in this process; rank 1 is never reached (every send to it waits to be lost)."""

    def __init__(self) -> None:
        Communicator.__init__(self, 0, 2)  # a LocalCommunicator's thread, not its single rank
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="test-one-of-two", daemon=True)
        self._thread.start()
        self.addresses = ["mem://0", "mem://1"]

    async def _send(self, dest: int, tag: Tag, frames: Frames) -> None:
        self._deliver(dest, tag, frames)

    def lose(self, rank: int, reason: str, *, goodbye: bool = False) -> None:
        """Lose ``rank`` on the progress thread, as the tcp backend does; returns once done."""
        done = threading.Event()

        def lose() -> None:
            self._peer_lost(rank, reason, quiet=goodbye)
            done.set()

        self.loop.call_soon_threadsafe(lose)
        assert done.wait(5)


@pytest.fixture
def context() -> Iterator[tuple[WorkerContext, list[tuple[int, str, list[int]]]]]:
    comm = _OneOfTwo()
    ctx = WorkerContext(comm, "g1", Options(), workers=("tcp://a:1", "tcp://b:2"))
    told: list[tuple[int, str, list[int]]] = []
    ctx.on_link_lost = lambda peer, reason, op_ids: told.append((peer, reason, op_ids))
    yield ctx, told
    ctx.close()


def test_the_runs_active_at_a_broken_link_made_after_it_or_with_a_message_left_unsent_are_reported(
    context: tuple[WorkerContext, list[tuple[int, str, list[int]]]],
) -> None:
    ctx, told = context
    comm = ctx.comm
    assert isinstance(comm, _OneOfTwo)
    active = ctx.shuffler(1)
    comm.lose(1, "connection reset")
    # The run active at the loss fails here at once and is reported, naming the peer by its worker.
    assert told == [(1, "connection reset", [1])]
    with pytest.raises(ShuffleError, match=r"rank 0 can no longer reach rank 1 \(worker tcp://b:2\): connection reset"):
        active.insert(0, {})
    # A run made after the loss can never exchange with the peer: failed at once, reported.
    later = ctx.shuffler(2)
    with pytest.raises(ShuffleError, match="can no longer reach rank 1"):
        later.insert(0, {})
    assert told[-1] == (1, "connection reset", [2])
    # A run's messages to the lost peer (its finish counts, after it ended
    # here) that cannot leave: the run is reported once, however many there were.
    _unsent(comm, ("mps", 3, "finish"))
    _unsent(comm, ("mps", 3, "inputs-done-ack"))
    # Messages of other tags (the communicator's own barrier) are no run's.
    _unsent(comm, ("__barrier__", "x", "arrive"))
    wait_for(lambda: len(told) == 3, "the unsent message's report")
    time.sleep(0.2)  # the other two sends' callbacks have run by now
    assert told[-1] == (1, "connection reset", [3]) and len(told) == 3, told


def _unsent(comm: Communicator, tag: Tag) -> BaseException:
    """Send ``tag`` to the lost rank 1 and return the send's error."""
    error = comm.send_nowait(1, tag, [b"0"]).exception(5)
    assert error is not None
    return error


def test_a_peer_that_said_goodbye_is_no_broken_link(
    context: tuple[WorkerContext, list[tuple[int, str, list[int]]]],
) -> None:
    ctx, told = context
    comm = ctx.comm
    assert isinstance(comm, _OneOfTwo)
    ctx.shuffler(1)
    comm.lose(1, "it closed its communicator", goodbye=True)
    assert comm.departed == {1}
    ctx.shuffler(2)
    _unsent(comm, ("mps", 2, "finish"))
    assert told == []
