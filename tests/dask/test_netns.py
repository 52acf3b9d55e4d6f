"""Several hosts on one machine: each rank in its own network namespace (issue 18).

A scheduler and three ``dask worker --nthreads 1`` processes, each in a
network namespace of its own on a bridge, with ``shared_memory=False`` so
every byte between ranks crosses a link: the harness is ``tests/netns.py``.

Tests: shuffle, merge and sort exact across the links (shuffle and merge
over TLS as well, a sort too); a host's link taken down mid-insert and mid-barrier (by
the worker itself, from its communicator's handler, at a known message) or
mid-extract (after its first output partition is handed out) and brought
back, or flapping for 1 s: after each, the next shuffle is exact and every
worker holds what it held before the fault (mpshuffle's threads,
generations and sockets exactly; the process's threads and fds within a
small bound); a soak of many shuffles and merges on one client with every
worker's threads, open files, RSS and spill directory checked flat.

Needs root and ``ip`` (iproute2); skips with the reason otherwise.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from distributed import Client

from conftest import worker_addresses, worker_state
from mpshuffle.dask import bootstrap_dask_cluster, get_worker_context, merge, shuffle, sort_values
from mpshuffle.errors import ShuffleError
from netns import NWORKERS, TIMEOUT, Hosts, ip, made_hosts


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    """Scheduler and :data:`NWORKERS` workers, each in its own namespace, for a test module."""
    yield from made_hosts(tls=False)


@pytest.fixture(scope="module")
def tls_hosts() -> Iterator[Hosts]:
    """As :func:`hosts`, every connection over TLS (a self-signed certificate, encryption required)."""
    yield from made_hosts(tls=True)


@pytest.fixture
def hclient(hosts: Hosts) -> Iterator[Client]:
    """A client in the root namespace, connected across the bridge; all workers present."""
    yield from _client(hosts)


def _client(hosts: Hosts) -> Iterator[Client]:
    try:
        with Client(hosts.scheduler, timeout=30, security=hosts.security()) as c:
            c.wait_for_workers(NWORKERS, timeout=60)
            yield c
    except Exception:
        print(hosts.logs())
        raise


def _frame(n: int, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame({"k": rng.integers(0, 500, n), "v": np.arange(n), "x": rng.normal(size=n)})


def _rows(df: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    return df.sort_values(by).reset_index(drop=True)


def _nothing_left(client: Client) -> None:
    """No run and no spill file left on any worker, within 10 s.

    The scheduler tells the workers to end a run after the result's graph is
    released, a message behind the result itself: allow it to arrive.
    """
    deadline = time.monotonic() + 10
    while True:
        states = client.run(worker_state)
        assert len(states) == NWORKERS
        if all(s["shufflers"] == [] and s["spill"] == [] for s in states.values()):
            return
        assert time.monotonic() < deadline, states
        time.sleep(0.1)


def _resources(dask_worker: Any = None) -> dict[str, Any]:
    """What a worker process holds (for ``client.run``).

    ``threads`` and ``fds`` count all of the process's; ``sockets`` the fds
    that are sockets; ``rss`` is in bytes. ``progress`` counts mpshuffle's
    progress threads (one per open generation), ``contexts`` the open
    generations, ``comm_sockets`` the connections and listener of every open
    generation's communicator; ``spill`` and ``shufflers`` are
    :func:`conftest.worker_state`'s.
    """
    import threading

    import psutil

    state = worker_state(dask_worker)
    fds = os.listdir("/proc/self/fd")
    sockets = 0
    for fd in fds:
        try:
            sockets += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass  # closed meanwhile (the listing's own fd among them)
    plugin = dask_worker.plugins.get("mpshuffle")
    contexts = list(getattr(plugin, "contexts", {}).values())
    comm_sockets = 0
    for ctx in contexts:
        comm = ctx.comm
        comm_sockets += sum(not c.closed() for c in [*comm._out.values(), *comm._inbound.values()])
        comm_sockets += comm._listener is not None
    return {
        "threads": threading.active_count(),
        "progress": sum(t.name.startswith("mpshuffle-progress") for t in threading.enumerate()),
        "fds": len(fds),
        "sockets": sockets,
        "rss": psutil.Process().memory_info().rss,
        "contexts": len(contexts),
        "comm_sockets": comm_sockets,
        "spill": state["spill"],
        "shufflers": state["shufflers"],
    }


_COUNTED = ("threads", "progress", "fds", "sockets", "contexts", "comm_sockets")


def _leaks(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What ``after`` holds beyond ``before`` (two :func:`_resources` of one worker), past the bounds.

    Bounds, for a worker with one generation open before and after:
    mpshuffle's own threads, generations, communicator sockets, spill
    entries and runs exactly as before (a generation left open would show
    as one more progress thread, one more context and its 3-5 sockets).
    The process's totals may grow by a little that is not mpshuffle's:
    2 threads (asyncio's and distributed's executors start threads on
    demand and keep them) and 6 fds, 4 of them sockets (distributed's
    connection pools replace connections that broke while the link was
    down, and the client's to the worker). A leaked generation or run
    trips the exact counts first.
    """
    problems = []
    for key in ("progress", "contexts", "comm_sockets"):
        if after[key] != before[key]:
            problems.append(f"{key} {before[key]} -> {after[key]}")
    if after["spill"] or after["shufflers"]:
        problems.append(f"left: spill {after['spill']}, shufflers {after['shufflers']}")
    for key, slack in (("threads", 2), ("fds", 8), ("sockets", 6)):
        if after[key] > before[key] + slack:
            problems.append(f"{key} {before[key]} -> {after[key]} (more than +{slack})")
    return problems


def _nothing_leaked(client: Client, before: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every worker holds no more than in ``before`` (by address), within 15 s; returns the last look.

    A worker that is not in ``before`` (started again after a fault) is
    compared with a look taken now and one after another shuffle by the
    caller (see :func:`_check_restarted`). Retired generations close
    asynchronously (the scheduler tells the workers once their last run
    ended), hence the wait.
    """
    deadline = time.monotonic() + 15
    while True:
        now = client.run(_resources)
        problems = {w: p for w in now if w in before and (p := _leaks(before[w], now[w]))}
        if not problems:
            return now
        assert time.monotonic() < deadline, (problems, before, now)
        time.sleep(0.2)


@pytest.mark.timeout(180)
def test_shuffle_merge_and_sort_across_namespaces_exactly(hosts: Hosts, hclient: Client) -> None:
    gen = bootstrap_dask_cluster(hclient, timeout=TIMEOUT, shared_memory=False)
    # Every rank is on its own host address, none on loopback.
    assert sorted(a.split("//")[1].rsplit(":", 1)[0] for a in gen.ranks) == sorted(hosts.addresses[1:])
    pdf = _frame(20_000)
    out = shuffle(dd.from_pandas(pdf, npartitions=6), "k", npartitions=7).compute()
    pd.testing.assert_frame_equal(_rows(out, ["v"]), pdf)
    # Every rank sent over its link, nothing through the shared /dev/shm.
    sent = hclient.run(lambda dask_worker: get_worker_context(dask_worker).comm.bytes_sent)
    shared = hclient.run(lambda dask_worker: get_worker_context(dask_worker).comm.bytes_sent_shared)
    assert all(n > 0 for n in sent.values()), sent
    assert set(shared.values()) == {0}, shared

    _merge_and_sort_exactly(pdf, _frame(6000, seed=1))
    _nothing_left(hclient)


def _merge_and_sort_exactly(pdf: pd.DataFrame, left: pd.DataFrame) -> None:
    """A merge of ``left`` with a small right frame, and a sort of ``pdf``: both equal pandas'."""
    right = pd.DataFrame({"k": np.arange(0, 500, 2), "w": np.arange(250) * 10})
    joined = merge(dd.from_pandas(left, npartitions=4), dd.from_pandas(right, npartitions=3), on="k").compute()
    want = left.merge(right, on="k")
    pd.testing.assert_frame_equal(_rows(joined, ["v"])[list(want.columns)], _rows(want, ["v"]))
    ordered = sort_values(dd.from_pandas(pdf, npartitions=5), ["k", "v"]).compute()
    pd.testing.assert_frame_equal(ordered.reset_index(drop=True), pdf.sort_values(["k", "v"]).reset_index(drop=True))


def _cut_own_link_at(kind: str, inner: str, up_after: float | None = None, dask_worker: Any = None) -> None:
    """Fault injection on a worker: when the first ``kind`` message arrives, take this host's link down.

    Runs ``ip link set <inner> down`` inside the worker's own namespace, from
    the communicator's handler, so the cut falls at a known point of the
    shuffle (``"chunk"``: mid-insert; ``"finish"``: a peer done inserting,
    mid-barrier), not after a guessed sleep. Armed for one cut only. With
    ``up_after`` the link comes back that many seconds later by itself (a
    flap); otherwise it stays down until the test brings it up.
    """
    import threading

    ctx = get_worker_context(dask_worker)
    deliver = ctx._on_message
    dask_worker.mpshuffle_cut = False

    def handler(src: int, tag: Any, frames: Any) -> None:
        # A chunk may come alone or with other small ones ("chunks", see SMALL_CHUNK_BYTES).
        if (tag[2] == kind or (kind, tag[2]) == ("chunk", "chunks")) and not dask_worker.mpshuffle_cut:
            dask_worker.mpshuffle_cut = True
            subprocess.run(["ip", "link", "set", inner, "down"], check=True, timeout=10)
            if up_after is not None:
                threading.Timer(up_after, subprocess.run, (["ip", "link", "set", inner, "up"],)).start()
        deliver(src, tag, frames)

    ctx.comm.register_handler("mps", handler)


def _cut_own_link_after_first_extract(inner: str, dask_worker: Any = None) -> None:
    """Fault injection on a worker: take this host's link down once its first output partition is extracted.

    Wraps the rank's extract entry point (:meth:`Shuffler.extract`, which the
    extract task calls) in this worker process only; the cut comes after the
    first call returns. Then the rank has every piece it owns (the wait for
    the data is over, so the cut is not one of data in flight, as mid-barrier
    is), one partition is handed out and held only in this worker's memory,
    the others are not: the extract phase proper. Armed for one cut; the
    wrapper removes itself.
    """
    from mpshuffle.shuffler.host import Shuffler

    original = Shuffler.extract

    def extract(self: Shuffler, partition_id: int) -> Any:
        pieces = original(self, partition_id)
        if Shuffler.extract is extract:
            Shuffler.extract = original
            dask_worker.mpshuffle_cut = True
            subprocess.run(["ip", "link", "set", inner, "down"], check=True, timeout=10)
        return pieces

    dask_worker.mpshuffle_cut = False
    Shuffler.extract = extract


def _log_lines(hosts: Hosts) -> str:
    """mpshuffle's lines and the warnings and errors in every process's log, for a failed test's output."""
    out = []
    for name in sorted(os.listdir(hosts.tmp)):
        path = os.path.join(hosts.tmp, name)
        if name.endswith(".log") and os.path.isfile(path):
            with open(path, errors="replace") as f:
                lines = [ln.rstrip() for ln in f if "mpshuffle" in ln or " - WARNING - " in ln or " - ERROR - " in ln]
            out.append(f"--- {name}\n" + "\n".join(ln for ln in lines if "plugin mpshuffle" not in ln)[-20000:])
    return "\n".join(out)


def _heartbeat_ages(dask_scheduler: Any = None) -> dict[str, float]:
    """Seconds since the scheduler last heard from each worker."""
    from distributed.metrics import time as now

    return {w: now() - ws.last_seen for w, ws in dask_scheduler.workers.items()}


def _heard_again(hosts: Hosts, client: Client, i: int) -> None:
    """Wait until all workers are back (worker ``i`` started again if it gave up) and heartbeating."""
    deadline = time.monotonic() + 30
    while len(worker_addresses(client)) < NWORKERS and time.monotonic() < deadline:
        if hosts.workers[i].poll() is not None:
            hosts.spawn_worker(i)
        time.sleep(0.2)
    client.wait_for_workers(NWORKERS, timeout=60)
    # TCP's retransmission backoff can hold the host's connections a few
    # seconds past the link's return: wait until the scheduler hears every
    # worker again, as a user would see the cluster healthy.
    deadline = time.monotonic() + 30
    while max(client.run_on_scheduler(_heartbeat_ages).values()) > 1.0:
        assert time.monotonic() < deadline, client.run_on_scheduler(_heartbeat_ages)
        time.sleep(0.2)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("kind", "up_after"),
    [("chunk", None), ("finish", None), ("extract", None), ("chunk", 1.0)],
    ids=["insert", "barrier", "extract", "flap-1s"],
)
def test_a_host_link_cut_mid_shuffle_gives_the_exact_result_or_a_clear_error(
    hosts: Hosts, hclient: Client, kind: str, up_after: float | None
) -> None:
    gen = bootstrap_dask_cluster(hclient, timeout=TIMEOUT, shared_memory=False)
    pdf = _frame(30_000, seed=3)
    try:
        out = shuffle(dd.from_pandas(pdf, npartitions=6), "k").compute()
    except BaseException:
        print(_log_lines(hosts))
        raise
    pd.testing.assert_frame_equal(_rows(out, ["v"]), pdf)
    before = hclient.run(_resources)
    by_rank = {r: w for w, r in gen.ranks.items()}
    # Rank 1's host: find its namespace by its address.
    victim = by_rank[1]
    i = hosts.addresses.index(victim.split("//")[1].rsplit(":", 1)[0])
    if kind == "extract":
        hclient.run(_cut_own_link_after_first_extract, hosts.inner[i], workers=[victim])
    else:
        hclient.run(_cut_own_link_at, kind, hosts.inner[i], up_after, workers=[victim])
    t0 = time.monotonic()
    future = hclient.compute(shuffle(dd.from_pandas(pdf, npartitions=6), "k", npartitions=6))
    outcome = "exact"
    try:
        try:
            # Never a hang: a retry after the worker is dropped, or an error.
            out = future.result(timeout=60)
        except ShuffleError as e:
            waited = time.monotonic() - t0
            message = str(e)
            outcome = "error"
            assert message.split(" phase", 1)[0] in ("insert", "barrier", "extract"), message
            assert any(f"rank {r} (worker {w})" in message for r, w in by_rank.items()), message
            assert waited < TIMEOUT + 3, (waited, message)
            if kind == "extract":
                # The watch names the silent rank and the phase its pending task is in.
                assert message.startswith("extract phase"), message
                assert f"rank 1 (worker {victim})" in message, message
        else:
            pd.testing.assert_frame_equal(_rows(out, ["v"]), pdf)  # retried: every row once
    finally:
        ip("-n", hosts.namespaces[i], "link", "set", hosts.inner[i], "up")
    elapsed = time.monotonic() - t0
    future.release()  # the run ends, and its generation closes, once its keys are released
    del future
    print(f"link cut at first {kind!r} on rank 1 (up after {up_after} s): {outcome} after {elapsed:.1f} s")
    assert hclient.run(lambda dask_worker: dask_worker.mpshuffle_cut, workers=[victim])[victim]
    # The host is back: the next shuffle is exact, and nothing is left.
    try:
        _heard_again(hosts, hclient, i)
        out = shuffle(dd.from_pandas(pdf, npartitions=6), "k", npartitions=5).compute()
        pd.testing.assert_frame_equal(_rows(out, ["v"]), pdf)
        _nothing_left(hclient)
        after = _nothing_leaked(hclient, before)
    except BaseException:
        print(_log_lines(hosts))
        raise
    for w in after:
        b, a = before.get(w, {}), after[w]
        print("  " + w + ": " + ", ".join(f"{k} {b.get(k, '-')}->{a[k]}" for k in _COUNTED))
    restarted = set(after) - set(before)
    if restarted:
        # A worker that gave up on the scheduler and was started again has
        # no look from before the fault: one more shuffle must leave it as it is now.
        out = shuffle(dd.from_pandas(pdf, npartitions=6), "k", npartitions=4).compute()
        pd.testing.assert_frame_equal(_rows(out, ["v"]), pdf)
        _nothing_leaked(hclient, {w: after[w] for w in restarted})


SOAK_SHUFFLES = 200  # issue 18's counts; 36 s on 2 cores (load 3)
SOAK_MERGES = 50


@pytest.mark.timeout(600)
def test_soak_many_shuffles_and_merges_stay_flat(hosts: Hosts, hclient: Client) -> None:
    bootstrap_dask_cluster(hclient, timeout=TIMEOUT, shared_memory=False)
    pdf = _frame(5000, seed=7)
    right = pd.DataFrame({"k": np.arange(0, 500, 3), "w": np.arange(167)})
    want_join = _rows(pdf.merge(right, on="k"), ["v"])
    ddf = dd.from_pandas(pdf, npartitions=4)
    dright = dd.from_pandas(right, npartitions=2)

    def one_round(i: int) -> None:
        out = shuffle(ddf, "k", npartitions=3 + i % 4).compute()
        assert len(out) == len(pdf) and out["v"].sum() == pdf["v"].sum()
        if i % (SOAK_SHUFFLES // SOAK_MERGES) == 0:
            joined = merge(ddf, dright, on="k").compute()
            pd.testing.assert_frame_equal(_rows(joined, ["v"])[list(want_join.columns)], want_join)

    for i in range(4):  # warm up: kernels compiled, pools and connections made
        one_round(i)
    before = hclient.run(_resources)
    t0 = time.monotonic()
    for i in range(SOAK_SHUFFLES):
        one_round(i)
    elapsed = time.monotonic() - t0
    after = hclient.run(_resources)
    print(f"soak: {SOAK_SHUFFLES} shuffles, {SOAK_MERGES} merges in {elapsed:.1f} s")
    for w in before:
        b, a = before[w], after[w]
        print(f"  {w}: threads {b['threads']}->{a['threads']} fds {b['fds']}->{a['fds']} "
              f"rss {b['rss'] / 2**20:.0f}->{a['rss'] / 2**20:.0f} MiB")
        # Bounds: a thread or fd per shuffle would add 200; allocator noise
        # stays well under 64 MiB for frames of a few hundred KiB
        # (benchmarks/soak_bench.py measured +3-5 MiB per 100 shuffles).
        assert a["threads"] <= b["threads"] + 2, (w, b, a)
        assert a["fds"] <= b["fds"] + 8, (w, b, a)
        assert a["rss"] - b["rss"] < 64 * 2**20, (w, b, a)
        assert a["spill"] == [] and a["shufflers"] == [], (w, a)


@pytest.fixture
def tls_client(tls_hosts: Hosts) -> Iterator[Client]:
    """A client of :func:`tls_hosts`, as :func:`hclient`."""
    yield from _client(tls_hosts)


@pytest.mark.timeout(180)
def test_shuffle_merge_and_sort_across_namespaces_over_tls_exactly(tls_client: Client) -> None:
    client = tls_client
    gen = bootstrap_dask_cluster(client, timeout=TIMEOUT, shared_memory=False)
    assert all(a.startswith("tls://") for a in gen.ranks), gen.ranks
    listening = client.run(lambda dask_worker: str(get_worker_context(dask_worker).comm.addresses))
    assert all("tls://" in a and "tcp://" not in a for a in listening.values()), listening
    pdf = _frame(20_000, seed=5)
    out = shuffle(dd.from_pandas(pdf, npartitions=6), "k", npartitions=7).compute()
    pd.testing.assert_frame_equal(_rows(out, ["v"]), pdf)
    # A merge, and a sort (its sample and range partitioner), over TLS too.
    _merge_and_sort_exactly(pdf, _frame(4000, seed=6))
    sent = client.run(lambda dask_worker: get_worker_context(dask_worker).comm.bytes_sent)
    assert all(n > 0 for n in sent.values()), sent
    _nothing_left(client)
