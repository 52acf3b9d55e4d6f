"""Bootstrapping that holds up (issue 4): CLI clusters, async clients, concurrent
bootstraps, changing membership, lost workers, timeouts, a free worker event
loop, and security.

Faults are injected with distributed Events and by swapping a rank's message
handler, never by sleeping; every test ends by checking that no run state and
no thread of a replaced generation is left.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import dask.dataframe as dd
import pandas as pd
import pytest
from distributed import Client, Event, LocalCluster, rejoin, secede

from conftest import three_worker_client, worker_addresses, worker_state
from conftest import wait_for as _wait_for
from mpshuffle.dask import bootstrap_dask_cluster, get_worker_context, shuffle
from mpshuffle.errors import BootstrapError

# -- helpers ---------------------------------------------------------------


def _frame(n: int = 300) -> pd.DataFrame:
    return pd.DataFrame({"k": [i % 37 for i in range(n)], "v": range(n)})


def _check(out: pd.DataFrame, expected: pd.DataFrame) -> None:
    got = out.sort_values("v").reset_index(drop=True)[["k", "v"]]
    pd.testing.assert_frame_equal(got, expected.sort_values("v").reset_index(drop=True)[["k", "v"]])


def _hold(pdf: pd.DataFrame, event: str) -> pd.DataFrame:
    """Input partition that waits for ``event``, except the first (it starts the run)."""
    if len(pdf) and pdf["v"].iloc[0] != 0:
        secede()  # give the thread back to the worker while waiting
        Event(event).wait(timeout=60)
        rejoin()
    return pdf


def _held(pdf: pd.DataFrame, npartitions: int) -> tuple[dd.DataFrame, str]:
    name = f"go-{uuid.uuid4().hex[:8]}"
    df = dd.from_pandas(pdf, npartitions=npartitions).map_partitions(_hold, name, meta=pdf.iloc[:0])
    return df, name


def _plugin_state(dask_scheduler):  # type: ignore[no-untyped-def]
    plugin = dask_scheduler.plugins.get("mpshuffle")
    if plugin is None:
        return {"runs": [], "generation": None, "generations": [], "bootstraps": 0}
    gen = plugin.generation
    return {
        "runs": [(r.op_id, r.generation.id) for r in plugin.runs.values()],
        "generation": gen.id if gen else None,
        "workers": list(gen.workers) if gen else [],
        "generations": sorted(plugin.generations),
        "bootstraps": plugin.bootstraps,
    }


def _state(client: Client) -> dict[str, Any]:
    return client.run_on_scheduler(_plugin_state)


def _assert_clean(client: Client) -> None:
    """No run on the scheduler; on the workers no shuffler, and only the current generation's thread."""

    def settled() -> bool:
        state = _state(client)
        if state["runs"] or state["generations"] != ([state["generation"]] if state["generation"] else []):
            return False
        gen = state["generation"]
        for s in client.run(worker_state).values():
            if s["shufflers"] or any(not t.startswith(f"mpshuffle-progress-{gen}-") for t in s["threads"]):
                return False
        return True

    _wait_for(settled, "mpshuffle state to be released")


def _swallow(kind: str, src: int | None = None, dask_worker=None) -> None:  # type: ignore[no-untyped-def]
    """Fault injection: this rank drops messages of ``kind`` (from ``src``) and records it."""
    ctx = get_worker_context(dask_worker)
    deliver = ctx._on_message
    dask_worker.mpshuffle_swallowed = 0

    def handler(s: int, tag: Any, frames: Any) -> None:
        if tag[2] == kind and (src is None or s == src):
            dask_worker.mpshuffle_swallowed += 1
            return
        deliver(s, tag, frames)

    ctx.comm.register_handler("mps", handler)


def _unswallow(dask_worker=None) -> None:  # type: ignore[no-untyped-def]
    """Undo :func:`_swallow`: a new timeout no longer makes a new generation, whose context would not have it."""
    ctx = get_worker_context(dask_worker)
    ctx.comm.register_handler("mps", ctx._on_message)


def _swallowed(client: Client, worker: str) -> int:
    return client.run(lambda dask_worker: getattr(dask_worker, "mpshuffle_swallowed", 0), workers=[worker])[worker]


# -- 1. CLI-started cluster -----------------------------------------------------


@pytest.mark.timeout(300)  # four Python processes start on 2 shared cores
def test_cli_started_cluster(tmp_path: Any) -> None:
    dask_cli = os.path.join(os.path.dirname(sys.executable), "dask")
    sched_file = str(tmp_path / "scheduler.json")
    # The processes unpickle this module's helper functions by reference.
    here = os.path.dirname(os.path.abspath(__file__))
    paths = [here, os.path.dirname(here), os.environ.get("PYTHONPATH")]  # this module and conftest
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths))}
    common = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "cwd": str(tmp_path), "env": env}
    procs = [
        subprocess.Popen(
            [dask_cli, "scheduler", "--host", "127.0.0.1", "--port", "0", "--dashboard-address", ":0",
             "--scheduler-file", sched_file],
            **common,
        )
    ]
    try:
        _wait_for(lambda: os.path.exists(sched_file) and os.path.getsize(sched_file), "the scheduler file")
        for _ in range(3):
            procs.append(
                subprocess.Popen(
                    [dask_cli, "worker", "--scheduler-file", sched_file, "--host", "127.0.0.1",
                     "--nthreads", "1", "--no-dashboard", "--memory-limit", "2GiB", "--no-nanny"],
                    **common,
                )
            )
        with Client(scheduler_file=sched_file) as client:
            client.wait_for_workers(3, timeout=60)
            gen = bootstrap_dask_cluster(client)
            assert gen.nranks == 3 and set(gen.ranks) == set(worker_addresses(client))
            pdf = _frame()
            out = shuffle(dd.from_pandas(pdf, npartitions=5), "k", npartitions=4).compute()
            _check(out, pdf)
            _assert_clean(client)
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in reversed(procs):
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


# -- 2. Async clients -------------------------------------------------------------


def test_async_client(cluster: LocalCluster) -> None:
    pdf = _frame()

    async def main() -> tuple[Any, pd.DataFrame, pd.DataFrame]:
        async with Client(cluster.scheduler_address, asynchronous=True) as c:
            gen = await bootstrap_dask_cluster(c, timeout=60)
            out = await c.compute(shuffle(dd.from_pandas(pdf, npartitions=4), "k", npartitions=3))
            # A second shuffle whose first task binds the run, with no explicit bootstrap.
            out2 = await c.compute(shuffle(dd.from_pandas(pdf, npartitions=3), "v", npartitions=2))
            return gen, out, out2

    gen, out, out2 = asyncio.run(main())
    assert gen.nranks == 2
    _check(out, pdf)
    _check(out2, pdf)
    with Client(cluster) as client:
        assert _state(client)["generation"] == gen.id
        _assert_clean(client)


# -- 3. Concurrent bootstraps from two processes ---------------------------------


def _child_bootstrap(address: str, go: Any, results: Any) -> None:
    from distributed import Client

    from mpshuffle.dask import bootstrap_dask_cluster

    with Client(address) as c:
        results.put("ready")
        go.wait(60)
        results.put(bootstrap_dask_cluster(c, spill_host=0.2).id)


def test_concurrent_bootstraps_from_two_processes(client: Client) -> None:
    # The plugins exist; the next calls (another generation option) must make one new generation.
    bootstrap_dask_cluster(client)
    before = _state(client)["bootstraps"]
    ctx = multiprocessing.get_context("spawn")
    go, results = ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_child_bootstrap, args=(client.scheduler.address, go, results))
    child.start()
    try:
        assert results.get(timeout=60) == "ready"
        go.set()
        mine = bootstrap_dask_cluster(client, spill_host=0.2)
        theirs = results.get(timeout=60)
        child.join(30)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
    assert theirs == mine.id
    state = _state(client)
    assert state["bootstraps"] == before + 1 and state["generation"] == mine.id
    _assert_clean(client)


# -- 4. Changing membership ------------------------------------------------------


@pytest.mark.timeout(300)  # starts a cluster and a third worker process
def test_membership_changes() -> None:
    pdf = _frame()
    with LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0", memory_limit="2GiB"
    ) as cluster, Client(cluster) as client:
        g2 = bootstrap_dask_cluster(client, timeout=30)
        assert g2.nranks == 2

        # A worker joins while a shuffle runs: that shuffle keeps its generation.
        df, go = _held(pdf, 4)
        held = client.compute(shuffle(df, "k", npartitions=4))
        _wait_for(lambda: _state(client)["runs"], "the first run to start")
        cluster.scale(3)
        client.wait_for_workers(3, timeout=30)
        second = shuffle(dd.from_pandas(pdf, npartitions=3), "k", npartitions=5).compute()
        _check(second, pdf)
        g3 = _state(client)
        assert len(g3["workers"]) == 3 and g3["generation"] != g2.id
        assert g2.id in g3["generations"]  # still carries the held run
        Event(go, client=client).set()
        _check(held.result(timeout=60), pdf)
        del held
        _assert_clean(client)
        assert [t for s in client.run(worker_state).values() for t in s["threads"]] and all(
            s["threads"] == [s["threads"][0]] for s in client.run(worker_state).values()
        )

        # A worker leaves: noticed at once, its generation closed on the others.
        leaving = g3["workers"][1]
        client.retire_workers([leaving])
        _wait_for(lambda: _state(client)["generation"] is None, "the generation to be dropped")
        _wait_for(lambda: not any(s["threads"] for s in client.run(worker_state).values()), "threads to end")
        out = shuffle(dd.from_pandas(pdf, npartitions=4), "k", npartitions=3).compute()
        _check(out, pdf)
        after = _state(client)
        assert sorted(after["workers"]) == worker_addresses(client) and len(after["workers"]) == 2
        assert leaving not in after["workers"]
        _assert_clean(client)


# -- 5. Lost workers -----------------------------------------------------------


@pytest.fixture
def client3() -> Iterator[Client]:
    """A client of a fresh cluster of 3 worker processes (a test kills one of them).

    Each worker runs under a nanny, which may restart a killed worker; the
    tests hold whether or not it does.
    """
    with three_worker_client() as c:
        yield c


def _kill(client: Client, worker: str) -> None:
    pid = client.run(os.getpid, workers=[worker])[worker]
    os.kill(pid, signal.SIGKILL)


def _barrier_done(dask_scheduler):  # type: ignore[no-untyped-def]
    return any(k.startswith("mpshuffle-barrier") and ts.state == "memory" for k, ts in dask_scheduler.tasks.items()
               if isinstance(k, str))


@pytest.mark.parametrize("phase", ["insert", "barrier", "extract"])
def test_lost_worker_restarts_the_shuffle(client3: Client, phase: str) -> None:
    pdf = _frame(600)
    state = _state(client3)
    workers = state["workers"]
    victim = workers[1]
    if phase == "barrier":
        # The victim never confirms the barrier; killed while the barrier waits for it.
        client3.run(_swallow, "inputs-done", workers=[victim])
    elif phase == "extract":
        # Rank 0 misses the victim's finish count, so its extracts wait; the victim dies then.
        client3.run(_swallow, "finish", 1, workers=[workers[0]])
    df, go = _held(pdf, 6)
    fut = client3.compute(shuffle(df, "k", npartitions=6))
    _wait_for(lambda: _state(client3)["runs"], "the run to start")
    if phase == "insert":
        _kill(client3, victim)
        Event(go, client=client3).set()
    else:
        Event(go, client=client3).set()
        if phase == "barrier":
            _wait_for(lambda: _swallowed(client3, victim), "the victim to get inputs-done")
        else:
            _wait_for(lambda: client3.run_on_scheduler(_barrier_done), "the barrier to finish")
            _wait_for(lambda: _swallowed(client3, workers[0]), "rank 0 to miss the finish count")
        _kill(client3, victim)
    _check(fut.result(timeout=60), pdf)
    del fut
    after = _state(client3)
    assert victim not in after["workers"] and after["generation"] != state["generation"]
    _assert_clean(client3)


async def _break_comm(dask_worker) -> None:  # type: ignore[no-untyped-def]
    await asyncio.to_thread(get_worker_context(dask_worker).comm.close)


def test_broken_communicator_fails_naming_phase_and_worker(client3: Client) -> None:
    """A rank whose communicator breaks while its worker stays: an error, not a hang."""
    bootstrap_dask_cluster(client3, timeout=3)
    pdf = _frame()
    workers = _state(client3)["workers"]
    client3.run(_swallow, "finish", 1, workers=[workers[0]])
    fut = client3.compute(shuffle(dd.from_pandas(pdf, npartitions=4), "k", npartitions=3))
    _wait_for(lambda: _swallowed(client3, workers[0]), "rank 0 to miss the finish count")
    t0 = time.monotonic()
    client3.run(_break_comm, workers=[workers[1]])
    # Whichever surviving rank's extract reports first (rank 0 misses a finish
    # count; rank 2's may notice the loss first on a loaded machine), the error
    # names that rank's worker and the lost rank's.
    reporter = "|".join(rf"rank {r} \(worker {re.escape(workers[r])}\)" for r in (0, 2))
    with pytest.raises(Exception, match=rf"extract phase on (?:{reporter}).*rank 1 \(worker {re.escape(workers[1])}\)"):
        fut.result(timeout=60)
    assert time.monotonic() - t0 < 3 + 5 + 10  # the run's timeout, the verdict's grace, slack
    del fut
    # The broken generation was retired: the next shuffle bootstraps a new one on all 3 workers.
    out = shuffle(dd.from_pandas(pdf, npartitions=5), "k", npartitions=4).compute()
    _check(out, pdf)
    assert _state(client3)["workers"] == workers
    _assert_clean(client3)


# -- 6. Timeouts -------------------------------------------------------------------


def _hang_bootstrap(dask_worker):  # type: ignore[no-untyped-def]
    plugin = dask_worker.plugins["mpshuffle"]
    release = asyncio.Event()
    dask_worker.mpshuffle_release = release

    async def hang(spec: Any) -> None:
        await release.wait()

    dask_worker.handlers["mpshuffle_bootstrap"] = hang
    dask_worker.mpshuffle_restore = plugin.bootstrap


def _unhang_bootstrap(dask_worker):  # type: ignore[no-untyped-def]
    dask_worker.handlers["mpshuffle_bootstrap"] = dask_worker.mpshuffle_restore
    dask_worker.mpshuffle_release.set()


def test_bootstrap_timeout_names_missing_ranks(client: Client) -> None:
    bootstrap_dask_cluster(client)
    workers = worker_addresses(client)
    client.run(_hang_bootstrap, workers=[workers[1]])
    try:
        with pytest.raises(BootstrapError) as info:
            bootstrap_dask_cluster(client, bootstrap_timeout=1)
    finally:
        client.run(_unhang_bootstrap, workers=[workers[1]])
    msg = str(info.value)
    assert f"rank 1 (worker {workers[1]}) did not arrive within 1 s" in msg
    assert f"rank 1 (worker {workers[1]}): TimeoutError" in msg
    assert f"rank 0 (worker {workers[0]}): BootstrapError: " in msg
    # The failed generation is closed on the rank that joined it; the previous one stays current.
    assert bootstrap_dask_cluster(client, bootstrap_timeout=30).id == _state(client)["generation"]
    _assert_clean(client)


def test_barrier_timeout_names_missing_rank(client: Client) -> None:
    bootstrap_dask_cluster(client, timeout=2)
    workers = worker_addresses(client)
    client.run(_swallow, "inputs-done", workers=[workers[1]])
    pdf = _frame()
    with pytest.raises(Exception, match=rf"barrier phase.*rank 1 \(worker {workers[1]}\) did not confirm the barrier within 2 s"):
        shuffle(dd.from_pandas(pdf, npartitions=3), "k", npartitions=2).compute()
    bootstrap_dask_cluster(client, timeout=60)  # a fresh generation without the fault
    _check(shuffle(dd.from_pandas(pdf, npartitions=3), "k", npartitions=2).compute(), pdf)
    _assert_clean(client)


# -- 7. Never block the worker ------------------------------------------------------


def _barrier_processing(dask_scheduler):  # type: ignore[no-untyped-def]
    for k, ts in dask_scheduler.tasks.items():
        if isinstance(k, str) and k.startswith("mpshuffle-barrier") and ts.state == "processing":
            return ts.processing_on.address
    return None


def test_worker_answers_while_barrier_waits(client: Client) -> None:
    bootstrap_dask_cluster(client, timeout=60)
    workers = worker_addresses(client)
    client.run(_swallow, "inputs-done", workers=[workers[1]])
    fut = client.compute(shuffle(dd.from_pandas(_frame(), npartitions=3), "k", npartitions=2))
    waiting_on = _wait_for(lambda: client.run_on_scheduler(_barrier_processing), "the barrier to wait")
    _wait_for(lambda: _swallowed(client, workers[1]), "the missing rank to drop inputs-done")
    assert client.run(lambda: 1) == {w: 1 for w in workers}
    seen = client.run_on_scheduler(lambda dask_scheduler, w=waiting_on: dask_scheduler.workers[w].last_seen)
    _wait_for(
        lambda: client.run_on_scheduler(lambda dask_scheduler, w=waiting_on: dask_scheduler.workers[w].last_seen)
        > seen,
        "a heartbeat of the waiting worker",
    )
    assert _state(client)["runs"] and not fut.done()  # still waiting at the barrier
    fut.cancel()
    del fut
    client.run(_unswallow, workers=[workers[1]])
    bootstrap_dask_cluster(client, timeout=300)
    _assert_clean(client)


# -- 8. Security ------------------------------------------------------------------


def test_tls_cluster() -> None:
    from distributed.security import Security

    sec = Security.temporary()
    pdf = _frame()
    with LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0", security=sec, memory_limit="2GiB"
    ) as cluster, Client(cluster, security=sec) as client:
        assert cluster.scheduler_address.startswith("tls://")
        bootstrap_dask_cluster(client)
        addresses = client.run(lambda dask_worker: get_worker_context(dask_worker).comm.addresses)
        assert all(a.startswith("tls://") for table in addresses.values() for a in table)
        _check(shuffle(dd.from_pandas(pdf, npartitions=4), "k", npartitions=3).compute(), pdf)
        _assert_clean(client)


def _capture_refusals(dask_worker):  # type: ignore[no-untyped-def]
    import logging

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Keep(logging.WARNING)
    logging.getLogger("mpshuffle.comm.tcp").addHandler(handler)
    dask_worker.mpshuffle_log = (handler, records)


def _refusals(dask_worker):  # type: ignore[no-untyped-def]

    _, records = dask_worker.mpshuffle_log
    return [r for r in records if "refused connection" in r]


def _drop_capture(dask_worker):  # type: ignore[no-untyped-def]
    import logging

    logging.getLogger("mpshuffle.comm.tcp").removeHandler(dask_worker.mpshuffle_log[0])


def _rss(dask_worker):  # type: ignore[no-untyped-def]
    import psutil

    return psutil.Process().memory_info().rss


def _announce_huge(host: str, port: int) -> None:
    """A stranger announces a 512 MiB message where the handshake belongs, then sends 128 MiB."""
    chunk = b"\0" * (1 << 20)
    with socket.create_connection((host, port), timeout=10) as s:
        try:
            s.sendall((512 << 20).to_bytes(8, "little"))
            for _ in range(128):
                s.sendall(chunk)
        except OSError:  # refused: the rank closed the connection
            pass


def test_garbage_on_a_communicator_port_is_refused(client: Client) -> None:
    """Garbage and a huge announced message on a rank's port: refused, logged, no memory taken.

    The announcement grew a worker from 309 to 821 MiB before the
    communicator bounded what a connection not yet known may make it read.
    """
    bootstrap_dask_cluster(client, timeout=60)
    pdf = _frame()
    comm_addresses = client.run(lambda dask_worker: get_worker_context(dask_worker).comm.addresses[
        get_worker_context(dask_worker).rank])
    client.run(_capture_refusals)
    try:
        df, go = _held(pdf, 4)
        fut = client.compute(shuffle(df, "k", npartitions=3))
        _wait_for(lambda: _state(client)["runs"], "the run to start")
        rss = client.run(_rss)
        for address in comm_addresses.values():
            host, port = address.removeprefix("tcp://").rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=10) as s:
                s.sendall(b"GARBAGE!" * 8)
            _announce_huge(host, int(port))
        _wait_for(lambda: all(len(r) == 2 for r in client.run(_refusals).values()), "the refusals to be logged")
        grown = {w: n - rss[w] for w, n in client.run(_rss).items()}
        assert all(g < 32 << 20 for g in grown.values()), grown
        Event(go, client=client).set()
        _check(fut.result(timeout=60), pdf)
        del fut
    finally:
        client.run(_drop_capture)
    _assert_clean(client)
