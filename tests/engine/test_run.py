"""The shared run lifecycle: host and device runs driven through the one ``Run`` interface.

Single rank on the ``local`` communicator, through a :class:`WorkerContext`
(which routes each kind's messages); device runs use NumPy device tables.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pandas as pd
import pytest

from conftest import host_table
from mpshuffle.comm import LocalCommunicator
from mpshuffle.config import resolve_options
from mpshuffle.errors import PartitionGoneError, ShuffleError
from mpshuffle.memory import MemoryType
from mpshuffle.shuffler.context import WorkerContext
from mpshuffle.shuffler.run import STATISTICS, Run, Statistics
from mpshuffle.table import PandasAdapter
from mpshuffle.table.device import DeviceAdapter, DeviceTable

KINDS = ["host", "device"]
NPART = 3


@pytest.fixture
def ctx() -> Iterator[WorkerContext]:
    c = WorkerContext(LocalCommunicator(), "g", resolve_options(timeout=10), workers=("local",))
    yield c
    c.close()


def _frame(kind: str, i: int) -> tuple[Any, Any]:
    t = host_table(i, 500)
    if kind == "host":
        return pd.DataFrame(t), PandasAdapter()
    return DeviceTable(t), DeviceAdapter()


def _run(ctx: WorkerContext, kind: str, op_id: int) -> Run:
    run = ctx.shuffler(op_id, device=kind == "device")
    for i in range(2):
        frame, adapter = _frame(kind, i)
        run.insert_frame(i, frame, adapter, ["key"], NPART, attempt=f"a{i}")
    return run


@pytest.mark.parametrize("kind", KINDS)
def test_a_run_of_either_kind_goes_through_one_lifecycle(ctx: WorkerContext, kind: str) -> None:
    run = _run(ctx, kind, 1)
    assert isinstance(run, Run) and not run.inputs_done
    run.barrier(NPART, accepted=["a0", "a1"])
    assert run.inputs_done and run.npartitions == NPART
    meta, adapter = _frame(kind, 0)
    rows = []
    for j in range(NPART):
        with run.scope():
            out = adapter.unpack(run.extract(j), adapter.empty_like(meta))
        rows.extend(np.asarray(out.columns["row"] if kind == "device" else out["row"]).tolist())
    assert sorted(rows) == sorted(np.concatenate([host_table(i, 500)["row"] for i in range(2)]).tolist())
    # After its last partition the run closed and left the context; its statistics stayed.
    assert run.closed and 1 not in ctx.shufflers
    ((op_id, stats),) = list(ctx.history)
    assert op_id == 1 and set(stats) == set(STATISTICS)
    assert stats["bytes_inserted"] > 0 and stats["bytes_received"] > 0 and stats["seconds_extract"] > 0
    # The other kind's mechanisms stay at 0.
    if kind == "host":
        assert stats["chunks_received"] > 0 and stats["rounds"] == 0
        # The waits for the chunks to be taken are part of the insert's time.
        assert 0 <= stats["seconds_insert_wait"] <= stats["seconds_insert"]
    else:
        assert stats["seconds_insert_wait"] == 0
        assert stats["rounds"] == 1 and stats["chunks_received"] == 0
    with pytest.raises(PartitionGoneError, match="already finished"):
        ctx.shuffler(1, device=kind == "device")


@pytest.mark.parametrize("kind", KINDS)
def test_fail_wakes_every_wait_and_close_tells_the_owner_once(ctx: WorkerContext, kind: str) -> None:
    run = _run(ctx, kind, 2)
    run.fail(ShuffleError("peer lost (test)"))
    with pytest.raises(ShuffleError, match="peer lost"):
        run.barrier(NPART)
    with pytest.raises(ShuffleError, match="peer lost"):
        run.extract(0)
    frame, adapter = _frame(kind, 5)
    with pytest.raises(ShuffleError, match="peer lost"):
        run.insert_frame(5, frame, adapter, ["key"], NPART)
    # Freed by fail: what stays reserved is only the pool's idle memory, kept for the next insert.
    assert ctx.resource.used(MemoryType.HOST) == ctx.pool.idle_bytes
    assert ctx.resource.used(MemoryType.DEVICE) == 0
    run.close()
    run.close()
    assert run.closed and [op for op, _ in ctx.history] == [2]
    assert ctx.resource.used(MemoryType.HOST) == 0  # no run left: the pool gave its memory back


@pytest.mark.parametrize("kind", KINDS)
def test_extract_checks_ownership_and_hands_a_partition_out_once(ctx: WorkerContext, kind: str) -> None:
    run = _run(ctx, kind, 3)
    run.barrier(NPART)
    label = "device shuffle op 3" if kind == "device" else "shuffle op 3"
    with pytest.raises(ShuffleError, match=f"partition {NPART} of {label} is not owned by rank 0"):
        run.extract(NPART)
    run.extract(0)
    with pytest.raises(PartitionGoneError, match=f"partition 0 of {label} was already extracted"):
        run.extract(0)


def test_statistics_refuse_a_key_that_is_not_a_statistic() -> None:
    s = Statistics()
    assert list(s) == list(STATISTICS) and all(v == 0 for v in s.values())
    s["bytes_sent"] += 5
    assert s["bytes_sent"] == 5
    with pytest.raises(KeyError, match="'bytes_spilled' is not a run statistic"):
        s["bytes_spilled"] = 1


def test_a_host_frame_does_not_take_the_device_path() -> None:
    with pytest.raises(TypeError, match="pandas frames are host data"):
        PandasAdapter().device_table(pd.DataFrame({"a": [1]}))
