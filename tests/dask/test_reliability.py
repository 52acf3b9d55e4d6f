"""Faults found by a break-it run (issue 18), each held with the value it must keep.

One LocalCluster of worker processes per module (conftest's ``cluster``),
scaled where a test needs a worker to leave. Faults are injected with
events, signals a worker sends itself, and subclasses — never by sleeping.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import dask
import dask.dataframe as dd
import pandas as pd
import pytest
from dask.base import collections_to_expr, tokenize
from distributed import Client, LocalCluster

from conftest import wait_for as _wait_for
from conftest import worker_addresses
from mpshuffle.config import resolve_options
from mpshuffle.dask import (
    bootstrap_dask_cluster,
    gather_statistics,
    get_worker_context,
    merge,
    set_index,
    shuffle,
    sort_values,
)
from mpshuffle.errors import OptionError, ShuffleError


def _frame(n: int = 400) -> pd.DataFrame:
    return pd.DataFrame({"k": [i % 37 for i in range(n)], "v": range(n)})


def _check(out: pd.DataFrame, expected: pd.DataFrame) -> None:
    got = out.sort_values("v").reset_index(drop=True)[["k", "v"]]
    pd.testing.assert_frame_equal(got, expected.sort_values("v").reset_index(drop=True)[["k", "v"]])


def _options_everywhere(client: Client) -> set[tuple[Any, ...]]:
    """(generation, timeout, batch_bytes, spill_host) of the current generation, on scheduler and workers."""

    def on_scheduler(dask_scheduler):  # type: ignore[no-untyped-def]
        gen = dask_scheduler.plugins["mpshuffle"].generation
        o = gen.options
        return (gen.id, o.timeout, o.batch_bytes, o.spill_host)

    def on_worker(dask_worker):  # type: ignore[no-untyped-def]
        ctx = get_worker_context(dask_worker)
        o = ctx.options
        return (ctx.generation, o.timeout, o.batch_bytes, o.spill_host)

    return {client.run_on_scheduler(on_scheduler), *client.run(on_worker).values()}


# -- 1. options survive a retired generation -----------------------------------------


def test_a_generation_bootstrapped_after_a_worker_left_keeps_the_users_options(
    cluster: LocalCluster, client: Client
) -> None:
    """Issue 18 fault 1: the generation after a fault came back with the dask.config defaults.

    A worker that leaves retires the generation; the next shuffle's
    warm-up bootstrapped the new one with the config defaults, so a
    ``timeout=10`` became 300 s and a lowered memory budget the default.
    """
    first = bootstrap_dask_cluster(client, timeout=7.5, batch_bytes=123_456, spill_host=98_765_432)
    assert {o[1:] for o in _options_everywhere(client)} == {(7.5, 123_456, 98_765_432)}
    cluster.scale(3)
    client.wait_for_workers(3, timeout=60)
    pdf = _frame()
    try:
        # A joined worker: the shuffle's warm-up bootstraps the larger generation.
        _check(shuffle(dd.from_pandas(pdf, npartitions=4), "k", npartitions=3).compute(), pdf)
        grown = _options_everywhere(client)
        assert len(grown) == 1 and next(iter(grown))[0] != first.id
        assert {o[1:] for o in grown} == {(7.5, 123_456, 98_765_432)}
        # A worker left: the generation is retired, the next one is the user's too.
        cluster.scale(2)
        _wait_for(lambda: len(worker_addresses(client)) == 2, "a worker to leave")
        _check(shuffle(dd.from_pandas(pdf, npartitions=4), "k", npartitions=5).compute(), pdf)
        shrunk = _options_everywhere(client)
        assert len(shrunk) == 1 and next(iter(shrunk))[0] not in (first.id, next(iter(grown))[0])
        assert {o[1:] for o in shrunk} == {(7.5, 123_456, 98_765_432)}
        # And the runs themselves used the user's run options.
        runs = gather_statistics(client)
        assert {(r[-1]["options"]["timeout"], r[-1]["options"]["batch_bytes"]) for r in runs.values()} == {
            (7.5, 123_456)
        }
        # An explicit bootstrap still chooses new options (a generation option: a new generation).
        bootstrap_dask_cluster(client, spill_host=87_654_321)
        assert {o[3] for o in _options_everywhere(client)} == {87_654_321}
    finally:
        bootstrap_dask_cluster(client)  # the config's options for the module's next tests


# -- 6. what a graph may cost ------------------------------------------------------


def _small() -> dd.DataFrame:
    return dd.from_pandas(_frame(2000), npartitions=4)


def _never(part: pd.DataFrame) -> pd.DataFrame:
    raise AssertionError("an input partition was computed while the graph was built")


@pytest.mark.parametrize("kind", ["shuffle", "merge", "sort_values", "set_index"])
def test_an_absurd_npartitions_is_refused_at_once_naming_the_limit(kind: str) -> None:
    """Issue 18 fault 6: npartitions=10**6 on a 2,000-row frame was accepted without a word."""
    df = _small().map_partitions(_never, meta=_frame(0))  # sampling it would fail differently
    calls: dict[str, Callable[[], Any]] = {
        "shuffle": lambda: shuffle(df, "k", npartitions=10**6),
        "merge": lambda: merge(df, df, on="k", npartitions=10**6),
        "sort_values": lambda: sort_values(df, "v", npartitions=10**6),
        "set_index": lambda: set_index(df, "v", npartitions=10**6),
    }
    with pytest.raises(ValueError) as info:
        calls[kind]()
    message = str(info.value)
    assert "npartitions=1000000 is more than mpshuffle.max-npartitions (100000)" in message
    assert "dask.config.set({'mpshuffle.max-npartitions': 1000000})" in message
    assert "~1,000.0 s of scheduling here" in message  # the cost of this graph, not of any


def test_the_limit_is_inclusive_and_can_be_raised() -> None:
    df = _small()
    assert shuffle(df, "k", npartitions=100_000).npartitions == 100_000
    with pytest.raises(ValueError, match="more than mpshuffle.max-npartitions"):
        shuffle(df, "k", npartitions=100_001)
    with dask.config.set({"mpshuffle.max-npartitions": 150_000}):
        assert shuffle(df, "k", npartitions=150_000).npartitions == 150_000
        # A graph limit, not a generation option: the workers never see it.
        assert resolve_options() == resolve_options(timeout=300)
    with dask.config.set({"mpshuffle.max-npartitions": "many"}), pytest.raises(OptionError, match="max-npartitions"):
        shuffle(df, "k", npartitions=2)
    # Not finite, not whole, below 1: an OptionError, never an OverflowError from int().
    for bad in (float("inf"), float("nan"), "inf", 2.5, "2.5", 0, -3, True):
        with dask.config.set({"mpshuffle.max-npartitions": bad}), pytest.raises(OptionError, match="max-npartitions"):
            shuffle(df, "k", npartitions=2)
    # A whole number given as a float or a string in any notation is the number.
    for good in (150_000.0, "150000", "1.5e5"):
        with dask.config.set({"mpshuffle.max-npartitions": good}):
            assert shuffle(df, "k", npartitions=150_000).npartitions == 150_000


def test_the_output_collection_is_tokenized_without_its_tasks() -> None:
    """Dask tokenized every task of the layer at compute time (~140 us each; minutes for 10**6).

    The keys' name already holds a token of what the graph is made of.
    Counted: the sequences Dask normalizes while tokenizing (one or more per
    task when it walks the layer).
    """
    out = shuffle(_small(), "k", npartitions=2000)
    seq = dask.tokenize._normalize_seq_func
    with mock.patch("dask.tokenize._normalize_seq_func", wraps=seq) as walked:
        collections_to_expr([out])  # what compute() does first
    assert walked.call_count < 50
    # Distinct shuffles still get distinct tokens.
    assert tokenize(out.expr) != tokenize(shuffle(_small(), "k", npartitions=1999).expr)
    assert tokenize(out.expr) != tokenize(shuffle(_small(), "v", npartitions=2000).expr)
    assert tokenize(out.expr) == tokenize(shuffle(_small(), "k", npartitions=2000).expr)


def test_a_shuffle_built_before_the_cluster_has_workers_runs_once_they_come() -> None:
    """An adaptive cluster starts without workers: building the graph must not need them."""
    pdf = _frame()
    with LocalCluster(n_workers=0, processes=False, dashboard_address=":0") as cluster, Client(cluster) as client:
        out = shuffle(dd.from_pandas(pdf, npartitions=3), "k", npartitions=4)
        cluster.scale(2)
        client.wait_for_workers(2, timeout=60)
        _check(out.compute(), pdf)


# -- 5. a dead worker's spill files --------------------------------------------------


@pytest.fixture(scope="module")
def cluster3() -> Iterator[LocalCluster]:
    with LocalCluster(
        n_workers=3, threads_per_worker=1, processes=True, dashboard_address=":0", memory_limit="2GiB"
    ) as c:
        yield c


@pytest.fixture
def client3(cluster3: LocalCluster) -> Iterator[Client]:
    with Client(cluster3) as c:
        c.wait_for_workers(3, timeout=60)
        yield c


def _swallow_finish(src: int, dask_worker=None) -> None:  # type: ignore[no-untyped-def]
    """Fault injection: this rank drops the finish counts of rank ``src``, so its extracts wait."""
    ctx = get_worker_context(dask_worker)
    deliver = ctx._on_message
    dask_worker.mpshuffle_swallowed = 0

    def handler(s: int, tag: Any, frames: Any) -> None:
        if tag[2] == "finish" and s == src:
            dask_worker.mpshuffle_swallowed += 1
            return
        deliver(s, tag, frames)

    ctx.comm.register_handler("mps", handler)


def _barrier_done(dask_scheduler):  # type: ignore[no-untyped-def]
    return any(
        isinstance(k, str) and k.startswith("mpshuffle-barrier") and ts.state == "memory"
        for k, ts in dask_scheduler.tasks.items()
    )


def _workers(client: Client) -> list[str]:
    return client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.plugins["mpshuffle"].generation.workers))


def test_a_killed_workers_spill_files_are_removed_and_the_retry_is_exact(client3: Client, tmp_path: Any) -> None:
    """Issue 18 fault 5: a worker SIGKILLed mid-shuffle left its spill directory on a shared disk.

    Every chunk spills (a host budget of 2 bytes) into one shared
    ``spill_dir``; rank 1 misses rank 0's finish count, so its extracts wait
    with its files on disk, and is killed. Dask's retry bootstraps a new
    generation, whose bootstrap removes the dead rank's files (and only
    those: the survivors' runs are live).
    """
    bootstrap_dask_cluster(client3, timeout=30, spill_dir=str(tmp_path), spill_host=2)
    try:
        workers = _workers(client3)
        victim = workers[1]
        client3.run(_swallow_finish, 0, workers=[victim])
        pdf = _frame(3000)
        fut = client3.compute(shuffle(dd.from_pandas(pdf, npartitions=6), "k", npartitions=6))
        _wait_for(lambda: client3.run_on_scheduler(_barrier_done), "the barrier to finish")
        dead_rank = [n for n in os.listdir(tmp_path) if n.endswith("-r1")]
        assert dead_rank and os.listdir(tmp_path / dead_rank[0])  # its spilled chunks
        pid = client3.run(os.getpid, workers=[victim])[victim]
        os.kill(pid, signal.SIGKILL)
        _check(fut.result(timeout=60), pdf)
        del fut
        # The retry's runs ended too: nothing of any generation is left.
        _wait_for(lambda: not [n for n in os.listdir(tmp_path) if n.startswith("mpshuffle")], "the spill dir to empty")
    finally:
        client3.wait_for_workers(3, timeout=60)
        bootstrap_dask_cluster(client3)


# -- 2/3. a rank that stops answering -----------------------------------------------


def _freeze_in(method: str, pidfile: str, dask_worker=None) -> None:  # type: ignore[no-untyped-def]
    """Fault injection: the first ``Shuffler.<method>`` call on this worker stops its process.

    The process sends itself SIGSTOP (as a stopped or swapped-out host
    would be): no thread runs, no heartbeat, no socket is read. It writes
    its pid and address first, for the test to find and resume it.
    """
    from mpshuffle.shuffler import host

    real = getattr(host.Shuffler, method)
    setattr(host.Shuffler, f"_real_{method}", real)

    def frozen(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        setattr(host.Shuffler, method, real)
        _stop(pidfile, dask_worker.address)
        return real(self, *args, **kwargs)

    setattr(host.Shuffler, method, frozen)


def _stop(pidfile: str, address: str) -> None:
    with open(pidfile + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {address}")
    os.rename(pidfile + ".tmp", pidfile)
    os.kill(os.getpid(), signal.SIGSTOP)


def _freeze_on_fetch(prefix: str, pidfile: str, dask_worker=None) -> None:  # type: ignore[no-untyped-def]
    """Fault injection: the first worker a peer asks for the result of a task named ``prefix…`` stops.

    As :func:`_freeze_in`, once in the cluster (``pidfile`` is claimed first):
    the asking task (the barrier fetching an insert's result, an extract
    fetching the barrier's) waits in Dask's fetch, not in mpshuffle.
    """
    real = dask_worker.handlers["get_data"]

    async def frozen(comm, keys=(), **kwargs):  # type: ignore[no-untyped-def]
        if any(str(k[0] if isinstance(k, tuple) else k).startswith(prefix) for k in keys):
            try:
                os.close(os.open(pidfile + ".claimed", os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass
            else:
                dask_worker.handlers["get_data"] = real
                _stop(pidfile, dask_worker.address)
        return await real(comm, keys=keys, **kwargs)

    dask_worker.mpshuffle_real_get_data = real
    dask_worker.handlers["get_data"] = frozen


def _thaw(method: str, dask_worker=None) -> None:  # type: ignore[no-untyped-def]
    from mpshuffle.shuffler import host

    real = getattr(host.Shuffler, f"_real_{method}", None)
    if real is not None:
        setattr(host.Shuffler, method, real)
    get_data = getattr(dask_worker, "mpshuffle_real_get_data", None)
    if get_data is not None:
        dask_worker.handlers["get_data"] = get_data


def _runs(dask_scheduler):  # type: ignore[no-untyped-def]
    return len(dask_scheduler.plugins["mpshuffle"].runs)


@pytest.mark.parametrize(
    ("phase", "fetched"),
    [("insert", None), ("barrier", None), ("extract", None), ("barrier", "mpshuffle-insert"),
     ("extract", "mpshuffle-barrier")],
)
def test_a_stopped_rank_fails_the_shuffle_within_timeout_naming_it(
    client3: Client, tmp_path: Any, phase: str, fetched: str | None
) -> None:
    """Issue 18 faults 2 and 3: a stopped rank left a shuffle without an answer well past timeout.

    Stopped while it inserts, while it runs the barrier task, or while it
    extracts, nothing else may be left to time out: the client must still
    get an error within ``timeout`` (+ the watch's ~1 s) naming the phase,
    the stopped rank and its worker. Likewise when it stops while a peer
    fetches a result of the run from it (``fetched``: the barrier task an
    insert's result, an extract the barrier's), where the waiting task has not
    started, so only Dask's fetch waits (over 70 s; 38.8 s in a break-it run
    with ``timeout=10``). Resumed, the cluster shuffles exactly.
    """
    timeout = 5.0  # long enough that a loaded machine delays no heartbeat that much
    bootstrap_dask_cluster(client3, timeout=timeout)
    pdf = _frame(900)
    # A first shuffle compiles the insert's kernels on every worker: a worker
    # busy compiling holds the GIL and misses heartbeats, like a stopped one.
    _check(shuffle(dd.from_pandas(pdf, npartitions=6), "k", npartitions=6).compute(), pdf)
    workers = _workers(client3)
    pidfile = str(tmp_path / "frozen")
    if fetched is not None:
        client3.run(_freeze_on_fetch, fetched, pidfile)  # whichever rank is asked first
    else:
        # The barrier task runs where the scheduler puts it: every rank is armed.
        armed = workers if phase == "barrier" else [workers[1]]
        client3.run(_freeze_in, phase, pidfile, workers=armed)
    frozen_pid = None
    try:
        fut = client3.compute(shuffle(dd.from_pandas(pdf, npartitions=6), "k", npartitions=6))
        _wait_for(lambda: os.path.exists(pidfile), "a rank to stop")
        stopped = time.monotonic()
        with open(pidfile) as f:
            pid, address = f.read().split()
        frozen_pid = int(pid)
        with pytest.raises(ShuffleError) as info:
            fut.result(timeout=timeout + 30)
        waited = time.monotonic() - stopped
        rank = workers.index(address)
        message = str(info.value)
        # From the scheduler's watch ("insert phase: rank 1 (worker ...) stopped
        # answering") or from a healthy rank whose wait ended first ("insert
        # phase on rank 2 (...): rank 1 (worker ...) did not take a chunk"):
        # either way the phase, and the stopped rank and its worker.
        assert message.startswith(f"{phase} phase"), message
        blamed = f"rank {rank} (worker {address})"
        assert blamed in message.split(":", 1)[1], message
        assert waited < timeout + 3, waited
        del fut
    finally:
        if frozen_pid is not None:
            os.kill(frozen_pid, signal.SIGCONT)
        client3.run(_thaw, phase)
    _wait_for(lambda: client3.run_on_scheduler(_runs) == 0, "the failed run to end")
    # The next shuffle bootstraps a new generation with the same options and is exact.
    _check(shuffle(dd.from_pandas(pdf, npartitions=6), "k", npartitions=5).compute(), pdf)
    # The resumed worker is the same process, still in the cluster: the
    # scheduler's failing of its task left its state machine consistent.
    assert client3.run(os.getpid, workers=[address]) == {address: frozen_pid}
    assert {o[1] for o in _options_everywhere(client3)} == {timeout}
    bootstrap_dask_cluster(client3)
