"""mpshuffle's Dask integration: bootstrap, shuffle graphs, DataFrame shuffles."""

from mpshuffle.dask.bootstrap import Generation, bootstrap_dask_cluster, get_worker_context
from mpshuffle.dask.dataframe import shuffle
from mpshuffle.dask.graph import ShuffleSpec, shuffle_graph

__all__ = [
    "Generation",
    "ShuffleSpec",
    "bootstrap_dask_cluster",
    "get_worker_context",
    "shuffle",
    "shuffle_graph",
]
