"""The order of device exchanges: every rank runs them in rank 0's order (no GPU needed).

:meth:`mpshuffle.shuffler.device.DeviceState.turn` is driven here with a
stand-in communicator that records what rank 0 sends; the exchanges are
threads that note when they hold the slot.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from mpshuffle.errors import ShuffleError
from mpshuffle.shuffler.device import DEVICE_TAG, DeviceState


class _Comm:
    def __init__(self, rank: int, nranks: int = 3) -> None:
        self.rank, self.nranks = rank, nranks
        self.sent: list[tuple[int, Any]] = []

    def send_nowait(self, dest: int, tag: Any, frames: list[Any]) -> None:
        self.sent.append((dest, tag))


def _ok() -> None:
    return None


def _exchange(state: DeviceState, comm: _Comm, op: int, log: list[str], hold: float = 0.05,
              check: Any = _ok, timeout: float = 5.0) -> threading.Thread:
    def run() -> None:
        try:
            with state.turn(comm, op, timeout, check):
                log.append(f"start {op}")
                time.sleep(hold)
                log.append(f"end {op}")
        except ShuffleError as e:
            log.append(f"error {op}: {e}")

    t = threading.Thread(target=run)
    t.start()
    return t


def test_rank_0_announces_its_order_to_every_other_rank() -> None:
    comm, state, log = _Comm(0), DeviceState(0, 0, 0), []
    for op in (4, 9):
        _exchange(state, comm, op, log, hold=0).join(5)
    assert comm.sent == [(1, (DEVICE_TAG, 4, "turn")), (2, (DEVICE_TAG, 4, "turn")),
                         (1, (DEVICE_TAG, 9, "turn")), (2, (DEVICE_TAG, 9, "turn"))]
    assert log == ["start 4", "end 4", "start 9", "end 9"]


def test_other_ranks_run_exchanges_in_rank_0s_order_not_in_arrival_order() -> None:
    comm, state, log = _Comm(1), DeviceState(0, 0, 0), []
    # This rank learned of op 9's barrier first, but rank 0 runs 4 before 9.
    t9 = _exchange(state, comm, 9, log)
    t4 = _exchange(state, comm, 4, log)
    time.sleep(0.3)
    assert log == []  # no turn yet: neither may start
    state.add_turn(4)
    state.add_turn(9)
    t9.join(5)
    t4.join(5)
    assert log == ["start 4", "end 4", "start 9", "end 9"]
    assert comm.sent == [] and state._turns == []


def test_a_failed_run_gives_its_turn_up() -> None:
    comm, state, log = _Comm(2), DeviceState(0, 0, 0), []
    state.add_turn(4)
    state.add_turn(9)
    t9 = _exchange(state, comm, 9, log)
    time.sleep(0.2)
    assert log == []  # op 4 is ahead; its run failed here before its exchange started
    state.drop_turn(4)
    t9.join(5)
    assert log == ["start 9", "end 9"]


def test_waiting_rank_stops_when_its_run_fails_or_times_out() -> None:
    comm, state, log = _Comm(1), DeviceState(0, 0, 0), []
    failed = threading.Event()

    def check() -> None:
        if failed.is_set():
            raise ShuffleError("run failed (test)")

    t = _exchange(state, comm, 5, log, check=check)
    time.sleep(0.2)
    failed.set()
    t.join(5)
    assert log == ["error 5: run failed (test)"]
    state.add_turn(7)
    _exchange(state, comm, 8, log, timeout=0.3).join(5)
    assert log[-1].startswith("error 8: device shuffle op 8 on rank 1: rank 0 did not start")
    assert "[7]" in log[-1] and state._turns == [7]


def test_single_rank_needs_no_turns() -> None:
    comm, state, log = _Comm(0, nranks=1), DeviceState(0, 0, 0), []
    _exchange(state, comm, 3, log, hold=0).join(5)
    assert log == ["start 3", "end 3"] and comm.sent == []

