"""Device memory: the size of the current GPU, the shuffle's device budget, the pool.

CuPy is imported inside the functions, so importing this module needs no GPU.
"""

from __future__ import annotations

__all__ = ["device_budget", "device_memory_bytes", "reserve_device_pool"]


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
