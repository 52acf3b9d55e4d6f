"""Core bootstrap behaviour on a LocalCluster of 2 worker processes."""

from __future__ import annotations

import pytest
from distributed import Client

from conftest import wait_for, worker_addresses, worker_state
from mpshuffle.dask import bootstrap_dask_cluster, get_worker_context
from mpshuffle.errors import BootstrapError, OptionError


def _scheduler_state(dask_scheduler):  # type: ignore[no-untyped-def]
    plugin = dask_scheduler.plugins["mpshuffle"]
    return {
        "tasks": len(dask_scheduler.tasks),
        "generation": plugin.generation.id if plugin.generation else None,
        "generations": sorted(plugin.generations),
        "runs": len(plugin.runs),
    }


def _rank_info(dask_worker):  # type: ignore[no-untyped-def]
    ctx = get_worker_context(dask_worker)
    return {"rank": ctx.rank, "nranks": ctx.nranks, "generation": ctx.generation, "workers": list(ctx.workers)}


def test_ranks_follow_sorted_worker_addresses(client: Client) -> None:
    gen = bootstrap_dask_cluster(client)
    workers = worker_addresses(client)
    assert gen.nranks == len(workers) == 2
    assert gen.ranks == {w: r for r, w in enumerate(workers)}
    info = client.run(_rank_info)
    assert {w: i["rank"] for w, i in info.items()} == gen.ranks
    assert {i["generation"] for i in info.values()} == {gen.id}
    assert all(i["nranks"] == 2 and i["workers"] == workers for i in info.values())
    # In a task, the worker is found on its own.
    ranks = client.gather([client.submit(lambda: get_worker_context().rank, workers=[w], pure=False) for w in workers])
    assert ranks == [0, 1]


def test_second_call_reuses_the_generation(client: Client) -> None:
    first = bootstrap_dask_cluster(client)
    again = bootstrap_dask_cluster(client)
    assert again.id == first.id
    assert again.bootstrapped is False
    with Client(client.cluster) as other:
        assert bootstrap_dask_cluster(other).id == first.id


def test_bootstrap_leaves_no_task_and_no_future(client: Client) -> None:
    bootstrap_dask_cluster(client)
    state = client.run_on_scheduler(_scheduler_state)
    assert state["tasks"] == 0
    assert state["runs"] == 0
    assert state["generations"] == [state["generation"]]
    assert not client.futures

    def only_progress_threads() -> bool:
        # The kernels' preload thread (started as the client connected) ends
        # once they are loaded; the progress thread of the generation stays.
        threads = {w: s["threads"] for w, s in client.run(worker_state).items()}
        return all(t == [f"mpshuffle-progress-{state['generation']}-r{r}"] for r, t in enumerate(
            threads[w] for w in sorted(threads)
        ))

    wait_for(only_progress_threads, "each worker's mpshuffle threads to be its progress thread alone")


def _withhold_bootstrap_handler(seconds: float | None, dask_worker):  # type: ignore[no-untyped-def]
    """Take the worker plugin's bootstrap handler away, as before its setup; back after ``seconds`` (or at restore)."""
    import asyncio

    dask_worker.mpshuffle_withheld = handler = dask_worker.handlers.pop("mpshuffle_bootstrap")
    if seconds is not None:
        asyncio.get_running_loop().call_later(seconds, dask_worker.handlers.__setitem__, "mpshuffle_bootstrap", handler)


def _restore_bootstrap_handler(dask_worker):  # type: ignore[no-untyped-def]
    dask_worker.handlers["mpshuffle_bootstrap"] = dask_worker.mpshuffle_withheld


def test_a_worker_whose_plugin_is_still_being_set_up_is_asked_again(client: Client) -> None:
    """Two plugin registrations that cross (a client's preload, then the first shuffle's) leave the
    second one returning before the first has set the plugin up on every worker: the bootstrap
    reaches a worker with no handler yet (CI on the oldest Dask saw it as a TypeError)."""
    first = bootstrap_dask_cluster(client)
    workers = worker_addresses(client)
    client.run(_withhold_bootstrap_handler, 1.0, workers=[workers[1]])
    # Other generation options: a new generation, bootstrapped while rank 1 has no handler for 1 s.
    gen = bootstrap_dask_cluster(client, spill_host=0.3)
    assert gen.bootstrapped and gen.id != first.id
    assert gen.ranks == {w: r for r, w in enumerate(workers)}
    info = client.run(_rank_info)
    assert {i["generation"] for i in info.values()} == {gen.id}


def test_a_worker_without_the_plugin_is_named(client: Client) -> None:
    bootstrap_dask_cluster(client)
    workers = worker_addresses(client)
    client.run(_withhold_bootstrap_handler, None, workers=[workers[1]])
    try:
        with pytest.raises(BootstrapError) as info:
            bootstrap_dask_cluster(client, bootstrap_timeout=1, spill_host=0.35)
    finally:
        client.run(_restore_bootstrap_handler, workers=[workers[1]])
    msg = str(info.value)
    assert (
        f"rank 1 (worker {workers[1]}): BootstrapError: the worker has no mpshuffle_bootstrap handler after 1 s: "
        "mpshuffle's worker plugin is not set up there" in msg
    )
    assert f"rank 0 (worker {workers[0]}): BootstrapError: " in msg
    # Nothing is left behind: with the handler back, the same options bootstrap.
    assert bootstrap_dask_cluster(client, bootstrap_timeout=1, spill_host=0.35).bootstrapped


def test_get_worker_context_outside_a_worker() -> None:
    with pytest.raises(ValueError):
        get_worker_context()


def test_bad_options_are_named(client: Client) -> None:
    with pytest.raises(OptionError, match="bootstrap_timeout"):
        bootstrap_dask_cluster(client, bootstrap_timeout=-1)
    with pytest.raises(OptionError, match="unknown mpshuffle option"):
        bootstrap_dask_cluster(client, timeot=3)
    with pytest.raises(OptionError, match=r"^unknown mpshuffle option\(s\) 'comm'; valid options are: timeout, "):
        bootstrap_dask_cluster(client, comm="local")
    # The refused option changed nothing: the default bootstrap still works.
    assert bootstrap_dask_cluster(client).nranks == 2


def _fail_in_guard(timeout: bool) -> str:
    """In a task: let the worker plugin's phase guard see a failed extract of a made-up run."""
    from distributed import get_worker

    from mpshuffle.dask.runtime import RunInfo
    from mpshuffle.errors import ShuffleError, ShuffleTimeoutError

    worker = get_worker()
    plugin = worker.plugins["mpshuffle"]
    ctx = get_worker_context()
    # A real run on the scheduler (no graph behind it), so that the guard's
    # question to the scheduler about it has an answer.
    run = plugin.get_run(
        f"guard-test-{timeout}", 1, options=ctx.options, extract_name=f"guard-extract-{timeout}",
        barrier_name=f"guard-barrier-{timeout}",
    )
    assert isinstance(run, RunInfo) and run.generation == ctx.generation
    error = ShuffleTimeoutError("data did not arrive within 1 s") if timeout else ShuffleError("the run was released")
    try:
        with plugin.guard("extract", run, ctx):
            raise error
    except ShuffleError as e:
        return str(e)
    return "no error"


def test_only_timeouts_retire_a_generation(client: Client) -> None:
    """Bad data or a released run leaves the generation alone; a rank that timed out retires it."""
    gen = bootstrap_dask_cluster(client)
    msg = client.submit(_fail_in_guard, False, pure=False).result()
    assert msg.startswith("extract phase on rank") and "released" in msg
    again = bootstrap_dask_cluster(client)
    assert again.id == gen.id and not again.bootstrapped
    msg = client.submit(_fail_in_guard, True, pure=False).result()
    assert "did not arrive within 1 s" in msg
    after = bootstrap_dask_cluster(client)
    assert after.bootstrapped and after.id != gen.id

    def forget(dask_scheduler):  # type: ignore[no-untyped-def]
        plugin = dask_scheduler.plugins["mpshuffle"]
        for run in list(plugin.runs.values()):
            plugin._end_run(run)
        return len(plugin.runs)

    assert client.run_on_scheduler(forget) == 0


def _warmed_up() -> float | None:
    from mpshuffle.table.warm import warmed_up

    return warmed_up()


def test_workers_load_the_kernels_when_they_join(client: Client) -> None:
    bootstrap_dask_cluster(client)
    # In the background: the bootstrap returned before it necessarily ended.
    seconds = wait_for(lambda: (s := client.run(_warmed_up)) and all(v is not None for v in s.values()) and s,
                       "every worker to load the kernels")
    assert sorted(seconds) == worker_addresses(client)
    assert all(v > 0 for v in seconds.values())


def test_without_preload_the_first_insert_loads_the_kernels() -> None:
    import dask
    import pandas as pd
    from dask import dataframe as dd
    from distributed import LocalCluster

    from mpshuffle.dask import shuffle

    with (
        dask.config.set({"mpshuffle.preload_kernels": False}),  # as the client starts, too
        LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
                     memory_limit="2GiB") as cluster,
        Client(cluster) as client,
    ):
        assert set(client.run(_warmed_up).values()) == {None}
        bootstrap_dask_cluster(client, preload_kernels=False)
        frame = pd.DataFrame({"k": range(400), "v": [float(i) for i in range(400)]})
        out = shuffle(dd.from_pandas(frame, npartitions=4), "k", npartitions=3).compute()
        assert sorted(out["k"]) == list(range(400))
        assert set(client.run(_warmed_up).values()) == {None}
        # The option travels with the generation: the next one may turn it on.
        bootstrap_dask_cluster(client, preload_kernels=True)
        wait_for(lambda: None not in client.run(_warmed_up).values(), "the kernels to load")


def _hold_back_plugin(seconds: float, dask_worker) -> None:  # type: ignore[no-untyped-def]
    """Take mpshuffle's plugin off this worker and give it back ``seconds`` later.

    As a worker sees it while the scheduler's broadcast of the plugin is still
    on its way (the scheduler answers any later registration at once).
    """
    from mpshuffle.dask.worker import PLUGIN_NAME

    plugin = dask_worker.plugins.pop(PLUGIN_NAME)
    dask_worker.loop.call_later(seconds, dask_worker.plugins.__setitem__, PLUGIN_NAME, plugin)


def test_a_task_that_finds_the_plugin_still_on_its_way_waits_for_it(client: Client) -> None:
    """Seen in the README's one-line adoption: an insert raised KeyError 'mpshuffle'."""
    import numpy as np
    import pandas as pd
    from dask import dataframe as dd

    from mpshuffle.dask import shuffle

    bootstrap_dask_cluster(client)
    worker = worker_addresses(client)[1]
    client.run(_hold_back_plugin, 1.0, workers=[worker])
    frame = pd.DataFrame({"k": np.arange(2000) % 37, "v": np.arange(2000)})
    out = shuffle(dd.from_pandas(frame, npartitions=4), "k", npartitions=3).compute()
    pd.testing.assert_frame_equal(out.sort_values("v").reset_index(drop=True), frame)
    wait_for(
        lambda: all(s["shufflers"] == [] for s in client.run(worker_state).values()),
        "the run to end on every worker",
    )


def test_a_connection_lost_while_the_graph_is_built_leaves_bootstrap_to_the_tasks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Seen by a breaker: a worker killed while the client built its first graph.

    The early registration of the plugins (best effort, at graph-building time)
    raised distributed's ``CommClosedError`` out of ``df.shuffle``; the graph
    must build, and its tasks register the plugins and bootstrap themselves.
    """
    import numpy as np
    import pandas as pd
    from dask import dataframe as dd
    from distributed import LocalCluster
    from distributed.comm.core import CommClosedError

    from mpshuffle.dask import bootstrap, shuffle

    calls: list[str] = []
    register = bootstrap.register_plugins

    def register_once_lost(client: Client) -> object:
        calls.append("register")
        if len(calls) == 1:
            raise CommClosedError("in <TCP (closed) ConnectionPool.register_worker_plugin>: Stream is closed")
        return register(client)

    monkeypatch.setattr(bootstrap, "register_plugins", register_once_lost)
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
                     memory_limit="2GiB") as cluster,
        Client(cluster) as client,
    ):
        frame = pd.DataFrame({"k": np.arange(3000) % 41, "v": np.arange(3000)})
        shuffled = shuffle(dd.from_pandas(frame, npartitions=5), "k", npartitions=4)
        assert calls == ["register"]  # the graph was built past the lost connection
        parts = client.compute(shuffled.to_delayed(), sync=True)
        got = pd.concat(parts)
        pd.testing.assert_frame_equal(got.sort_values("v").reset_index(drop=True), frame)
        homes = [set(p["k"]) for p in parts]
        assert all(not (a & b) for i, a in enumerate(homes) for b in homes[i + 1:])
        assert "mpshuffle" in client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.plugins))


def test_a_starting_client_has_workers_load_the_kernels_before_any_shuffle() -> None:
    """The first shuffle of a fresh cluster paid the kernels' loading in its inserts."""
    import dask
    from distributed import LocalCluster

    import mpshuffle.dask
    from mpshuffle.dask.client_preload import MODULE

    assert MODULE in dask.config.get("distributed.client.preload")
    mpshuffle.dask.client_preload.install()  # idempotent
    assert dask.config.get("distributed.client.preload").count(MODULE) == 1
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
                     memory_limit="2GiB") as cluster,
        Client(cluster) as client,
    ):
        seconds = wait_for(lambda: (s := client.run(_warmed_up)) and None not in s.values() and s,
                           "every worker to load the kernels")
        assert sorted(seconds) == worker_addresses(client)
        # Plugins only: no generation, no communicator, nothing in the task stream.
        state = client.run_on_scheduler(_scheduler_state)
        assert state == {"tasks": 0, "generation": None, "generations": [], "runs": 0}
        assert set(client.run(lambda dask_worker: dask_worker.plugins["mpshuffle"].context).values()) == {None}


def test_the_client_preload_keeps_per_preload_arguments_in_step() -> None:
    """A user's preload-argv as one list per preload: distributed refuses lists of other lengths."""
    import dask

    from mpshuffle.dask.client_preload import MODULE, install

    for argv, expected in [
        ([["--tag", "x"]], [["--tag", "x"], []]),  # one list per preload: one more for mpshuffle's
        (["--tag", "x"], ["--tag", "x"]),  # flat: the same arguments for every preload
        ([], []),
    ]:
        with dask.config.set({"distributed.client.preload": ["mine"], "distributed.client.preload-argv": argv}):
            install()
            assert dask.config.get("distributed.client.preload") == ["mine", MODULE]
            assert dask.config.get("distributed.client.preload-argv") == expected
            install()  # idempotent
            assert dask.config.get("distributed.client.preload-argv") == expected


def _prefix_durations(dask_scheduler) -> dict[str, float | None]:  # type: ignore[no-untyped-def]
    from mpshuffle.dask.scheduler import TASK_DURATIONS

    return {
        name: (p.duration_average if (p := dask_scheduler.task_prefixes.get(name)) is not None else None)
        for name in TASK_DURATIONS
    }


@pytest.mark.parametrize("configured", [None, "3s"])
def test_the_scheduler_estimates_mpshuffle_tasks_until_it_has_timed_them(configured: str | None) -> None:
    """A first graph's inserts were placed as if each took Dask's unknown 500 ms, and moved inputs."""
    import dask
    import numpy as np
    import pandas as pd
    from dask import dataframe as dd
    from distributed import LocalCluster

    from mpshuffle.dask import shuffle
    from mpshuffle.dask.scheduler import TASK_DURATIONS

    user = {"mpshuffle-insert": configured} if configured else {}
    with (
        dask.config.set({"distributed.scheduler.default-task-durations": user}),
        LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
                     memory_limit="2GiB") as cluster,
        Client(cluster) as client,
    ):
        bootstrap_dask_cluster(client)
        before = client.run_on_scheduler(_prefix_durations)
        want = {**TASK_DURATIONS, **({"mpshuffle-insert": 3.0} if configured else {})}
        if configured:
            # The user's estimate is the scheduler's own, read when the prefix is made.
            assert before["mpshuffle-insert"] is None
            before["mpshuffle-insert"] = 3.0
        assert before == want
        frame = pd.DataFrame({"k": np.arange(4000) % 37, "v": np.arange(4000)})
        parts = client.compute(shuffle(dd.from_pandas(frame, npartitions=4), "k", npartitions=3).to_delayed(),
                               sync=True)
        pd.testing.assert_frame_equal(pd.concat(parts).sort_values("v").reset_index(drop=True), frame)
        after = client.run_on_scheduler(_prefix_durations)
        # Timed now: the scheduler's own averages replace the estimates.
        assert after["mpshuffle-insert"] is not None and after["mpshuffle-insert"] != want["mpshuffle-insert"]
        assert after["mpshuffle-extract"] is not None and after["mpshuffle-extract"] != want["mpshuffle-extract"]
        assert after["mpshuffle-rechunk-insert"] == want["mpshuffle-rechunk-insert"]  # not run: still the estimate


def test_a_rank_that_fails_at_once_ends_the_bootstrap_at_once_and_the_next_one_runs(client: Client) -> None:
    # Found by a breaker (session 24): with one fixed port for two workers of
    # one host, one rank cannot listen; the others waited for it until the
    # bootstrap timeout (the error came after 60 s), and the next bootstrap,
    # with the mistake corrected, waited behind them for another 30-60 s.
    import socket
    import time

    import dask

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    t0 = time.monotonic()
    # dask.config, not keyword arguments, which would stay set for the other tests.
    with (
        dask.config.set({"mpshuffle.port": port, "mpshuffle.bootstrap_timeout": 120}),
        pytest.raises(BootstrapError, match="cannot listen") as info,
    ):
        bootstrap_dask_cluster(client)
    # Not the 120 s timeout: the failed rank's error ends the others' waits.
    assert time.monotonic() - t0 < 60, info.value
    assert "did not publish" not in str(info.value) and "did not arrive" not in str(info.value)
    t0 = time.monotonic()
    with dask.config.set({"mpshuffle.bootstrap_timeout": 120}):
        generation = bootstrap_dask_cluster(client)
    assert time.monotonic() - t0 < 60
    assert generation.nranks == len(worker_addresses(client))
