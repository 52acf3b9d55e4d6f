"""Pages of memory mpshuffle did not map itself: libc's ``mmap``/``madvise``, and faulting a block in at once.

Python's :mod:`mmap` gives ``madvise`` only to mappings it made; the pool's
blocks come from NumPy (``malloc``), and spilled ranges are mapped without
duplicating the file descriptor, so both go through libc here.

Why fault a fresh block in at once (:func:`populate_write`): every first
touch of a 4 KiB page of fresh memory is a trap into the kernel, which
zeroes the page and maps it. ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+)
does the same work for a whole range in one call, without the trap per
page. On the 2-core development machine, 30 fresh 0.6 MB blocks (an
insert's kept pieces) written with and without it: 11-16 against 17-25 ms
wall, 7-10 against 11-13 ms of system time (4 rounds each,
``benchmarks/results/README.md``, session 18).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import sys
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["ALIGNMENT", "HUGE_PAGE", "MADV_POPULATE_READ", "MADV_POPULATE_WRITE", "POPULATE_MIN_BYTES", "aligned_empty",
           "free_pages_reported", "huge_page_empty", "libc", "output_empty", "populate_write", "small_page_empty"]

#: ``madvise`` advice that faults a range in for reading and reports read errors (Linux 5.14+).
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
#: ``madvise`` advice that faults a range in for writing (Linux 5.14+).
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
#: Blocks below this many bytes are left to fault page by page (a few pages: the call costs what it saves).
POPULATE_MIN_BYTES = 64 * 1024

_populate_write_works = True

#: Every range starts at a multiple of this many bytes (Arrow's alignment).
ALIGNMENT = 64


def aligned_empty(nbytes: int) -> npt.NDArray[np.uint8]:
    """A new, uninitialised 1-D ``uint8`` array of ``nbytes`` whose data starts at a multiple of
    :data:`ALIGNMENT` bytes (a pool's fresh block where no ``fresh`` function is given; re-exported
    by :mod:`mpshuffle.memory.pool`)."""
    raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
    start = (-raw.ctypes.data) % ALIGNMENT
    return raw[start : start + nbytes]


@functools.cache
def libc() -> Any:
    """libc with ``mmap``, ``madvise`` and ``munmap`` typed; ``None`` off Linux or where libc lacks them.

    The advice numbers used with it are Linux's.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
        lib.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        lib.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    except (OSError, AttributeError):
        return None
    return lib


def populate_write(block: npt.NDArray[np.uint8]) -> bool:
    """Fault in, for writing, every whole page inside ``block``'s memory, in one ``madvise`` call.

    The pages a first write would fault in one at a time; the partial pages
    at either end are left to fault on use. Contents are not changed
    (fresh anonymous pages read as zeros either way).

    Parameters
    ----------
    block
        A writable, C-contiguous 1-D ``uint8`` array, of at least
        :data:`POPULATE_MIN_BYTES` bytes to be worth the call.

    Returns
    -------
    bool
        ``True`` if the pages were faulted in; ``False`` if the block is
        too small, or the system cannot (not Linux, or a kernel before 5.14,
        after which no further call is tried), or the kernel refused (e.g.
        out of memory: the pages then fault on use, as without the call).
    """
    global _populate_write_works
    lib = libc()
    if lib is None or not _populate_write_works or block.nbytes < POPULATE_MIN_BYTES:
        return False
    page = mmap.PAGESIZE
    address = block.ctypes.data
    start = -(-address // page) * page
    end = (address + block.nbytes) // page * page
    if end <= start:
        return False
    if lib.madvise(start, end - start, MADV_POPULATE_WRITE) == 0:
        return True
    if ctypes.get_errno() == errno.EINVAL:
        _populate_write_works = False  # a kernel without the advice
    return False


#: Bytes of a transparent huge page on x86-64 and most arm64 kernels.
HUGE_PAGE = 2 * 1024 * 1024
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
MADV_NOHUGEPAGE = getattr(mmap, "MADV_NOHUGEPAGE", 15)


def huge_page_empty(nbytes: int) -> npt.NDArray[np.uint8]:
    """A new, uninitialised ``uint8`` array of ``nbytes`` that starts on a huge-page boundary; its whole
    huge pages advised ``MADV_HUGEPAGE``, the rest ``MADV_NOHUGEPAGE``.

    For memory written once and kept (an extract's output partition). NumPy
    advises huge pages for any array of 4 MiB or more, but ``malloc``'s
    mappings start at any 4 KiB page: the part before the first 2 MiB
    boundary and after the last one then fault 4 KiB at a time, about 2 MiB
    an array, and the last huge page would hold up to 2 MiB nothing uses.
    Here the start is on the boundary (2 MiB of address space more, never
    touched) and the tail stays in small pages, so the array costs a trap
    per 2 MiB where it can, and no memory beyond its pages.

    Parameters
    ----------
    nbytes
        Size in bytes; below two huge pages, or where ``madvise`` cannot be
        called, a plain 64-byte aligned array (:func:`aligned_empty`).

    Returns
    -------
    numpy.ndarray
        1-D, ``uint8``, writable, shape ``(nbytes,)``; its memory is freed
        with it (and every view of it).
    """
    lib = libc()
    if lib is None or nbytes < 2 * HUGE_PAGE:
        return aligned_empty(nbytes)
    raw = np.empty(nbytes + HUGE_PAGE, np.uint8)
    start = (-raw.ctypes.data) % HUGE_PAGE
    block = raw[start : start + nbytes]
    address = block.ctypes.data
    whole = nbytes // HUGE_PAGE * HUGE_PAGE
    lib.madvise(address, whole, MADV_HUGEPAGE)
    tail = -(-(nbytes - whole) // mmap.PAGESIZE) * mmap.PAGESIZE
    if tail:
        lib.madvise(address + whole, tail, MADV_NOHUGEPAGE)
    return block


@functools.cache
def free_pages_reported() -> bool:
    """Whether this machine is a virtual machine whose kernel hands its free memory back to the host.

    A virtio balloon with free page reporting (feature bit 5,
    ``VIRTIO_BALLOON_F_REPORTING``) tells the host about every free block of
    huge-page size after a moment; the host takes its memory back, and the
    next touch of that block costs a fault on the host as well. Measured on
    the 2-core development machine (a Firecracker guest that reports):
    fresh huge pages after a 5 s rest 2.08-2.18 system CPU-s/GB against
    0.32-0.34 for 4 KiB pages, and 0.04-0.08 when the same amount was freed
    just before (``benchmarks/results/README.md``). Read once per process
    from ``/sys``; ``False`` where there is no such device (bare metal, most
    cloud machines, not Linux).
    """
    import glob

    for path in glob.glob("/sys/bus/virtio/drivers/virtio_balloon/virtio*/features"):
        try:
            with open(path) as f:
                bits = f.read().strip()
        except OSError:
            continue
        if len(bits) > 5 and bits[5] == "1":
            return True
    return False


def small_page_empty(nbytes: int) -> npt.NDArray[np.uint8]:
    """A new ``uint8`` array of ``nbytes`` in 4 KiB pages (``MADV_NOHUGEPAGE``), faulted in at once.

    The counterpart of :func:`huge_page_empty` where huge pages cost more
    than they save (:func:`free_pages_reported`): the pages come one by one
    from the kernel's free lists, but in one ``madvise(MADV_POPULATE_WRITE)``
    call rather than a trap each. Below :data:`POPULATE_MIN_BYTES`, or
    without libc, a plain 64-byte aligned array (:func:`aligned_empty`).
    """
    lib = libc()
    if lib is None or nbytes < POPULATE_MIN_BYTES:
        return aligned_empty(nbytes)
    page = mmap.PAGESIZE
    raw = np.empty(nbytes + page, np.uint8)
    start = (-raw.ctypes.data) % page
    block = raw[start : start + nbytes]
    whole = nbytes // page * page
    lib.madvise(block.ctypes.data, whole, MADV_NOHUGEPAGE)
    populate_write(block)
    return block


def output_empty(nbytes: int) -> npt.NDArray[np.uint8]:
    """Memory for output that is written once and kept (an extract's partition): the cheaper kind of page here.

    :func:`small_page_empty` on a machine that reports its free pages to a
    host (:func:`free_pages_reported`), :func:`huge_page_empty` elsewhere.
    Both give a writable 1-D ``uint8`` array of ``nbytes``, 64-byte aligned
    at least, freed with its last view.
    """
    return small_page_empty(nbytes) if free_pages_reported() else huge_page_empty(nbytes)
