"""The insert's compiled kernels, as module-level numba functions (see :mod:`mpshuffle.table._kernels`).

Module-level on purpose: numba's cache keys a function by its code and the
values its closure captures, and a closure that captures other compiled
functions (``mix``, ``emit``) gets a new key in every process, so every
fresh worker compiled the hash kernels again (~4 s of CPU on the 2-core
development machine, and a new cache file each time). Functions found by
module and name are cached once per machine. Imported by
:func:`mpshuffle.table._kernels.kernels`, never by ``import mpshuffle``.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from mpshuffle.table._kernels import (
    _ABS,
    _C1,
    _C2,
    _INF_BITS,
    _M,
    _NAN_BITS,
    _NULL,
    _PD_END,
    _PD_START,
    _SIGN,
)

__all__ = [
    "hash_float_bits", "hash_given", "hash_ints", "pandas_given", "pandas_values", "rank_ids", "scatter",
    "scatter_bits", "scatter_var", "scatter_words", "var_sizes",
]

# Compile-time constants of the kernels (numba freezes numpy scalar globals).
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
def place(i, p, pid, rank, counts):  # type: ignore[no-untyped-def]
    # Row i goes to partition p, after the rows of p before it (a stable counting sort).
    pid[i] = p
    rank[i] = counts[p]
    counts[p] += 1


@numba.njit(inline="always")
def emit(i, h, mode, acc, npart, pid, rank, counts):  # type: ignore[no-untyped-def]
    if mode == 1 or mode == 3:
        h = (acc[i] * m) ^ h
    if mode >= 2:
        place(i, h % npart, pid, rank, counts)
    else:
        acc[i] = h


@numba.njit(nogil=True, cache=True)
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


@numba.njit(nogil=True, cache=True)
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


@numba.njit(nogil=True, cache=True)
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
        place(i, a % npart, pid, rank, counts)
    else:
        acc[i] = a


@numba.njit(nogil=True, cache=True)
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


@numba.njit(nogil=True, cache=True)
def pandas_given(hashes, mult, first, final, acc, npart, pid, rank, counts):  # type: ignore[no-untyped-def]
    # A column whose pandas hashes were computed elsewhere: combine them.
    for i in range(hashes.shape[0]):
        emit_pandas(i, hashes[i], mult, first, final, acc, npart, pid, rank, counts)


@numba.njit(nogil=True, cache=True)
def rank_ids(ids, pid, rank, counts):  # type: ignore[no-untyped-def]
    # Caller-given ids (a range partitioner): narrow them, rank and count.
    for i in range(ids.shape[0]):
        place(i, ids[i], pid, rank, counts)


# Indices below are unsigned on purpose: numba checks every signed index
# for wraparound (negative means from the end), which made the string
# copy 4x slower.


@numba.njit(nogil=True, cache=True)
def scatter(src, pid, rank, base, out):  # type: ignore[no-untyped-def]
    # Fixed-width values: row i goes to out[base[pid[i]] + rank[i]].
    for i in range(src.shape[0]):
        out[np.uint64(base[pid[i]]) + np.uint64(rank[i])] = src[i]


@numba.njit(nogil=True, cache=True)
def scatter_words(src, words, pid, rank, base, out):  # type: ignore[no-untyped-def]
    # Fixed-width values of ``words`` 8-byte words each (128- and 256-bit
    # decimals): row i's words go to out from word base[pid[i]] + rank[i] *
    # words (a piece's buffer starts at any multiple of 8 bytes).
    w = np.uint64(words)
    for i in range(pid.shape[0]):
        d = np.uint64(base[pid[i]]) + np.uint64(rank[i]) * w
        s = np.uint64(i) * w
        for k in range(words):
            out[d + np.uint64(k)] = src[s + np.uint64(k)]


@numba.njit(nogil=True, cache=True)
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


@numba.njit(nogil=True, cache=True)
def var_sizes(offsets, pid, npart):  # type: ignore[no-untyped-def]
    # Bytes of variable-width data each partition gets.
    sizes = np.zeros(npart, np.int64)
    for i in range(pid.shape[0]):
        sizes[pid[i]] += offsets[i + 1] - offsets[i]
    return sizes


@intrinsic
def _load8(typingctx: Any, address: Any) -> Any:
    """The ``uint64`` at ``address`` (``uint64``), read at any byte alignment."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.load(builder.inttoptr(args[0], ir.IntType(64).as_pointer()), align=1)

    return types.uint64(types.uint64), codegen


@intrinsic
def _store8(typingctx: Any, address: Any, value: Any) -> Any:
    """Write the ``uint64`` ``value`` at ``address`` (``uint64``), at any byte alignment."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        builder.store(args[1], builder.inttoptr(args[0], ir.IntType(64).as_pointer()), align=1)
        return context.get_dummy_value()

    return types.void(types.uint64, types.uint64), codegen


@numba.njit(nogil=True, cache=True)
def scatter_var(offsets, data, pid, rank, counts, off_base, data_base, out_off, out, cursor):  # type: ignore[no-untyped-def]
    # Strings/binary: each piece gets offsets from 0 (in ``out_off``, whose
    # unit is its offset type, from off_base[p]) and its bytes (from byte
    # data_base[p]); rows come in order, so a cursor per piece places them.
    # ``cursor`` (uint64, one per piece) is where each piece's bytes go on:
    # zeros for a column in one chunk; for an Arrow column in chunks the
    # same array across the calls, one per chunk with its rows' pid and rank.
    # A string is copied in whole words (unaligned 8-byte loads and stores
    # through its address), which may write up to 7 bytes past its end: the
    # next string of the piece overwrites them, and every piece's data has 8
    # bytes of slack. Strings ending in the input's last 7 bytes go byte by
    # byte (a word there would read past it). Words through addresses, not
    # through a strided uint64 view of the bytes: 5-12 % less thread CPU for
    # strings of 1-27 bytes (1.5 M rows into 16 partitions; session 18).
    npart = off_base.shape[0]
    eight = np.uint64(8)
    src0 = np.uint64(data.ctypes.data)
    dst0 = np.uint64(out.ctypes.data)
    nsafe = np.uint64(data.shape[0] - 7) if data.shape[0] >= 7 else np.uint64(0)
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
        if end <= nsafe:
            while k < n:
                _store8(dst0 + dst + k, _load8(src0 + start + k))
                k += eight
        else:
            while k < n:
                out[dst + k] = data[start + k]
                k += np.uint64(1)
        c += n
        cursor[p] = c
        out_off[np.uint64(off_base[p]) + np.uint64(rank[i]) + np.uint64(1)] = c
