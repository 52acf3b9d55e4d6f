"""Extract tasks run on their owner rank even when their run was made before the graph came.

An insert that keeps running after its computation was cancelled can bind the
graph's token to a run (``get_run``) before the same graph is submitted again;
``get_run`` then found no extract task to pin, and the resubmitted extract
tasks went to whatever worker held the barrier's result, each raising
``Reschedule`` until it landed on its owner (or, when Dask could not place the
reschedule, waiting forever). Here the early binding is made on purpose.
"""

from __future__ import annotations

from typing import Any

import dask.dataframe as dd
import numpy as np
import pandas as pd
from distributed import Client, wait

from mpshuffle.dask import bootstrap_dask_cluster, shuffle
from mpshuffle.options import Options
from mpshuffle.table.hashing import partition_ids


async def _bind_early(dask_scheduler: Any, token: str, n: int, extract_name: str, barrier_name: str) -> dict:
    return await dask_scheduler.plugins["mpshuffle"].get_run(token, n, extract_name, barrier_name, Options().as_dict())


def _extract_moves(dask_scheduler: Any, extract_name: str) -> list[tuple[str, str]]:
    """Transitions out of ``processing`` of the extract tasks other than to memory (reschedules)."""
    return [
        (str(t[0]), t[2]) for t in dask_scheduler.transition_log
        if isinstance(t[0], tuple) and t[0][0] == extract_name and t[1] == "processing" and t[2] != "memory"
    ]


def test_extracts_of_a_run_made_before_its_graph_are_pinned(client: Client) -> None:
    bootstrap_dask_cluster(client)
    pdf = pd.DataFrame({"k": np.arange(4000) % 97, "v": np.arange(4000)})
    a = dd.from_pandas(pdf, npartitions=8).persist()
    wait(a)
    nout = 6
    out = shuffle(a, "k", npartitions=nout, ignore_index=True)
    extract_name = out._name
    token = extract_name.removeprefix("mpshuffle-extract-")
    run = client.run_on_scheduler(
        _bind_early, token=token, n=nout, extract_name=extract_name, barrier_name=f"mpshuffle-barrier-{token}"
    )
    parts = client.compute(out.to_delayed(), sync=True)
    # Every extract ran once, on its owner: none was rescheduled.
    assert client.run_on_scheduler(_extract_moves, extract_name=extract_name) == []
    assert len(run["workers"]) == 2
    got = pd.concat(parts, ignore_index=True).sort_values("v", ignore_index=True)
    pd.testing.assert_frame_equal(got, pdf)
    for j, part in enumerate(parts):
        if len(part):
            assert set(partition_ids(part[["k"]], nout).tolist()) == {j}


def _extract_priorities(dask_scheduler: Any, extract_name: str, n: int) -> list[Any]:
    return [dask_scheduler.tasks[(extract_name, j)].priority for j in range(n)]


def test_extracts_get_their_priorities_in_partition_order(client: Client) -> None:
    """Dask's priorities among a run's extracts go to them by partition id, so each worker extracts in order.

    A rank frees a received chunk once every partition it holds was extracted,
    and chunks hold ranges of neighbouring partitions; in Dask's own order
    (``dask.order`` gives these siblings no partition order) the chunks were
    freed only at the end.
    """
    import dask

    bootstrap_dask_cluster(client)
    pdf = pd.DataFrame({"k": np.arange(6000) % 211, "v": np.arange(6000)})
    a = dd.from_pandas(pdf, npartitions=6).persist()
    wait(a)
    nout = 24
    with dask.config.set({"dataframe.shuffle.method": "mpshuffle"}):
        out = a.shuffle("k", npartitions=nout, ignore_index=True).optimize()
    extract_name = out.__dask_keys__()[0][0]
    out = out.persist()
    wait(out)
    priorities = client.run_on_scheduler(_extract_priorities, extract_name=extract_name, n=nout)
    assert priorities == sorted(priorities) and len(set(priorities)) == nout
    got = pd.concat(client.compute(out.to_delayed(), sync=True), ignore_index=True)
    pd.testing.assert_frame_equal(got.sort_values("v", ignore_index=True), pdf)


def _priorities(dask_scheduler: Any, names: list[str], n: int) -> list[list[Any]]:
    return [[dask_scheduler.tasks[(name, j)].priority for j in range(n)] for name in names]


def _sizes(part: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame({"rows": [len(part)]})


def test_each_output_partitions_consumer_follows_its_extract(client: Client) -> None:
    """The task consuming an output partition runs right after its extract, not after later extracts.

    Reordering the extracts' priorities (above) left each consumer at the
    priority Dask gave it next to another extract, so a worker ran many
    extracts ahead of their consumers and held their outputs (out of core,
    ~25 partitions of 40 MiB on a 1.5 GiB worker).
    """
    bootstrap_dask_cluster(client)
    pdf = pd.DataFrame({"k": np.arange(6000) % 211, "v": np.arange(6000)})
    a = dd.from_pandas(pdf, npartitions=6).persist()
    wait(a)
    nout = 24
    out = shuffle(a, "k", npartitions=nout, ignore_index=True)
    sizes = out.map_partitions(_sizes, meta={"rows": "i8"}).optimize()
    extract_name = out._name
    consumer_name = sizes.__dask_keys__()[0][0]
    assert consumer_name != extract_name
    sizes = sizes.persist()
    wait(sizes)
    extracts, consumers = client.run_on_scheduler(_priorities, names=[extract_name, consumer_name], n=nout)
    assert extracts == sorted(extracts)
    # Each consumer is more urgent than every later extract (it may be more
    # urgent than its own extract too: it waits for it anyway).
    for j in range(nout - 1):
        assert consumers[j] < extracts[j + 1], j
    assert int(sizes.compute()["rows"].sum()) == len(pdf)
