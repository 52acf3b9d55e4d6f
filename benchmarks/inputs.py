"""Input partitions the benchmarks make on the workers, importable there by name.

A function defined in a script's ``__main__`` is pickled by value with every
task that calls it (cloudpickle cannot name it), which costs the client and
scheduler milliseconds per task and would be counted against whichever
shuffle runs. A function in this module is pickled by reference: the
workers import it (``benchmarks/`` is on their path, as it is on the
script's; LocalCluster's spawned workers inherit ``sys.path``).
"""

from __future__ import annotations

import numpy as np
import pandas as pd


def make_partition(i: int, rows: int) -> pd.DataFrame:
    """Input partition ``i`` of ``rows`` rows: ``int64`` keys uniform in ``[0, 2**40)``, ``float64`` values.

    Seeded by ``i``, so a recomputed partition is the same.
    """
    rng = np.random.default_rng(i)
    return pd.DataFrame({"key": rng.integers(0, 2**40, rows), "v": rng.random(rows)})


def placeholder(_: object, i: int) -> int:
    """A task that does nothing but return ``i`` (partitions_bench's floor graph)."""
    return i


def placeholder_of_partition(i: int, rows: int) -> int:
    """Make input partition ``i`` and return ``i``: an input task with the insert's place fused in."""
    make_partition(i, rows)
    return i


def placeholder_barrier(*inserted: object) -> int:
    """A task that waits for all of ``inserted`` and returns how many there were."""
    return len(inserted)
