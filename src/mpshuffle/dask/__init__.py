"""mpshuffle's Dask integration: bootstrap, shuffle graphs, DataFrame shuffles."""

from mpshuffle.dask.bootstrap import Generation, bootstrap_dask_cluster, get_worker_context
from mpshuffle.dask.dataframe import shuffle
from mpshuffle.dask.graph import ShuffleSpec, shuffle_graph
from mpshuffle.dask.join import merge
from mpshuffle.dask.sort import set_index, sort_values
from mpshuffle.dask.statistics import gather_statistics

__all__ = [
    "Generation",
    "ShuffleSpec",
    "bootstrap_dask_cluster",
    "gather_statistics",
    "get_worker_context",
    "merge",
    "set_index",
    "shuffle",
    "shuffle_graph",
    "sort_values",
]
