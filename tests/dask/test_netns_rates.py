"""Several hosts on one machine with rate-limited links (issue 18).

The namespace cluster of ``tests/netns.py`` (a scheduler and three workers,
each in its own network namespace on a bridge, ``shared_memory=False``),
every host's link limited by :meth:`netns.Hosts.limit_rate` (a ``tbf``
qdisc on both ends of its veth pair) to 10 Gbit/s and to 1 Gbit/s: a
shuffle and a merge give exactly pandas' rows, every byte that a rank's
communicator sends crosses its host's limit, the limit held traffic back,
and the shuffle took no less time than its bytes need at that rate. Only a
lower bound on time is asserted: speed is what ``benchmarks/netns_bench.py``
measures.

Needs root, ``ip`` and ``tc`` (iproute2); skips with the reason otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from distributed import Client, wait

from mpshuffle.dask import bootstrap_dask_cluster, get_worker_context, merge, shuffle
from netns import NWORKERS, TIMEOUT, Hosts, can_limit_rate, made_hosts, rate_burst, tc

#: Of the time a limit allows, the part a shuffle must at least take: tc
#: rounds the rate to its own table (a few per cent), so the bound is not
#: drawn at the rate itself.
SAFETY = 0.8


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    """Scheduler and :data:`NWORKERS` workers, each in its own namespace, for this module."""
    reason = can_limit_rate()
    if reason:
        pytest.skip(reason)
    yield from made_hosts(tls=False)


@pytest.fixture
def hclient(hosts: Hosts) -> Iterator[Client]:
    try:
        with Client(hosts.scheduler, timeout=30) as c:
            c.wait_for_workers(NWORKERS, timeout=60)
            yield c
    except Exception:
        print(hosts.logs())
        raise


@contextmanager
def limited(hosts: Hosts, bits_per_s: float) -> Iterator[None]:
    """Every host's link at ``bits_per_s`` inside the block; unlimited after it, on failure too."""
    try:
        hosts.limit_rate(bits_per_s)
        yield
    finally:
        hosts.unlimit()


def _part(seed: int, n: int) -> pd.DataFrame:
    """Input partition ``seed``: ``n`` rows of 32 bytes, ``v`` unique across partitions (made on a worker)."""
    rng = np.random.default_rng(seed)
    return pd.DataFrame(
        {"k": rng.integers(0, 5000, n), "v": np.arange(n) + seed * 10**9, "x": rng.normal(size=n), "y": rng.random(n)}
    )


def _input(seeds: list[int], n: int) -> tuple[pd.DataFrame, dd.DataFrame]:
    """The same rows as one pandas frame and as a Dask frame whose partitions the workers make."""
    return pd.concat([_part(s, n) for s in seeds], ignore_index=True), dd.from_map(_part, seeds, n=n)


def _rows(df: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    return df.sort_values(by).reset_index(drop=True)


def _comm_bytes(dask_worker: Any = None) -> tuple[int, int]:
    comm = get_worker_context(dask_worker).comm
    return comm.bytes_sent, comm.bytes_received


def _host_index(hosts: Hosts, worker: str) -> int:
    """Which namespace a worker address (``tcp://10.77.X.Y:port``) is in."""
    return hosts.addresses.index(worker.split("//")[1].rsplit(":", 1)[0])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("bits_per_s", [10e9, 1e9], ids=["10gbit", "1gbit"])
def test_shuffle_and_merge_exact_on_limited_links(hosts: Hosts, hclient: Client, bits_per_s: float) -> None:
    bootstrap_dask_cluster(hclient, timeout=TIMEOUT, shared_memory=False)
    # 1.2 M rows of 32 bytes: about 25 MB change hosts, in mpshuffle's 4 MiB
    # batches, each larger than the 1 Gbit/s bucket (1.25 MB).
    pdf, ddf = _input(list(range(6)), 200_000)
    left, dleft = _input([10, 11, 12, 13], 75_000)
    right = pd.DataFrame({"k": np.arange(0, 5000, 2), "w": np.arange(2500) * 10})
    # The inputs are made on the workers before the links are limited.
    ddf, dleft, dright = hclient.persist([ddf, dleft, dd.from_pandas(right, npartitions=3)])
    wait([ddf, dleft, dright])

    with limited(hosts, bits_per_s):
        before_comm = hclient.run(_comm_bytes)
        before_tc = hosts.rate_counters()
        t0 = time.perf_counter()
        out = shuffle(ddf, "k", npartitions=7).persist()
        wait(out)
        elapsed = time.perf_counter() - t0
        after_comm = hclient.run(_comm_bytes)
        after_tc = hosts.rate_counters()
        joined = merge(dleft, dright, on="k").persist()
        wait(joined)
    # Limits removed: no tbf left on either end of any link.
    for i, ns in enumerate(hosts.namespaces):
        assert "tbf" not in tc("-n", ns, "qdisc", "show", "dev", hosts.inner[i]).stdout
        assert "tbf" not in tc("qdisc", "show", "dev", hosts.links[i]).stdout
    pd.testing.assert_frame_equal(_rows(out.compute(), ["v"]), pdf)
    want = left.merge(right, on="k")
    pd.testing.assert_frame_equal(_rows(joined.compute(), ["v"])[list(want.columns)], _rows(want, ["v"]))

    burst = rate_burst(bits_per_s)
    need, total = 0.0, 0
    for w in before_comm:
        i = _host_index(hosts, w)
        sent = after_comm[w][0] - before_comm[w][0]
        received = after_comm[w][1] - before_comm[w][1]
        total += sent
        # Every byte the rank sent left through its host's limit (on top: TCP/IP headers, Dask's own traffic).
        up = after_tc[hosts.inner[i]]["sent_bytes"] - before_tc[hosts.inner[i]]["sent_bytes"]
        down = after_tc[hosts.links[i]]["sent_bytes"] - before_tc[hosts.links[i]]["sent_bytes"]
        assert up >= sent and down >= received, (w, sent, up, received, down)
        # A limit passes at most its bucket at once and then ``rate``: a
        # rank's bytes need at least this long on its uplink and downlink.
        need = max(need, (max(sent, received) - burst) * 8 / bits_per_s)
    # Two thirds of the 38 MB input change hosts, however Dask placed the partitions.
    assert total > 2 / 3 * 0.9 * len(pdf) * 32, total
    print(f"{bits_per_s / 1e9:g} Gbit/s: {total / 1e6:.1f} MB across links, shuffle {elapsed:.3f} s, the limit allows it no less than {need:.3f} s")
    assert elapsed >= SAFETY * need, (elapsed, need)
    if bits_per_s <= 1e9:
        # A 4 MiB batch written at memory speed outruns a 1.25 MB bucket: the limit had to hold it.
        held = sum(after_tc[d]["overlimits"] - before_tc[d]["overlimits"] for d in after_tc)
        assert held > 0, (before_tc, after_tc)


def test_limit_rate_refuses_what_it_cannot_do(hosts: Hosts) -> None:
    with pytest.raises(ValueError, match="at least 1e6 bits/s"):
        hosts.limit_rate(5e5)
    with pytest.raises(ValueError, match="no host 9"):
        hosts.limit_rate(1e9, 9)
    assert hosts.limited == set()
    hosts.limit_rate(2e9, 1)  # one host only: its link's two ends, nothing else
    try:
        assert sorted(hosts.rate_counters()) == sorted([hosts.inner[1], hosts.links[1]])
        assert "rate 2Gbit" in tc("qdisc", "show", "dev", hosts.links[1]).stdout
        assert "tbf" not in tc("qdisc", "show", "dev", hosts.links[2]).stdout
    finally:
        hosts.unlimit()
    assert "tbf" not in tc("qdisc", "show", "dev", hosts.links[1]).stdout
