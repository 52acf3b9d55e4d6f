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
