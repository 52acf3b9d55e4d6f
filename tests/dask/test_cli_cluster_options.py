"""The options each run uses, on a cluster of ``dask scheduler`` and ``dask worker`` processes.

A LocalCluster shares the client's process (and its dask.config) with the
scheduler, so it cannot tell which process's configuration a run read. Here
the scheduler and the workers are processes of their own, started from the
command line, each with a configuration of its own that differs from the
client's (``DASK_MPSHUFFLE__*`` in their environment). The rule held here:
every option is the client's, decided where the graph is built; only the
worker options (``spill_dir``, ``listen_interface``, ``port``) that the client
leaves unset come from each worker's own configuration.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from distributed import Client

import mpshuffle.dask  # noqa: F401  (the "mpshuffle" shuffle method)
from mpshuffle.dask import bootstrap_dask_cluster, gather_statistics, shuffle
from mpshuffle.table.hashing import partition_ids

# What the scheduler's and the workers' own configurations say: a run never
# takes these (but for the worker's spill_dir, where the client sets none).
SCHEDULER_ENV = {"DASK_MPSHUFFLE__TIMEOUT": "55", "DASK_MPSHUFFLE__SPILL_HOST": "555555"}
WORKER_ENV = {
    "DASK_MPSHUFFLE__TIMEOUT": "99", "DASK_MPSHUFFLE__SPILL_HOST": "999999",
    "DASK_MPSHUFFLE__BATCH_BYTES": "99999",
}


def _environment(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_MPSHUFFLE__")}
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def cli_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """``dask scheduler`` and two ``dask worker`` processes, each with its own mpshuffle config."""
    root = tmp_path_factory.mktemp("cli-cluster")
    scheduler_file = root / "scheduler.json"
    worker_spill = root / "worker-spill"
    worker_spill.mkdir()
    dask_cli = [sys.executable, "-m", "dask"]
    procs = [subprocess.Popen(
        [*dask_cli, "scheduler", "--scheduler-file", str(scheduler_file), "--port", "0",
         "--dashboard-address", ":0", "--host", "127.0.0.1"],
        env=_environment(SCHEDULER_ENV), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )]
    try:
        deadline = time.monotonic() + 60
        while not scheduler_file.exists() or not scheduler_file.read_text().strip():
            assert time.monotonic() < deadline, "dask scheduler did not write its scheduler file"
            assert procs[0].poll() is None, "dask scheduler exited"
            time.sleep(0.1)
        env = _environment({**WORKER_ENV, "DASK_MPSHUFFLE__SPILL_DIR": str(worker_spill)})
        for _ in range(2):
            procs.append(subprocess.Popen(
                [*dask_cli, "worker", "--scheduler-file", str(scheduler_file), "--nthreads", "1",
                 "--dashboard-address", ":0", "--host", "127.0.0.1", "--memory-limit", "2GiB"],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            ))
        address = json.loads(scheduler_file.read_text())["address"]
        with Client(address) as c:
            c.wait_for_workers(2, timeout=60)
        yield {"address": address, "worker_spill": str(worker_spill), "root": root}
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture
def cli_client(cli_cluster: dict[str, Any]) -> Iterator[Client]:
    with Client(cli_cluster["address"]) as c:
        yield c


def _frame(n: int = 3000) -> tuple[pd.DataFrame, dd.DataFrame]:
    pdf = pd.DataFrame({"k": np.arange(n) % 101, "v": np.arange(n, dtype="float64")})
    return pdf, dd.from_pandas(pdf, npartitions=4)


def _check(pdf: pd.DataFrame, parts: list[pd.DataFrame], npartitions: int) -> None:
    got = pd.concat(parts).sort_values(["k", "v"]).reset_index(drop=True)
    pd.testing.assert_frame_equal(got, pdf.sort_values(["k", "v"]).reset_index(drop=True), check_dtype=False)
    for j, part in enumerate(parts):
        assert set(partition_ids(part[["k"]], npartitions)) <= {j}


def _used(stats: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The options of the newest run of the newest generation, on every worker."""
    out = []
    for runs in stats.values():
        assert runs, "a worker ran no shuffle"
        out.append(runs[-1]["options"])
    assert len(out) == 2
    return out


def _shuffle_and_check(client: Client) -> list[dict[str, Any]]:
    pdf, df = _frame()
    out = shuffle(df, "k", npartitions=3, ignore_index=True)
    _check(pdf, list(client.compute(out.to_delayed(), sync=True)), 3)
    return _used(gather_statistics(client))


def test_keyword_arguments_of_bootstrap_are_the_runs_options(cli_client: Client, cli_cluster: dict[str, Any]) -> None:
    bootstrap_dask_cluster(cli_client, timeout=7, spill_host=123456)
    for used in _shuffle_and_check(cli_client):
        assert (used["timeout"], used["spill_host"], used["host_budget"]) == (7.0, 123456, 123456)
        # The client left spill_dir unset: the worker's own config says where.
        assert used["spill_dir"] == cli_cluster["worker_spill"]
        assert used["batch_bytes"] == 4 * 2**20  # the client's default, not the worker's 99999


def test_the_clients_dask_config_when_the_graph_is_built(cli_client: Client, tmp_path: Path) -> None:
    with dask.config.set({"mpshuffle.timeout": 8, "mpshuffle.batch_bytes": "1MiB", "mpshuffle.spill_dir": str(tmp_path)}):
        pdf, df = _frame()
        out = shuffle(df, "k", npartitions=3, ignore_index=True)
    # Computed outside the with block: the graph carries what it was built with.
    _check(pdf, list(cli_client.compute(out.to_delayed(), sync=True)), 3)
    for used in _used(gather_statistics(cli_client)):
        assert (used["timeout"], used["batch_bytes"], used["spill_host"]) == (8.0, 2**20, 0.25)
        assert used["spill_dir"] == str(tmp_path)  # set by the client: the client's
        assert used["host_budget"] == int(0.25 * 2 * 2**30)  # a fraction of the worker's 2 GiB


def test_an_environment_variable_of_the_client(cli_client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DASK_MPSHUFFLE__TIMEOUT", "9")
    monkeypatch.setenv("DASK_MPSHUFFLE__SPILL_HOST", "345678")
    dask.config.refresh()
    try:
        for used in _shuffle_and_check(cli_client):
            assert (used["timeout"], used["spill_host"]) == (9.0, 345678)
    finally:
        monkeypatch.undo()
        dask.config.refresh()


def test_a_setting_changed_between_two_shuffles_applies_to_the_next(cli_client: Client) -> None:
    with dask.config.set({"mpshuffle.spill_host": 123456, "mpshuffle.timeout": 20}):
        first = _shuffle_and_check(cli_client)
        generation = gather_statistics(cli_client)
    with dask.config.set({"mpshuffle.spill_host": 234567, "mpshuffle.timeout": 21}):
        second = _shuffle_and_check(cli_client)
        after = gather_statistics(cli_client)
    assert [u["spill_host"] for u in first] == [123456] * 2 and [u["timeout"] for u in first] == [20.0] * 2
    assert [u["spill_host"] for u in second] == [234567] * 2 and [u["timeout"] for u in second] == [21.0] * 2
    # A budget is a generation's: the second shuffle ran on a new one.
    old = {runs[-1]["generation"] for runs in generation.values()}
    new = {runs[-1]["generation"] for runs in after.values()}
    assert len(old) == len(new) == 1 and old != new
    # Only a run option changed: same generation.
    with dask.config.set({"mpshuffle.spill_host": 234567, "mpshuffle.timeout": 22}):
        third = _shuffle_and_check(cli_client)
        same = gather_statistics(cli_client)
    assert [u["timeout"] for u in third] == [22.0] * 2
    assert {runs[-1]["generation"] for runs in same.values()} == new


def test_an_asynchronous_client(cli_cluster: dict[str, Any]) -> None:
    async def run() -> list[dict[str, Any]]:
        async with Client(cli_cluster["address"], asynchronous=True) as client:
            with dask.config.set({"mpshuffle.timeout": 11, "mpshuffle.spill_host": 456789}):
                pdf, df = _frame()
                out = shuffle(df, "k", npartitions=3, ignore_index=True)
            parts = await client.gather(client.compute(out.to_delayed()))
            _check(pdf, list(parts), 3)
            return _used(await gather_statistics(client))

    for used in asyncio.run(run()):
        assert (used["timeout"], used["spill_host"]) == (11.0, 456789)


def test_the_one_config_line(cli_client: Client) -> None:
    pdf, df = _frame()
    with dask.config.set({
        "dataframe.shuffle.method": "mpshuffle", "mpshuffle.timeout": 12, "mpshuffle.spill_host": 567890,
    }):
        out = df.shuffle("k", npartitions=3)
        got = out.compute()
    pd.testing.assert_frame_equal(
        got.sort_values(["k", "v"]).reset_index(drop=True), pdf.sort_values(["k", "v"]).reset_index(drop=True)
    )
    stats = gather_statistics(cli_client)
    for used in _used(stats):
        assert (used["timeout"], used["spill_host"], used["batch_bytes"]) == (12.0, 567890, 4 * 2**20)


def test_the_clients_max_npartitions_guards_the_one_config_line(cli_client: Client) -> None:
    # Found by a breaker (session 24): Dask's operations build their tasks on
    # the scheduler, and the limit was read from the scheduler's config there.
    _, df = _frame()
    with dask.config.set({"dataframe.shuffle.method": "mpshuffle", "mpshuffle.max-npartitions": 3}):
        with pytest.raises(ValueError, match=r"npartitions=5 is more than mpshuffle.max-npartitions \(3\)"):
            df.shuffle("k", npartitions=5).compute()
        assert len(df.shuffle("k", npartitions=3).compute()) == len(df)


def test_a_port_range_for_the_communicators(cli_client: Client) -> None:
    import socket

    with socket.socket() as s:  # a free stretch of ports, most likely
        s.bind(("127.0.0.1", 0))
        low = s.getsockname()[1]
    low = min(low, 65000)
    bootstrap_dask_cluster(cli_client, port=f"{low}:{low + 20}", spill_host=111111)
    _shuffle_and_check(cli_client)

    def ports(dask_worker: Any) -> int:
        from distributed.comm.addressing import parse_host_port

        ctx = dask_worker.plugins["mpshuffle"].context
        return int(parse_host_port(ctx.comm.addresses[ctx.rank].split("://")[1])[1])

    got = sorted(cli_client.run(ports).values())
    assert len(set(got)) == 2 and all(low <= p <= low + 20 for p in got), got


def test_an_invalid_worker_setting_fails_the_bootstrap_naming_the_worker(cli_client: Client) -> None:
    # The client's config passes; a worker that cannot resolve a worker option
    # (here: an interface it does not have) answers with an error naming it.
    with pytest.raises(Exception, match=r"listen_interface.*no-such-if0"):
        bootstrap_dask_cluster(cli_client, listen_interface="no-such-if0")
