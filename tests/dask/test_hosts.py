"""Workers on different addresses, and a link cut mid-shuffle (issue 18).

Each worker binds its own loopback address (127.0.0.2, .3, .4: Linux routes
all of 127.0.0.0/8 to the loopback interface, no root needed), so every rank
listens on, and is reached at, an address of its own, as on separate hosts.
Ranks on one machine would exchange large messages through /dev/shm; here
that is turned off (``shared_memory=False``), as between hosts. The workers run in this process so
that a test can cut one link (abort one rank's socket) at a chosen message:
mid-insert, and where only one side of the link sees it break while the
other waits for that side (the break is reported to the scheduler, so the
answer comes well before ``timeout``).

Separate network stacks proper (one network namespace per worker, veth
pairs, ``ip link set ... down``) need root and ``ip netns``; not here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import dask.dataframe as dd
import pandas as pd
import pytest
from distributed import Client, Scheduler, Worker

from mpshuffle.dask import bootstrap_dask_cluster, get_worker_context, shuffle
from mpshuffle.errors import ShuffleError

HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")


def _frame(n: int = 3000) -> pd.DataFrame:
    return pd.DataFrame({"k": [i % 101 for i in range(n)], "v": range(n)})


def _exact(out: pd.DataFrame, expected: pd.DataFrame) -> None:
    got = out.sort_values("v").reset_index(drop=True)[["k", "v"]]
    pd.testing.assert_frame_equal(got, expected.reset_index(drop=True)[["k", "v"]])


def _comm_host(dask_worker: Any) -> str:
    ctx = get_worker_context(dask_worker)
    return str(ctx.comm.addresses[ctx.rank])


def _on_hosts(test: Callable[[Client], Awaitable[None]]) -> None:
    """Run ``test(client)`` against a scheduler and one worker on each of :data:`HOSTS`."""

    async def main() -> None:
        async with Scheduler(host="127.0.0.1", port=0, dashboard_address=":0") as scheduler:
            workers = [Worker(scheduler.address, host=h, nthreads=1, memory_limit="2GiB") for h in HOSTS]
            await asyncio.gather(*workers)
            try:
                async with Client(scheduler.address, asynchronous=True) as client:
                    await test(client)
            finally:
                await asyncio.gather(*(w.close() for w in workers))

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_ranks_on_their_own_addresses_shuffle_exactly() -> None:
    _on_hosts(_shuffle_across_hosts)


async def _shuffle_across_hosts(client: Client) -> None:
    gen = await bootstrap_dask_cluster(client, timeout=20, shared_memory=False)
    assert sorted(a.split("//")[1].rsplit(":", 1)[0] for a in gen.ranks) == list(HOSTS)
    listening = await client.run(_comm_host)
    for worker, address in listening.items():
        # Each rank listens on its worker's own address, not on 127.0.0.1.
        assert address.split("//")[1].rsplit(":", 1)[0] == worker.split("//")[1].rsplit(":", 1)[0]
    pdf = _frame()
    out = await client.compute(shuffle(dd.from_pandas(pdf, npartitions=6), "k", npartitions=7))
    _exact(out, pdf)
    sent = await client.run(lambda dask_worker: get_worker_context(dask_worker).comm.bytes_sent)
    shared = await client.run(lambda dask_worker: get_worker_context(dask_worker).comm.bytes_sent_shared)
    assert all(n > 0 for n in sent.values())  # every rank sent over its sockets
    assert set(shared.values()) == {0}  # and nothing through /dev/shm


def _cut_after_first_chunk(src: int, dask_worker: Any = None) -> None:
    """Fault injection: when the first chunk from rank ``src`` arrives, abort the socket it came on.

    The link from ``src`` to this rank breaks while data is in flight, from
    the receiving side, as a cable pulled would (no goodbye): mid-insert
    where chunks go as they are made, at the end of the inputs where they
    are small and were held (this test's: a few KB per insert).
    """
    ctx = get_worker_context(dask_worker)
    deliver = ctx._on_message
    dask_worker.mpshuffle_cut = False

    def handler(s: int, tag: Any, frames: Any) -> None:
        # "chunks": small chunks held and sent together (at the latest as the inputs end).
        if tag[2] in ("chunk", "chunks") and s == src and not dask_worker.mpshuffle_cut:
            dask_worker.mpshuffle_cut = True
            ctx.comm._inbound[src].abort()
        deliver(s, tag, frames)

    ctx.comm.register_handler("mps", handler)


@pytest.mark.timeout(120)
def test_a_link_cut_mid_insert_gives_the_exact_result_or_a_clear_error_in_time() -> None:
    _on_hosts(_cut_link)


async def _cut_link(client: Client) -> None:
    timeout = 4.0
    gen = await bootstrap_dask_cluster(client, timeout=timeout, shared_memory=False)
    by_rank = {r: w for w, r in gen.ranks.items()}
    pdf = _frame(6000)
    # A first shuffle compiles the insert's kernels, so the timing below is the fault's.
    _exact(await client.compute(shuffle(dd.from_pandas(pdf, npartitions=6), "k", npartitions=6)), pdf)
    await client.run(_cut_after_first_chunk, 0, workers=[by_rank[1]])
    t0 = time.monotonic()
    try:
        out = await client.compute(shuffle(dd.from_pandas(pdf, npartitions=6), "k", npartitions=6))
    except ShuffleError as e:
        waited = time.monotonic() - t0
        message = str(e)
        # Whichever side saw the link break first names the other: rank 0 or rank 1.
        assert message.split(" phase", 1)[0] in ("insert", "barrier", "extract"), message
        assert f"rank 0 (worker {by_rank[0]})" in message or f"rank 1 (worker {by_rank[1]})" in message, message
        # A rank that saw the link break answers at once (every worker still
        # heartbeats, so the scheduler's verdict needs no timeout); a barrier
        # that waits for the rank beyond the cut, after one timeout.
        assert waited < timeout + 3, waited
    else:
        _exact(out, pdf)  # retried: every row once
    assert (await client.run(lambda dask_worker: getattr(dask_worker, "mpshuffle_cut", None)))[by_rank[1]]
    # The generation whose link broke is retired; the next shuffle is exact.
    out = await client.compute(shuffle(dd.from_pandas(pdf, npartitions=6), "k", npartitions=5))
    _exact(out, pdf)
    after = await bootstrap_dask_cluster(client, timeout=timeout, shared_memory=False)
    assert after.id != gen.id


def _break_link_from(peer: int, dask_worker: Any = None) -> None:
    """Fault injection: this rank gives up its link from rank ``peer`` while a run is active on it, unnoticed by ``peer``.

    Holds the run's ``inputs-done`` back until ``peer``'s ``finish`` has
    arrived, then aborts the connection that came on (a reset, as a cable
    pulled would, seen by this rank) and only then delivers ``inputs-done``.
    So the run is active on this rank when the link breaks (its inputs are
    not done: it still owes its finish counts to every rank), and ``peer``
    has written all it will write to this rank (its finish) before the
    reset: ``peer`` notices nothing by itself (its next connection to this
    rank, if any, is opened anew), and without a report it waits for this
    rank's finish counts until ``timeout``.
    """
    ctx = get_worker_context(dask_worker)
    deliver = ctx._on_message
    held: list[tuple[int, Any, Any]] = []
    dask_worker.mpshuffle_cut = False

    def handler(src: int, tag: Any, frames: Any) -> None:
        if dask_worker.mpshuffle_cut:
            deliver(src, tag, frames)
        elif tag[2] == "inputs-done":
            held.append((src, tag, frames))
        elif tag[2] == "finish" and src == peer:
            dask_worker.mpshuffle_cut = True
            ctx.comm._inbound[peer].abort()
            deliver(src, tag, frames)
            for message in held:
                deliver(*message)
        else:
            deliver(src, tag, frames)

    ctx.comm.register_handler("mps", handler)


@pytest.mark.timeout(180)
def test_a_rank_that_sees_its_link_break_fails_the_shuffle_on_every_rank_well_before_timeout() -> None:
    _on_hosts(_link_seen_by_one_rank)


async def _link_seen_by_one_rank(client: Client) -> None:
    timeout = 60.0  # large, so that an answer in under half of it cannot be the timeout's
    gen = await bootstrap_dask_cluster(client, timeout=timeout, shared_memory=False)
    by_rank = {r: w for w, r in gen.ranks.items()}
    pdf = _frame(6000)
    _exact(await client.compute(shuffle(dd.from_pandas(pdf, npartitions=6), "k", npartitions=2)), pdf)
    # Two output partitions on three ranks: rank 2 owns none, so no task of
    # the run is left on it once its inserts are done, and nothing there
    # asks the scheduler about the lost peer.
    await client.run(_break_link_from, 0, workers=[by_rank[2]])
    t0 = time.monotonic()
    with pytest.raises(ShuffleError) as info:
        await client.compute(shuffle(dd.from_pandas(pdf, npartitions=6), "k", npartitions=2))
    waited = time.monotonic() - t0
    message = str(info.value)
    assert (await client.run(lambda dask_worker: dask_worker.mpshuffle_cut, workers=[by_rank[2]]))[by_rank[2]]
    # The phase, and the rank beyond the broken link with its worker: rank 0
    # as rank 2 saw it, or rank 2 if rank 0 wrote to the reset connection
    # first (its acknowledgement, when the barrier task runs on rank 2).
    assert message.split(" phase", 1)[0] in ("insert", "barrier", "extract"), message
    assert (
        f"can no longer reach rank 0 (worker {by_rank[0]})" in message
        or f"can no longer reach rank 2 (worker {by_rank[2]})" in message
    ), message
    assert waited < timeout / 2, (waited, message)
    print(f"link 0 -> 2 broken, seen by rank 2 only: error after {waited:.1f} s (timeout {timeout:g} s): {message}")
    del info  # holds the erred keys
    # The generation is retired; the next shuffle (another graph: the erred
    # one's keys may still be held) bootstraps a new one, with new
    # connections, and is exact.
    _exact(await client.compute(shuffle(dd.from_pandas(pdf, npartitions=6), "k", npartitions=3)), pdf)
    after = await bootstrap_dask_cluster(client, timeout=timeout, shared_memory=False)
    assert after.id != gen.id
