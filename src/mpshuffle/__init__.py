"""mpshuffle: fast, memory-bounded shuffles of dataframe partitions across a Dask cluster.

``import mpshuffle`` stays light; the Dask integration lives in
:mod:`mpshuffle.dask`.
"""

from mpshuffle.errors import (
    BootstrapError,
    CommError,
    CommTimeoutError,
    MPShuffleError,
    OptionError,
    ShuffleError,
    ShuffleTimeoutError,
    SpillError,
)

__version__ = "0.1.0"

# ``df.mpshuffle`` on dask DataFrames, registered once dask.dataframe is imported.
from mpshuffle import _accessor_hook

_accessor_hook.install()

__all__ = [
    "BootstrapError",
    "CommError",
    "CommTimeoutError",
    "MPShuffleError",
    "OptionError",
    "ShuffleError",
    "ShuffleTimeoutError",
    "SpillError",
    "__version__",
]
