"""Runs left over by a fault: a released graph's, and a worker's stale binding (issue 18).

A run whose graph the scheduler released before the run ended is ended on every rank.

A task that still starts after its client released the graph (Dask cannot
stop a task already handed to a worker: an insert queued on a worker when
the computation failed) asks for its run and gets a new one, whose barrier
task the scheduler no longer holds: nothing would ever end it, and its
pieces would stay on every rank (seen after a link cut across network
namespaces). The scheduler plugin's watch ends such a run once its graph
has been gone for the run's ``timeout``. Here the run is made without a
graph on purpose, and made on every rank as the late insert's chunks would.

A worker caches the binding of a graph's token to its run. One whose link
was down can cache a binding to a generation it has closed meanwhile; the
next computation of the same graph must ask the scheduler again, not fail
("no longer holds generation ...", seen across network namespaces).
"""

from __future__ import annotations

from typing import Any

from distributed import Client

from conftest import wait_for, worker_state
from mpshuffle.dask import bootstrap_dask_cluster, get_worker_context
from mpshuffle.options import Options


async def _bind(dask_scheduler: Any, token: str, timeout: float = 300.0) -> dict[str, Any]:
    # As a graph's first task binds it, with the graph's options.
    return await dask_scheduler.plugins["mpshuffle"].get_run(
        token, 4, f"mpshuffle-extract-{token}", f"mpshuffle-barrier-{token}", Options(timeout=timeout).as_dict()
    )


def _runs(dask_scheduler: Any) -> list[int]:
    return sorted(r.op_id for r in dask_scheduler.plugins["mpshuffle"].runs.values())


def test_a_run_whose_graph_was_released_is_ended_on_every_rank_after_timeout(client: Client) -> None:
    timeout = 2.0
    bootstrap_dask_cluster(client, timeout=timeout)
    op_id = client.run_on_scheduler(_bind, token="released-graph", timeout=timeout)["op_id"]
    client.run(lambda dask_worker: get_worker_context(dask_worker).shuffler(op_id) and None)
    assert all(s["shufflers"] == [op_id] for s in client.run(worker_state).values())
    assert client.run_on_scheduler(_runs) == [op_id]
    wait_for(lambda: client.run_on_scheduler(_runs) == [], "the scheduler to end the run", timeout=timeout + 10)
    wait_for(
        lambda: all(s["shufflers"] == [] for s in client.run(worker_state).values()),
        "every rank to free the run", timeout=10,
    )


def _stale_binding(token: str, npartitions: int, dask_worker: Any = None) -> None:
    """Cache, on this worker, a binding of ``token`` to a run of a generation the worker does not hold.

    As a worker whose link was down is left with: the scheduler's answer to
    its question about the run came after it had closed the run's
    generation, so nothing ever removes the binding.
    """
    from mpshuffle.dask.runtime import RunInfo

    plugin = dask_worker.plugins["mpshuffle"]
    workers = get_worker_context(dask_worker).workers
    plugin.runs[token] = RunInfo(token, 10**6, "closed-generation", workers, npartitions, 300.0)


def test_a_stale_binding_to_a_closed_generation_does_not_fail_the_next_computation(client: Client) -> None:
    import dask.dataframe as dd
    import numpy as np
    import pandas as pd

    from mpshuffle.dask import shuffle

    bootstrap_dask_cluster(client)
    pdf = pd.DataFrame({"k": np.arange(3000) % 89, "v": np.arange(3000)})
    out = shuffle(dd.from_pandas(pdf, npartitions=4), "k", npartitions=3)
    token = out._name.removeprefix("mpshuffle-extract-")
    client.run(_stale_binding, token, 3)
    got = out.compute().sort_values("v", ignore_index=True)
    pd.testing.assert_frame_equal(got, pdf)
