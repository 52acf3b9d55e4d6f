"""Spill files: one run's received buffers on disk, written and read back as they are.

A :class:`SpillDirectory` is one directory per run and rank (created on the
first spill). It keeps one append-only file per output partition and writes
each piece's bulk buffer into it unchanged, at an offset that is a multiple
of :data:`ALIGNMENT` bytes, so that reading a partition back is one
``readinto`` of the whole file into one aligned buffer and every piece is a
zero-copy slice of it. No row is looked at on the way out or back; the small
per-piece metadata stays in memory with the postbox's index.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading

import numpy as np

from mpshuffle.errors import SpillError

__all__ = ["ALIGNMENT", "SpillDirectory"]

# Arrow's buffers are 64-byte aligned; keeping spilled buffers on that
# boundary lets readers use them in place instead of realigning (copying).
ALIGNMENT = 64


def _aligned_empty(nbytes: int) -> memoryview:
    """A writable buffer of ``nbytes`` bytes whose start is ALIGNMENT-aligned."""
    raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
    start = (-raw.ctypes.data) % ALIGNMENT
    return raw[start : start + nbytes].data


class SpillDirectory:
    """The spill files of one run on one rank.

    Parameters
    ----------
    path
        Directory to write into; created on the first :meth:`write`, removed
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
        self._sizes: dict[int, int] = {}
        self._lock = threading.Lock()
        self._removed = False

    def _error(self, action: str, e: OSError) -> SpillError:
        who = f" on {self.owner}" if self.owner else ""
        if e.errno == errno.ENOSPC:
            what = f"the disk is full: could not {action} spill directory {self.path}{who}"
            hint = "free space there or set the option 'spill_dir' to a larger disk"
        else:
            what = f"could not {action} spill directory {self.path}{who} ({e})"
            hint = "check that 'spill_dir' is writable"
        return SpillError(f"{what}; {hint}")

    def write(self, partition_id: int, data: object) -> tuple[int, int]:
        """Append the buffer ``data`` to partition ``partition_id``'s file.

        Parameters
        ----------
        partition_id
            Output partition the buffer belongs to.
        data
            Any buffer-protocol object; written as is.

        Returns
        -------
        offset, nbytes : int
            Where the buffer starts in the file and its size, in bytes.

        Raises
        ------
        SpillError
            If the directory was removed, or writing failed (a full disk is
            named as such, with the directory and the owner).
        """
        view = memoryview(data).cast("B")  # type: ignore[arg-type]
        nbytes = view.nbytes
        with self._lock:
            if self._removed:
                raise SpillError(f"spill directory {self.path} on {self.owner} was already removed")
            offset = self._sizes.get(partition_id, 0)
            pad = (-offset) % ALIGNMENT
            try:
                os.makedirs(self.path, exist_ok=True)
                with open(self._file(partition_id), "ab") as f:
                    if pad:
                        f.write(b"\0" * pad)
                    _write_all(f, view)
            except OSError as e:
                raise self._error("write to", e) from e
            offset += pad
            self._sizes[partition_id] = offset + nbytes
            self.nbytes += pad + nbytes
        return offset, nbytes

    def read(self, partition_id: int) -> memoryview:
        """Read partition ``partition_id``'s whole file into one aligned buffer and delete it.

        Returns
        -------
        memoryview
            The file's bytes; slice it with the offsets :meth:`write` returned.
            Empty if nothing was spilled for the partition.

        Raises
        ------
        SpillError
            If the file cannot be read.
        """
        with self._lock:
            size = self._sizes.pop(partition_id, 0)
            if not size:
                return memoryview(b"")
            path = self._file(partition_id)
            buf = _aligned_empty(size)
            try:
                with open(path, "rb", buffering=0) as f:
                    got = 0
                    while got < size:
                        n = f.readinto(buf[got:])
                        if not n:
                            raise OSError(errno.EIO, f"spill file {path} is truncated at {got} of {size} bytes")
                        got += n
                os.remove(path)
            except OSError as e:
                raise self._error("read from", e) from e
            self.nbytes -= size
        return buf

    def remove(self) -> None:
        """Delete the directory and every file in it; later writes fail. Idempotent."""
        with self._lock:
            self._removed = True
            self._sizes.clear()
            self.nbytes = 0
            shutil.rmtree(self.path, ignore_errors=True)

    def _file(self, partition_id: int) -> str:
        return os.path.join(self.path, f"part-{partition_id}.bin")


def _write_all(f: object, view: memoryview) -> None:
    # A raw write may be partial; a buffered file's write is not, but be sure.
    written = 0
    while written < view.nbytes:
        n = f.write(view[written:])  # type: ignore[attr-defined]
        if n is None or n <= 0:
            raise OSError(errno.EIO, "short write")
        written += n
