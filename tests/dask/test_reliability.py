"""Faults found by a break-it run (issue 18), each held with the value it must keep.

One LocalCluster of worker processes per module (conftest's ``cluster``),
scaled where a test needs a worker to leave. Faults are injected with
events, signals a worker sends itself, and subclasses — never by sleeping.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import dask.dataframe as dd
import pandas as pd
from distributed import Client, LocalCluster

from mpshuffle.dask import bootstrap_dask_cluster, get_worker_context, shuffle


def _frame(n: int = 400) -> pd.DataFrame:
    return pd.DataFrame({"k": [i % 37 for i in range(n)], "v": range(n)})


def _check(out: pd.DataFrame, expected: pd.DataFrame) -> None:
    got = out.sort_values("v").reset_index(drop=True)[["k", "v"]]
    pd.testing.assert_frame_equal(got, expected.sort_values("v").reset_index(drop=True)[["k", "v"]])


def _wait_for(predicate: Callable[[], Any], what: str, timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


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
        _wait_for(lambda: len(client.scheduler_info()["workers"]) == 2, "a worker to leave")
        _check(shuffle(dd.from_pandas(pdf, npartitions=4), "k", npartitions=5).compute(), pdf)
        shrunk = _options_everywhere(client)
        assert len(shrunk) == 1 and next(iter(shrunk))[0] not in (first.id, next(iter(grown))[0])
        assert {o[1:] for o in shrunk} == {(7.5, 123_456, 98_765_432)}
        # An explicit bootstrap still chooses new options.
        bootstrap_dask_cluster(client, timeout=9.0)
        assert {o[1] for o in _options_everywhere(client)} == {9.0}
    finally:
        bootstrap_dask_cluster(client)  # the config's options for the module's next tests
