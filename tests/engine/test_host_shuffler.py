"""The shuffler on the local communicator: finish counting and accepted insert attempts."""

from __future__ import annotations

import pandas as pd
import pytest

from mpshuffle.comm import LocalCommunicator
from mpshuffle.memory import BufferResource
from mpshuffle.shuffler.host import Shuffler
from mpshuffle.table import PandasAdapter


@pytest.fixture
def shuffler():  # type: ignore[no-untyped-def]
    comm = LocalCommunicator()
    comm.register_handler("mps", lambda src, tag, frames: s.receive(src, tag, frames))
    s = Shuffler(comm, 1, resource=BufferResource(), timeout=5)
    yield s
    s.close()
    comm.close()


def test_only_the_accepted_attempt_of_an_input_counts(shuffler: Shuffler) -> None:
    """An abandoned execution of an insert (its run restarted while it ran) sent data too."""
    adapter = PandasAdapter()
    part0 = pd.DataFrame({"k": [1, 2, 3], "v": [10, 20, 30]})
    part1 = pd.DataFrame({"k": [4, 5], "v": [40, 50]})
    shuffler.insert(0, adapter.split(part0, ["k"], 1), attempt="old")
    shuffler.insert(0, adapter.split(part0, ["k"], 1), attempt="new")
    shuffler.insert(1, adapter.split(part1, ["k"], 1), attempt="only")
    shuffler.barrier(1, accepted=["new", "only"])
    out = adapter.unpack(shuffler.extract(0), part0.iloc[:0])
    assert out["v"].tolist() == [10, 20, 30, 40, 50]
    assert shuffler.closed


def test_send_after_close_fails_cleanly() -> None:
    import gc
    import warnings

    from mpshuffle.errors import CommError

    comm = LocalCommunicator()
    got: list[object] = []
    comm.register_handler("t", lambda src, tag, frames: got.append(tag))
    comm.send_nowait(0, ("t", 1), [b"x"]).result(5)
    assert got == [("t", 1)]
    comm.close()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fut = comm.send_nowait(0, ("t", 2), [b"y"])
        with pytest.raises(CommError, match="communicator is closed"):
            fut.result(1)
        gc.collect()
    assert got == [("t", 1)]  # nothing delivered after close
    assert not [w for w in caught if "never awaited" in str(w.message)]


def test_the_last_extract_to_finish_frees_the_run_not_the_last_to_start(
    shuffler: Shuffler, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a breaker (session 25): extracts on several threads of one worker.

    The extract that took the last partition freed the run at once, while
    another extract had taken its partition and not yet read it: that one
    got no pieces (an empty DataFrame partition; a rechunk's "received no
    pieces"). The run is freed by whichever extract ends last.
    """
    import threading

    adapter = PandasAdapter()
    frame = pd.DataFrame({"k": [0, 1, 2, 3], "v": [10, 11, 12, 13]})
    ids = (frame["k"] % 2).to_numpy()
    shuffler.insert(0, adapter.split(frame, ["k"], 2, ids=ids), attempt="a")
    shuffler.barrier(2, accepted=["a"])
    pop = shuffler.postbox.pop
    inside, go = threading.Event(), threading.Event()

    def slow_pop(partition_id: int, **kwargs):  # type: ignore[no-untyped-def]
        if partition_id == 0:
            inside.set()
            assert go.wait(10)
        return pop(partition_id, **kwargs)

    monkeypatch.setattr(shuffler.postbox, "pop", slow_pop)
    got: dict[int, pd.DataFrame] = {}
    first = threading.Thread(target=lambda: got.__setitem__(0, adapter.unpack(shuffler.extract(0), frame.iloc[:0])))
    first.start()
    assert inside.wait(10)
    got[1] = adapter.unpack(shuffler.extract(1), frame.iloc[:0])  # the last partition taken
    assert not shuffler.closed  # partition 0 is still being read
    go.set()
    first.join(10)
    assert got[0]["v"].tolist() == [10, 12] and got[1]["v"].tolist() == [11, 13]
    assert shuffler.closed
