"""Spill files: one run's received buffers on disk, written and read back as they are.

A :class:`SpillDirectory` is one directory per run and rank (created on the
first spill) holding **one file per rank** (:meth:`SpillDirectory.append`,
:meth:`SpillDirectory.read_ranges`): every buffer of the run goes to one
append-only file, kept open, a chunk's buffers in one ``writev``, unchanged
at offsets that are multiples of :data:`ALIGNMENT` bytes (so what is read
back is aligned and used in place), no row looked at on the way out or
back, the small per-piece metadata staying in memory with its owner's
index; a partition's pieces come back as read-only mappings of their byte
ranges (:meth:`SpillDirectory.map_ranges`, no copy) or, read by range
(one ``preadv`` each), into one aligned buffer
(:meth:`SpillDirectory.read_ranges`). One open file whatever the number
of output partitions; the file's space is given back when the run ends.
The one store's disk tier (:class:`~mpshuffle.memory.store.DiskTier`) is
this layout, for the host and the device runs alike.

Ownership. Before a directory is created, its owner takes an exclusive
``flock`` on a sibling lock file ``<directory>.lock`` and holds it until the
directory is removed; the kernel releases it when the owner's process dies,
however it dies. :func:`remove_orphans` removes the directories (and lock
files) whose lock nobody holds: those of workers that were killed or
crashed before they could clean up. A live run's directory is never
removed: its lock is held for as long as it exists.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import shutil
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mpshuffle.errors import SpillError
from mpshuffle.memory import _pages
from mpshuffle.memory._pages import MADV_POPULATE_READ
from mpshuffle.memory.pool import ALIGNMENT, aligned_empty

__all__ = ["ALIGNMENT", "SpillDirectory", "remove_orphans"]

logger = logging.getLogger(__name__)

LOCK_SUFFIX = ".lock"

# Arrow's buffers are 64-byte aligned (ALIGNMENT); keeping spilled buffers on
# that boundary lets readers use them in place instead of realigning (copying).


def _aligned_empty(nbytes: int) -> memoryview:
    """A writable buffer of ``nbytes`` bytes whose start is ALIGNMENT-aligned."""
    return aligned_empty(nbytes).data


class SpillDirectory:
    """The spill file of one run on one rank.

    Parameters
    ----------
    path
        Directory to write into; created on the first :meth:`append`, removed
        with everything in it by :meth:`remove`.
    owner
        Names the rank and worker in error messages.

    Attributes
    ----------
    nbytes
        Bytes currently on disk (including alignment padding).
    """

    path: str
    owner: str
    nbytes: int

    def __init__(self, path: str, owner: str = "") -> None:
        self.path = path
        self.owner = owner
        self.nbytes = 0
        self._lock = threading.Lock()
        self._removed = False
        self._owner_fd: int | None = None
        self._fd: int | None = None  # the one file of append/read_ranges
        self._end = 0

    def _error(self, action: str, e: OSError) -> SpillError:
        who = f" on {self.owner}" if self.owner else ""
        if e.errno == errno.ENOSPC:
            what = f"the disk is full: could not {action} spill directory {self.path}{who}"
            hint = "free space there or set the option 'spill_dir' to a larger disk"
        else:
            what = f"could not {action} spill directory {self.path}{who} ({e})"
            hint = "check that 'spill_dir' is writable"
        return SpillError(f"{what}; {hint}")

    def append(self, buffers: Sequence[object]) -> list[int]:
        """Append ``buffers`` to the rank's one file, each at an :data:`ALIGNMENT`-aligned offset.

        Parameters
        ----------
        buffers
            Buffer-protocol objects, written as they are (in ``writev`` calls
            of up to 512 buffers, padding included).

        Returns
        -------
        list of int
            The offset of each buffer in the file, in bytes; read them back
            with :meth:`read_ranges`.

        Raises
        ------
        SpillError
            If the directory was removed, or writing failed (a full disk is
            named as such, with the directory and the owner).
        """
        views = [memoryview(b).cast("B") for b in buffers]  # type: ignore[arg-type]
        with self._lock:
            if self._removed:
                raise SpillError(f"spill directory {self.path} on {self.owner} was already removed")
            offsets = []
            parts: list[memoryview | bytes] = []
            end = self._end
            for view in views:
                pad = (-end) % ALIGNMENT
                if pad:
                    parts.append(_ZEROS[:pad])
                    end += pad
                offsets.append(end)
                parts.append(view)
                end += view.nbytes
            try:
                if self._fd is None:
                    if self._owner_fd is None:
                        self._owner_fd = _own(self.path)
                    os.makedirs(self.path, exist_ok=True)
                    self._fd = os.open(os.path.join(self.path, "pieces.bin"), os.O_RDWR | os.O_CREAT, 0o600)
                at = self._end
                for k in range(0, len(parts), _IOV):
                    group = parts[k : k + _IOV]
                    want = sum(len(b) if isinstance(b, bytes) else b.nbytes for b in group)
                    _pwritev_all(self._fd, group, at, want)
                    at += want
            except OSError as e:
                raise self._error("write to", e) from e
            self.nbytes += end - self._end
            self._end = end
        return offsets

    def read_ranges(
        self, ranges: Sequence[tuple[int, int]], allocate: Callable[[int], Any] | None = None
    ) -> tuple[Any, list[int]]:
        """Read byte ranges of the rank's one file (from :meth:`append`) into one aligned buffer.

        Parameters
        ----------
        ranges
            ``(offset, nbytes)`` of each range.
        allocate
            ``allocate(nbytes)`` makes the buffer (a writable, 64-byte aligned
            1-D ``uint8`` array, e.g. a pooled page-locked block); by default
            fresh memory.

        Returns
        -------
        buffer, positions
            The buffer and where each range starts in it (multiples of
            :data:`ALIGNMENT`). The file keeps the bytes (its space is freed
            with the directory): the caller reads each range once and
            accounts for the disk it releases.

        Raises
        ------
        SpillError
            If the file cannot be read or ends early.
        """
        positions = []
        total = 0
        for _, nbytes in ranges:
            positions.append(total)
            total += nbytes + (-nbytes) % ALIGNMENT
        buf = _aligned_empty(total) if allocate is None else allocate(total)
        with self._lock:
            fd = self._fd
            if fd is None:
                if ranges:
                    raise SpillError(f"spill directory {self.path} on {self.owner} has no spill file")
                return buf, positions
            try:
                for (offset, nbytes), at in zip(ranges, positions, strict=True):
                    got = 0
                    while got < nbytes:
                        n = os.preadv(fd, [buf[at + got : at + nbytes]], offset + got)
                        if not n:
                            raise OSError(errno.EIO, f"spill file in {self.path} ends before byte {offset + nbytes}")
                        got += n
            except OSError as e:
                raise self._error("read from", e) from e
        return buf, positions

    def map_ranges(self, ranges: Sequence[tuple[int, int]]) -> list[tuple[Any, int]] | None:
        """Map byte ranges of the rank's one file read-only, instead of copying them out (:meth:`read_ranges`).

        Each range gets a shared read-only mapping of its own pages, brought
        in with ``madvise(MADV_POPULATE_READ)`` before this returns, so a read
        error is a :class:`~mpshuffle.errors.SpillError` here, as with
        :meth:`read_ranges`, not a signal later, and the pages are mapped in
        one call per range rather than one fault per few pages. Readers then
        read the page cache's pages in place: no copy into a fresh buffer and
        none of that buffer's page faults (an extract's read-back, 3 GB of
        fresh memory per worker in the 4.5 GB out-of-core case,
        ``benchmarks/results/README.md``). One mapping per range, not one
        over all of them: the kernel maps a file's large folios (up to 2 MiB)
        whole where the mapping covers them, so one mapping spanning an
        output partition's scattered pieces held ~6x their bytes in the
        process's RSS. Mappings are made with libc directly (Python's
        :class:`mmap.mmap` duplicates the file descriptor for each, and an
        extract may map thousands of pieces), and each is unmapped when its
        array and every view of it are gone; the file's later removal does
        not end them.

        Parameters
        ----------
        ranges
            ``(offset, nbytes)`` of each range, written by :meth:`append`.

        Returns
        -------
        list of (numpy.ndarray, int), or None
            Per range, a read-only ``uint8`` array over its mapping and where
            the range starts in it (offsets written by :meth:`append` keep
            their 64-byte alignment); ``None`` where this file or system
            cannot be mapped that way (no libc ``mmap``, a filesystem without
            shared mappings, or a kernel before Linux 5.14 without
            ``MADV_POPULATE_READ``): then use :meth:`read_ranges`.

        Raises
        ------
        SpillError
            If the file cannot be read (the error ``madvise`` reports) or
            ends before a range does.
        """
        libc = _pages.libc()
        if libc is None or not ranges:
            return None
        page = mmap.ALLOCATIONGRANULARITY
        out: list[tuple[Any, int]] = []
        with self._lock:
            fd = self._fd
            if fd is None:
                raise SpillError(f"spill directory {self.path} on {self.owner} has no spill file")
            for offset, nbytes in ranges:
                if offset + nbytes > self._end:
                    raise SpillError(f"spill file in {self.path} on {self.owner} ends before byte {offset + nbytes}")
                if not nbytes:
                    out.append((_EMPTY, 0))
                    continue
                start = offset // page * page
                length = offset + nbytes - start
                address = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
                if address is None or address == _MAP_FAILED:
                    return None  # a filesystem without shared mappings: read instead
                if libc.madvise(address, length, MADV_POPULATE_READ) != 0:
                    err = ctypes.get_errno()
                    libc.munmap(address, length)
                    if err == errno.EINVAL:
                        return None  # a kernel without MADV_POPULATE_READ
                    raise self._error("read from", OSError(err, os.strerror(err)))
                array = np.ctypeslib.as_array((ctypes.c_uint8 * length).from_address(address))
                array.flags.writeable = False
                weakref.finalize(array, libc.munmap, address, length)
                out.append((array, offset - start))
        return out

    def remove(self) -> None:
        """Delete the directory and every file in it; later writes fail. Idempotent."""
        with self._lock:
            self._removed = True
            self.nbytes = 0
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            shutil.rmtree(self.path, ignore_errors=True)
            if self._owner_fd is not None:
                _disown(self.path, self._owner_fd)
                self._owner_fd = None


_MAP_FAILED = ctypes.c_void_p(-1).value
_EMPTY = np.zeros(0, np.uint8)
_EMPTY.flags.writeable = False


# Buffers per writev: below Linux's IOV_MAX (1024).
_IOV = 512
_ZEROS = bytes(ALIGNMENT)


def _pwritev_all(fd: int, parts: Sequence[memoryview | bytes], at: int, want: int) -> None:
    """``os.pwritev`` until all of ``parts`` (``want`` bytes) is written at offset ``at``."""
    done = 0
    while done < want:
        n = os.pwritev(fd, parts, at + done)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        done += n
        if done < want:
            # Skip what was written: rebuild the remaining parts.
            rest: list[memoryview | bytes] = []
            skip = n
            for b in parts:
                size = len(b) if isinstance(b, bytes) else b.nbytes
                if skip >= size:
                    skip -= size
                    continue
                rest.append(memoryview(b)[skip:] if skip else b)
                skip = 0
            parts = rest


def _own(path: str) -> int:
    """Take the lock that marks ``path`` as owned by this process; returns its file descriptor.

    Taken before ``path`` is created. A cleaner may unlink a lock file it
    found unheld between our open and our flock: then the inode we locked is
    no longer the file's, so open again.
    """
    lock_path = path + LOCK_SUFFIX
    while True:
        os.makedirs(os.path.dirname(lock_path) or ".", exist_ok=True)
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        except FileNotFoundError:
            continue  # a nested directory's parent was removed meanwhile
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.fstat(fd).st_ino == os.stat(lock_path).st_ino:
                return fd
        except FileNotFoundError:
            pass  # unlinked by a cleaner after we locked it: try again
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def _disown(path: str, fd: int) -> None:
    # Unlinked while still locked, so no cleaner can take it for an orphan's.
    try:
        os.unlink(path + LOCK_SUFFIX)
    except OSError:
        pass
    os.close(fd)


def _held_by_someone(lock_path: str) -> int | None:
    """Lock ``lock_path`` if nobody holds it: its descriptor, or ``None`` if it is held."""
    try:
        fd = os.open(lock_path, os.O_RDWR)
    except FileNotFoundError:
        return -1  # no lock file: nobody can hold it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


# Seconds a directory without any lock file is left alone: a device run's
# nested outbox creates its parent just before its own lock inside it.
LOCKLESS_GRACE = 60.0


def remove_orphans(spill_dir: str, prefix: str = "mpshuffle-") -> list[str]:
    """Remove the spill directories under ``spill_dir`` whose owner is gone.

    A directory ``<spill_dir>/<prefix>...`` is an orphan when no process
    holds its lock file ``<directory>.lock`` nor the lock of any directory
    nested in it (an ``outbox`` of a device run of an older version): its worker was killed or
    crashed mid-shuffle. A directory without any lock file (left by an
    older version, or a nested directory's parent a moment before its lock)
    counts as an orphan once it is :data:`LOCKLESS_GRACE` seconds old.
    Orphans are removed with their lock files; lock files without a
    directory whose lock nobody holds go too. Directories of
    live runs — of this process or any other on any host that shares the
    disk and honours ``flock`` — are left alone.

    Parameters
    ----------
    spill_dir
        The directory to clean (a worker's ``spill_dir``).
    prefix
        Start of the names of mpshuffle's spill directories.

    Returns
    -------
    list of str
        The directories removed. Each removal is logged at WARNING with the
        bytes it freed.
    """
    try:
        names = os.listdir(spill_dir)
    except OSError:
        return []
    removed = []
    for name in sorted(names):
        path = os.path.join(spill_dir, name)
        if not name.startswith(prefix):
            continue
        if name.endswith(LOCK_SUFFIX):
            if not os.path.isdir(path[: -len(LOCK_SUFFIX)]):
                fd = _held_by_someone(path)
                if fd is not None and fd >= 0:
                    _disown(path[: -len(LOCK_SUFFIX)], fd)
            continue
        if not os.path.isdir(path) or os.path.islink(path):
            continue
        fds = _take_all(path)
        if fds is None:
            continue  # a live run's
        if all(fd < 0 for _, fd in fds) and not _older_than(path, LOCKLESS_GRACE):
            continue
        try:
            nbytes = _tree_bytes(path)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            logger.warning(
                "mpshuffle: removed spill directory %s (%d bytes) left by a worker that is gone", path, nbytes
            )
        finally:
            for lock_path, fd in fds:
                if fd >= 0:
                    _disown(lock_path[: -len(LOCK_SUFFIX)], fd)
    return removed


def _take_all(path: str) -> list[tuple[str, int]] | None:
    """Lock ``path``'s own lock and every lock nested in it; ``None`` (nothing held) if any is held."""
    locks = [path + LOCK_SUFFIX]
    for root, _dirs, files in os.walk(path):
        locks.extend(os.path.join(root, f) for f in files if f.endswith(LOCK_SUFFIX))
    taken: list[tuple[str, int]] = []
    for lock_path in locks:
        fd = _held_by_someone(lock_path)
        if fd is None:
            for _, other in taken:
                if other >= 0:
                    os.close(other)
            return None
        taken.append((lock_path, fd))
    return taken


def _tree_bytes(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


def _older_than(path: str, seconds: float) -> bool:
    try:
        return time.time() - os.stat(path).st_mtime > seconds
    except OSError:
        return False
