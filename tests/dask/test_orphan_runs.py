"""A run whose graph the scheduler released before the run ended is ended on every rank (issue 18).

A task that still starts after its client released the graph (Dask cannot
stop a task already handed to a worker: an insert queued on a worker when
the computation failed) asks for its run and gets a new one, whose barrier
task the scheduler no longer holds: nothing would ever end it, and its
pieces would stay on every rank (seen after a link cut across network
namespaces). The scheduler plugin's watch ends such a run once its graph
has been gone for the run's ``timeout``. Here the run is made without a
graph on purpose, and made on every rank as the late insert's chunks would.
"""

from __future__ import annotations

from typing import Any

from distributed import Client

from conftest import wait_for, worker_state
from mpshuffle.dask import bootstrap_dask_cluster, get_worker_context


async def _bind(dask_scheduler: Any, token: str) -> dict[str, Any]:
    return await dask_scheduler.plugins["mpshuffle"].get_run(
        token, 4, f"mpshuffle-extract-{token}", f"mpshuffle-barrier-{token}"
    )


def _runs(dask_scheduler: Any) -> list[int]:
    return sorted(r.op_id for r in dask_scheduler.plugins["mpshuffle"].runs.values())


def test_a_run_whose_graph_was_released_is_ended_on_every_rank_after_timeout(client: Client) -> None:
    timeout = 2.0
    bootstrap_dask_cluster(client, timeout=timeout)
    op_id = client.run_on_scheduler(_bind, token="released-graph")["op_id"]
    client.run(lambda dask_worker: get_worker_context(dask_worker).shuffler(op_id) and None)
    assert all(s["shufflers"] == [op_id] for s in client.run(worker_state).values())
    assert client.run_on_scheduler(_runs) == [op_id]
    wait_for(lambda: client.run_on_scheduler(_runs) == [], "the scheduler to end the run", timeout=timeout + 10)
    wait_for(
        lambda: all(s["shufflers"] == [] for s in client.run(worker_state).values()),
        "every rank to free the run", timeout=10,
    )
