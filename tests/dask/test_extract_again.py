"""An output partition asked for again after its rank handed it out: the shuffle runs again.

A rank frees a run's state once it has handed out its last output partition.
If Dask later needs one of those partitions again while the barrier's result
is still in memory (its output was released, lost or cancelled, and is
computed again), only the extract task reruns, and the rank no longer holds
the data. It must not fail with "already finished": the run is restarted and
the partition comes out right.
"""

from __future__ import annotations

import time

import dask.dataframe as dd
import numpy as np
import pandas as pd
from distributed import Client, wait

from mpshuffle.dask import bootstrap_dask_cluster, shuffle
from mpshuffle.table.hashing import partition_ids


def _forgotten(client: Client, key: object) -> bool:
    return client.run_on_scheduler(lambda dask_scheduler: key not in dask_scheduler.tasks)


def test_extract_computed_again_after_its_run_ended_restarts_the_run(client: Client) -> None:
    bootstrap_dask_cluster(client)
    pdf = pd.DataFrame({"k": np.arange(3000) % 211, "v": np.arange(3000)})
    src = dd.from_pandas(pdf, npartitions=6).persist()
    wait(src)
    out = shuffle(src, on="k", npartitions=4, ignore_index=True)
    graph = dict(out.__dask_graph__())
    keys = out.__dask_keys__()
    barrier = next(k for k in graph if isinstance(k, str) and "-barrier-" in k)
    held = client.get(graph, [barrier, *keys], sync=False)
    wait(held)
    # Every rank has handed out all its partitions (its run state is gone);
    # the barrier's result stays in memory. Partition 1 is released ...
    first = held[2].result()
    del held[2]
    for _ in range(100):
        if _forgotten(client, keys[1]):
            break
        time.sleep(0.05)
    # ... and computed again: only its extract task reruns.
    again = client.get(graph, keys[1])
    want = pdf[partition_ids(pdf[["k"]], 4) == 1]
    for got in (first, again):
        assert sorted(got["v"].tolist()) == sorted(want["v"].tolist())
    # The other partitions (recomputed with the run, or kept) are still right.
    for j, fut in zip([0, 2, 3], [held[1], held[2], held[3]], strict=True):
        assert sorted(fut.result()["v"].tolist()) == sorted(pdf[partition_ids(pdf[["k"]], 4) == j]["v"].tolist())
