"""mpshuffle's Dask integration: bootstrap, shuffle graphs, DataFrame shuffles.

Importing it adds :mod:`mpshuffle.dask.client_preload` to Dask's
``distributed.client.preload`` (clients started afterwards have their
workers load mpshuffle's kernels ahead of the first shuffle), and makes
``"mpshuffle"`` a shuffle method of Dask's own DataFrame
operations (see :mod:`mpshuffle.dask.method`) and a rechunk method of Dask
arrays (see :mod:`mpshuffle.dask.rechunk`), and registers the
``df.mpshuffle`` accessor on
``dask.dataframe.DataFrame`` (:func:`~mpshuffle.dask.accessor.register_accessor`,
through Dask's public :func:`dask.dataframe.extensions.register_dataframe_accessor`).
Dask offers no entry point that would register an accessor without an import
(its entry-point groups are for ``sizeof`` plugins, backends, ``dask`` CLI
commands and comm backends), and this package imports ``dask.dataframe``
anyway, so its import is the one place that needs no machinery.
"""

from mpshuffle.dask.accessor import register_accessor
from mpshuffle.dask.bootstrap import Generation, bootstrap_dask_cluster, get_worker_context
from mpshuffle.dask.client_preload import install as _install_client_preload
from mpshuffle.dask.dataframe import shuffle
from mpshuffle.dask.graph import ShuffleSpec, shuffle_graph
from mpshuffle.dask.join import merge
from mpshuffle.dask.method import install as _install_method
from mpshuffle.dask.rechunk import install as _install_rechunk
from mpshuffle.dask.sort import set_index, sort_values
from mpshuffle.dask.statistics import gather_statistics

# dataframe.shuffle.method / shuffle_method="mpshuffle" for Dask's own operations.
_install_method()
# array.rechunk.method / x.rechunk(..., method="mpshuffle") for dask arrays.
_install_rechunk()
# Clients started from now on ask workers to load the kernels ahead (distributed.client.preload).
_install_client_preload()

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

# df.mpshuffle, from the first import of mpshuffle.dask on (idempotent).
register_accessor()
