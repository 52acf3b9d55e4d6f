"""Device memory: the size of the current GPU, the shuffle's device budget, the pool.

CuPy is imported inside the functions, so importing this module needs no GPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["batched_copy", "device_budget", "device_memory_bytes", "pinned_empty", "reserve_device_pool"]

# Bytes one thread block of the batched copy moves (a multiple of 16).
_CHUNK = 1 << 16
_copy_kernel_cache: list[Any] = []
_COPY_SOURCE = r"""
template <typename T>
__device__ void mpshuffle_copy_units(unsigned long long src, unsigned long long dst, long long nbytes)
{
    const T* s = (const T*)src;
    T* d = (T*)dst;
    const long long n = nbytes / (long long)sizeof(T);
    #pragma unroll 4
    for (long long i = threadIdx.x; i < n; i += blockDim.x) d[i] = s[i];
}

extern "C" __global__ void mpshuffle_batched_copy(
    const unsigned long long* src, const unsigned long long* dst,
    const long long* nbytes, const int* unit)
{
    // One block per chunk; every chunk's pointers and size are multiples of its unit.
    const long long c = blockIdx.x;
    const int u = unit[c];
    if (u == 16) mpshuffle_copy_units<uint4>(src[c], dst[c], nbytes[c]);
    else if (u == 8) mpshuffle_copy_units<unsigned long long>(src[c], dst[c], nbytes[c]);
    else if (u == 4) mpshuffle_copy_units<unsigned int>(src[c], dst[c], nbytes[c]);
    else if (u == 2) mpshuffle_copy_units<unsigned short>(src[c], dst[c], nbytes[c]);
    else mpshuffle_copy_units<unsigned char>(src[c], dst[c], nbytes[c]);
}
"""


def pinned_empty(nbytes: int) -> Any:
    """A new block of ``nbytes`` bytes of page-locked host memory, as a 1-D ``uint8`` NumPy array.

    Allocated with ``cudaHostAlloc`` (CuPy's ``PinnedMemory``, not CuPy's
    pinned pool, which would keep it after use); freed when the array and
    its views are gone. Copies between it and the GPU run at the bus's speed
    (~55 GB/s on an H200 against ~11 GB/s for pageable memory already
    touched, ``benchmarks/results/gpu/README.md`` section 7). Page-aligned,
    so 64-byte aligned. Falls back to pageable NumPy memory without CuPy or
    a GPU (the CPU tests).
    """
    try:
        import cupy
        from cupy.cuda.pinned_memory import PinnedMemory, PinnedMemoryPointer

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no GPU")
        memory = PinnedMemory(max(int(nbytes), 1))
    except Exception:  # noqa: BLE001 - no CuPy, driver or device: pageable memory serves
        raw = np.empty(nbytes + 64, dtype=np.uint8)
        start = (-raw.ctypes.data) % 64
        return raw[start : start + nbytes]
    return np.frombuffer(PinnedMemoryPointer(memory, 0), dtype=np.uint8, count=nbytes)


def device_memory_bytes() -> int:
    """Total memory of the current CUDA device, in bytes (``cudaMemGetInfo``)."""
    import cupy

    return int(cupy.cuda.runtime.memGetInfo()[1])


def device_budget(fraction: float) -> int:
    """Bytes of device memory the shuffle may hold before it spills to host.

    Parameters
    ----------
    fraction
        The ``spill_device`` option: a fraction in (0, 1] of the current
        device's total memory.

    Returns
    -------
    int
        ``int(fraction * total)`` bytes.

    Raises
    ------
    ValueError
        If ``fraction`` is not in (0, 1].
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"spill_device must be a fraction in (0, 1], got {fraction!r}")
    return int(fraction * device_memory_bytes())


def reserve_device_pool(fraction: float) -> int:
    """Have CuPy's default memory pool take ``fraction`` of the device up front.

    CuPy's pool allocates only on demand; this allocates one block of
    ``fraction * total`` bytes (rounded down to 1 MiB) with ``cudaMalloc``
    and frees it back into the pool, which keeps it and splits it to serve
    later allocations (the shuffle's buffers among them) without further
    ``cudaMalloc`` calls.

    Parameters
    ----------
    fraction
        The ``pool_size`` option, a fraction in (0, 1] of the current device.

    Returns
    -------
    int
        Bytes the pool holds after the call (``MemoryPool.total_bytes()``).

    Raises
    ------
    ValueError
        If ``fraction`` is not in (0, 1].
    MemoryError
        If the device cannot give that much (the message says how much was asked).
    """
    import cupy

    if not 0 < fraction <= 1:
        raise ValueError(f"pool_size must be a fraction in (0, 1], got {fraction!r}")
    free, total = (int(x) for x in cupy.cuda.runtime.memGetInfo())
    nbytes = int(fraction * total) // 2**20 * 2**20
    pool = cupy.get_default_memory_pool()
    if nbytes > pool.total_bytes():
        try:
            block = pool.malloc(nbytes - pool.total_bytes())
        except cupy.cuda.memory.OutOfMemoryError as e:
            raise MemoryError(
                f"pool_size={fraction}: could not reserve {nbytes} bytes of device memory "
                f"({free} of {total} bytes free)"
            ) from e
        del block  # back into the pool's free list, still allocated on the device
    return int(pool.total_bytes())


def batched_copy(sources: list[Any], destinations: list[Any], segments: Any) -> None:
    """Copy many byte ranges between ``uint8`` arrays, in one kernel on a GPU.

    Parameters
    ----------
    sources, destinations
        1-D ``uint8`` arrays, all CuPy (on the current device) or all NumPy.
    segments
        ``int64`` array of shape ``(k, 5)``: per row ``(source index, source
        byte offset, destination index, destination byte offset, bytes)``.
        Ranges must lie inside their arrays and destinations must not overlap.

    Notes
    -----
    On a GPU the segments are cut into chunks of 64 KiB, one thread block
    each, and every chunk is copied in the widest unit (16, 8, 4, 2 or 1
    bytes) that divides its addresses and size: one launch, whatever the
    number of segments (``cudaMemcpyAsync`` per segment costs microseconds
    of CPU time each). On the host a loop of slice copies does the same.
    The copy is ordered on CuPy's current stream; the caller synchronizes.
    """
    seg = np.asarray(segments, dtype=np.int64).reshape(-1, 5)
    seg = seg[seg[:, 4] > 0]
    if not len(seg):
        return
    if isinstance(destinations[0], np.ndarray):
        for s, so, d, do, n in seg.tolist():
            destinations[d][do : do + n] = sources[s][so : so + n]
        return
    import cupy

    src_base = np.array([a.data.ptr for a in sources], dtype=np.uint64)
    dst_base = np.array([a.data.ptr for a in destinations], dtype=np.uint64)
    src = src_base[seg[:, 0]] + seg[:, 1].astype(np.uint64)
    dst = dst_base[seg[:, 2]] + seg[:, 3].astype(np.uint64)
    length = seg[:, 4]
    nchunks = (length + _CHUNK - 1) // _CHUNK
    first = np.repeat(np.cumsum(nchunks) - nchunks, nchunks)
    which = np.repeat(np.arange(len(seg)), nchunks)
    off = (np.arange(int(nchunks.sum())) - first) * _CHUNK
    c_src = src[which] + off.astype(np.uint64)
    c_dst = dst[which] + off.astype(np.uint64)
    c_n = np.minimum(length[which] - off, _CHUNK)
    align = (c_src | c_dst | c_n.astype(np.uint64)).astype(np.int64)
    unit = np.ones(len(c_n), dtype=np.int32)
    for u in (2, 4, 8, 16):
        unit[align % u == 0] = u
    if not _copy_kernel_cache:
        _copy_kernel_cache.append(cupy.RawKernel(_COPY_SOURCE, "mpshuffle_batched_copy"))
    _copy_kernel_cache[0](
        (len(c_n),), (256,),
        (cupy.asarray(c_src), cupy.asarray(c_dst), cupy.asarray(c_n), cupy.asarray(unit)),
    )
