"""Compiled kernels of the insert: the fused hash, the counting sort, the scatter.

Every kernel is a numba ``@njit(nogil=True, cache=True)`` function: it
releases the GIL (several task threads of one worker run their inserts at
once) and is compiled once per machine into numba's cache next to this file.
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
    """Compile (or load from numba's cache) and return the kernels as a namespace."""
    import numba
    import numpy as np

    njit = numba.njit(nogil=True, cache=True)
    c1, c2, m, null_hash = np.uint64(_C1), np.uint64(_C2), np.uint64(_M), np.uint64(_NULL)
    sign, abs_mask, inf_bits = np.uint64(_SIGN), np.uint64(_ABS), np.uint64(_INF_BITS)
    u30, u27, u31 = np.uint64(30), np.uint64(27), np.uint64(31)
    pd_start, pd_end, nan_bits = np.uint64(_PD_START), np.uint64(_PD_END), np.uint64(_NAN_BITS)

    @numba.njit(inline="always")
    def mix(x):  # type: ignore[no-untyped-def]
        x ^= x >> u30
        x *= c1
        x ^= x >> u27
        x *= c2
        x ^= x >> u31
        return x

    @numba.njit(inline="always")
    def emit(i, h, mode, acc, npart, pid, rank, counts):  # type: ignore[no-untyped-def]
        if mode == 1 or mode == 3:
            h = (acc[i] * m) ^ h
        if mode >= 2:
            p = h % npart
            pid[i] = p
            rank[i] = counts[p]
            counts[p] += 1
        else:
            acc[i] = h

    @njit
    def hash_ints(values, null, factor, mode, acc, npart, pid, rank, counts):  # type: ignore[no-untyped-def]
        # Integers of any width (uint64 wraps to int64), times ``factor``
        # (nanoseconds per unit of a temporal type); ``null``: 1 = missing,
        # or empty when nothing is.
        has_null = null.shape[0] > 0
        for i in range(values.shape[0]):
            if has_null and null[i]:
                h = null_hash
            else:
                h = mix(np.uint64(np.int64(values[i]) * factor))
            emit(i, h, mode, acc, npart, pid, rank, counts)

    @njit
    def hash_float_bits(bits, null, mode, acc, npart, pid, rank, counts):  # type: ignore[no-untyped-def]
        # float64 values as their uint64 bits: NaN (any payload) is missing,
        # -0.0 hashes as 0.0.
        has_null = null.shape[0] > 0
        for i in range(bits.shape[0]):
            b = bits[i]
            if (b & abs_mask) > inf_bits or (has_null and null[i]):
                h = null_hash
            else:
                if b == sign:
                    b = np.uint64(0)
                h = mix(b)
            emit(i, h, mode, acc, npart, pid, rank, counts)

    @njit
    def hash_given(hashes, mode, acc, npart, pid, rank, counts):  # type: ignore[no-untyped-def]
        # A column hashed elsewhere (strings, objects): combine its hashes.
        for i in range(hashes.shape[0]):
            emit(i, hashes[i], mode, acc, npart, pid, rank, counts)

    @numba.njit(inline="always")
    def emit_pandas(i, h, mult, first, final, acc, npart, pid, rank, counts):  # type: ignore[no-untyped-def]
        # One column of pandas' combine_hash_arrays; the last one also
        # writes ids, ranks and counts.
        a = pd_start if first else acc[i]
        a = (a ^ h) * mult
        if final:
            a += pd_end
            p = a % npart
            pid[i] = p
            rank[i] = counts[p]
            counts[p] += 1
        else:
            acc[i] = a

    @njit
    def pandas_values(values, mult, first, final, acc, npart, pid, rank, counts):  # type: ignore[no-untyped-def]
        # Numbers of any numpy type hashed as their float64 values, as pandas
        # hashes a float64 array: NaN (any payload) as NaN, -0.0 as 0.0.
        cell = np.empty(1, np.float64)
        bits = cell.view(np.uint64)
        for i in range(values.shape[0]):
            cell[0] = np.float64(values[i])
            b = bits[0]
            if (b & abs_mask) > inf_bits:
                b = nan_bits
            elif b == sign:
                b = np.uint64(0)
            emit_pandas(i, mix(b), mult, first, final, acc, npart, pid, rank, counts)

    @njit
    def pandas_given(hashes, mult, first, final, acc, npart, pid, rank, counts):  # type: ignore[no-untyped-def]
        # A column whose pandas hashes were computed elsewhere: combine them.
        for i in range(hashes.shape[0]):
            emit_pandas(i, hashes[i], mult, first, final, acc, npart, pid, rank, counts)

    @njit
    def rank_ids(ids, pid, rank, counts):  # type: ignore[no-untyped-def]
        # Caller-given ids (a range partitioner): narrow them, rank and count.
        for i in range(ids.shape[0]):
            p = ids[i]
            pid[i] = p
            rank[i] = counts[p]
            counts[p] += 1

    # Indices below are unsigned on purpose: numba checks every signed index
    # for wraparound (negative means from the end), which made the string
    # copy 4x slower.
    @njit
    def scatter(src, pid, rank, base, out):  # type: ignore[no-untyped-def]
        # Fixed-width values: row i goes to out[base[pid[i]] + rank[i]].
        for i in range(src.shape[0]):
            out[np.uint64(base[pid[i]]) + np.uint64(rank[i])] = src[i]

    @njit
    def scatter_bits(src, src_offset, from_bytes, pid, rank, base, counts, out):  # type: ignore[no-untyped-def]
        # Bits (a validity bitmap, or booleans) into per-piece bitmaps that
        # start at byte base[p]; ``from_bytes``: src holds one byte per row.
        for p in range(base.shape[0]):
            for j in range((counts[p] + 7) >> 3):
                out[base[p] + j] = 0
        for i in range(pid.shape[0]):
            if from_bytes:
                bit = src[i] != 0
            else:
                k = np.uint64(i + src_offset)
                bit = (src[k >> np.uint64(3)] >> (k & np.uint64(7))) & 1
            if bit:
                r = np.uint64(rank[i])
                b = np.uint64(base[pid[i]]) + (r >> np.uint64(3))
                out[b] |= np.uint8(1 << (r & np.uint64(7)))

    @njit
    def var_sizes(offsets, pid, npart):  # type: ignore[no-untyped-def]
        # Bytes of variable-width data each partition gets.
        sizes = np.zeros(npart, np.int64)
        for i in range(pid.shape[0]):
            sizes[pid[i]] += offsets[i + 1] - offsets[i]
        return sizes

    @njit
    def scatter_var(offsets, data, words, pid, rank, counts, off_base, data_base, out_off, out, out_words):  # type: ignore[no-untyped-def]
        # Strings/binary: each piece gets offsets from 0 (in ``out_off``, whose
        # unit is its offset type, from off_base[p]) and its bytes (from byte
        # data_base[p]); rows come in order, so a cursor per piece places them.
        # ``words``/``out_words``: the same bytes read/written 8 at a time at
        # any byte position; a string is copied in whole words, which may
        # write up to 7 bytes past its end: the next string of the piece
        # overwrites them, and every piece's data has 8 bytes of slack.
        npart = off_base.shape[0]
        cursor = np.zeros(npart, np.uint64)
        nwords = np.uint64(words.shape[0])
        eight = np.uint64(8)
        for p in range(npart):
            if counts[p]:
                out_off[off_base[p]] = 0
        for i in range(pid.shape[0]):
            p = pid[i]
            start = np.uint64(offsets[i])
            end = np.uint64(offsets[i + 1])
            c = cursor[p]
            dst = np.uint64(data_base[p]) + c
            k = np.uint64(0)
            n = end - start
            if end <= nwords:
                while k < n:
                    out_words[dst + k] = words[start + k]
                    k += eight
            else:
                while k < n:
                    out[dst + k] = data[start + k]
                    k += np.uint64(1)
            c += n
            cursor[p] = c
            out_off[np.uint64(off_base[p]) + np.uint64(rank[i]) + np.uint64(1)] = c

    # The gather of an extract reads pieces by address: module-level
    # functions (mpshuffle.table._gather), so numba can cache them.
    from mpshuffle.table._gather import gather_bits, gather_bytes, gather_offsets

    return SimpleNamespace(
        hash_ints=hash_ints, hash_float_bits=hash_float_bits, hash_given=hash_given,
        pandas_values=pandas_values, pandas_given=pandas_given,
        rank_ids=rank_ids, scatter=scatter, scatter_bits=scatter_bits, var_sizes=var_sizes,
        scatter_var=scatter_var, gather_bytes=gather_bytes, gather_bits=gather_bits,
        gather_offsets=gather_offsets,
    )
