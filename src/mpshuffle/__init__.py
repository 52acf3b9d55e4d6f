"""mpshuffle: fast, memory-bounded shuffles of dataframe partitions across a Dask cluster.

``import mpshuffle`` stays light: it imports neither Dask nor the
engine. The Dask integration lives in :mod:`mpshuffle.dask`; importing it
registers the ``df.mpshuffle`` accessor on dask DataFrames.
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

# The one place the version is written: pyproject.toml reads it from here
# (setuptools' dynamic version), and so does ``mpshuffle --version``.
__version__ = "0.1.0"

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
