"""The plugins' typed messages: what travels, and what is refused."""

from __future__ import annotations

import msgpack
import pytest

from mpshuffle.dask.messages import (
    BootstrapSpec,
    Generation,
    Joined,
    Restarted,
    RunBinding,
    Verdict,
)
from mpshuffle.dask.runtime import LocalRuntime, Runtime
from mpshuffle.errors import ShuffleError
from mpshuffle.options import Options


@pytest.mark.parametrize(
    "message",
    [
        BootstrapSpec("g1", ("tcp://a:1", "tcp://b:2"), "secret", {"timeout": 5.0, "spill_dir": None}),
        Joined(1, "tcp://a:3"),
        Joined(-1, "", error="BootstrapError: rank 1 (worker tcp://b:2) did not arrive within 1 s"),
        RunBinding(7, "g1", ("tcp://a:1", "tcp://b:2")),
        RunBinding(-1, "", (), error="bootstrap phase: no workers"),
        Verdict(True),
        Verdict(False, ("tcp://a:1",)),
        Restarted(False),
        Generation("0123456789ab", 2, {"tcp://a:1": 0, "tcp://b:2": 1}, bootstrapped=True),
    ],
)
def test_a_message_survives_the_wire_as_msgpack(message: object) -> None:
    wire = msgpack.unpackb(msgpack.packb(message.to_msg()))  # type: ignore[attr-defined]
    assert type(message).from_msg(wire) == message  # type: ignore[attr-defined]


def test_a_message_with_other_fields_or_no_dict_is_refused() -> None:
    with pytest.raises(TypeError, match=r"unknown fields \['restarted'\] in a Verdict message"):
        Verdict.from_msg({"restart": True, "restarted": True})
    with pytest.raises(TypeError, match="missing"):
        RunBinding.from_msg({"op_id": 1})
    with pytest.raises(TypeError, match="a Joined message must be a dict, got NoneType"):
        Joined.from_msg(None)


def test_the_local_runtime_binds_one_run_per_computation() -> None:
    runtime: Runtime = LocalRuntime()
    run = runtime.get_run("tok", 3, options=Options(), extract_name="x", barrier_name="b")
    assert runtime.get_run("tok", 3, options=Options(), extract_name="x", barrier_name="b") is run
    ctx = runtime.context_for(run)
    try:
        assert (run.generation, run.workers, run.npartitions) == ("local", ("local",), 3)
        runtime.check_owner(run, 2)  # one rank owns everything
        assert runtime.restart_run(run, "test") is None  # cannot restart: the caller raises
        ctx.shuffler(run.op_id).insert(0, {}, attempt="a")
        # An insert after the inputs are done starts a new computation, with a new run.
        ctx.shuffler(run.op_id).barrier(3, accepted=["a"])
        again = runtime.get_run("tok", 3, options=Options(), extract_name="x", barrier_name="b", inserting=True)
        assert again.op_id != run.op_id and ctx.has_ended(run.op_id)
    finally:
        ctx.close()


def test_a_failed_local_task_frees_its_run() -> None:
    """Dask's local schedulers stop at a task's error: the run is failed and forgotten, not left behind."""
    runtime = LocalRuntime()
    run = runtime.get_run("tok", 2, options=Options(), inserting=True)
    ctx = runtime.context_for(run)
    try:
        ctx.shuffler(run.op_id).insert(0, {}, attempt="a")
        with pytest.raises(ShuffleError, match=r"insert phase on rank 0 \(local\): .*cannot be hashed"), \
                runtime.guard("insert", run, ctx):
            raise ShuffleError("key column 'x' cannot be hashed")
        assert ctx.shufflers == {} and ctx.has_ended(run.op_id)
        assert runtime.get_run("tok", 2, options=Options(), inserting=True).op_id != run.op_id
    finally:
        ctx.close()
