"""Compiled kernels of the insert: the fused hash, the counting sort, the scatter.

Every kernel is a numba ``@njit(nogil=True, cache=True)`` function at module
level of :mod:`mpshuffle.table._insert_kernels` (and :mod:`mpshuffle.table._gather`):
it releases the GIL (several task threads of one worker run their inserts at
once) and is compiled once per machine into numba's cache next to its file.
numba is imported when the kernels are first used, not by ``import mpshuffle``.

The hash is the one :mod:`mpshuffle.table.hashing` documents: the 8 bytes of
each value (as ``int64``, or ``float64`` bits with ``-0.0`` -> ``0.0``)
mixed by pandas' ``hash_array`` finalizer (``x ^= x >> 30; x *= C1;
x ^= x >> 27; x *= C2; x ^= x >> 31``, C1/C2 from Vigna's splitmix64), null
values :data:`NULL_HASH`, columns combined as ``acc * M ^ h``, the id
``acc % npartitions``. ``tests/engine/test_kernels.py`` checks every kernel
against the numpy/pandas path value by value.

The kernels ``pandas_values`` and ``pandas_given`` compute the other rule of
:mod:`mpshuffle.table.hashing`, pandas' row hash (``hash_pandas_object(keys,
index=False)``, the rule of Dask's ``partitioning_index``): per column the
float64 bits of each value (NaN as pandas' one NaN, ``-0.0`` as ``0.0``)
through the same finalizer, or hashes given; columns combined as pandas'
``combine_hash_arrays`` does (``acc = 0x345678``; per column ``acc = (acc ^
h) * mult``; then ``acc + 97531``); the id ``acc % npartitions``.

The scatter is one stable counting sort: the hash pass also counts rows per
partition and gives each row its rank within its partition (rows keep their
input order), so each column is then written once, straight to its place in
its destination piece.
"""

from __future__ import annotations

from functools import cache
from types import SimpleNamespace
from typing import Any

__all__ = ["kernels"]

# pandas.core.util.hashing._hash_ndarray's finalizer constants (splitmix64).
_C1 = 0xBF58476D1CE4E5B9
_C2 = 0x94D049BB133111EB
_M = 0x9E3779B97F4A7C15  # hashing.COMBINE_MULTIPLIER
_NULL = 0x9E3779B97F4A7C15  # _canonical.NULL_HASH
_SIGN = 0x8000000000000000
_ABS = 0x7FFFFFFFFFFFFFFF
_INF_BITS = 0x7FF0000000000000
# pandas.core.util.hashing.combine_hash_arrays' start and end constants, and
# the bits of float64 NaN as numpy writes np.nan (pandas hashes every NaN so).
_PD_START = 0x345678
_PD_END = 97531
_NAN_BITS = 0x7FF8000000000000

# Modes of a hash pass: the first key column sets the accumulator, later ones
# combine into it; the last one also writes ids, ranks and counts.
FIRST, COMBINE, FIRST_FINAL, COMBINE_FINAL = 0, 1, 2, 3


@cache
def kernels() -> Any:
    """Load (from numba's cache, or compile) and return the kernels as a namespace."""
    from mpshuffle.table import _insert_kernels as k

    # The gather of an extract reads pieces by address (mpshuffle.table._gather).
    from mpshuffle.table._gather import gather_bits, gather_bytes, gather_offsets, layouts

    return SimpleNamespace(
        hash_ints=k.hash_ints, hash_float_bits=k.hash_float_bits, hash_given=k.hash_given,
        pandas_values=k.pandas_values, pandas_given=k.pandas_given,
        rank_ids=k.rank_ids, scatter=k.scatter, scatter_bits=k.scatter_bits, var_sizes=k.var_sizes,
        scatter_var=k.scatter_var, scatter_words=k.scatter_words, gather_bytes=gather_bytes, gather_bits=gather_bits,
        gather_offsets=gather_offsets, layouts=layouts,
    )
