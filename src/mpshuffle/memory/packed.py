"""The serialized form of one piece of a frame: :class:`PackedData`.

The frame adapters of :mod:`mpshuffle.table` write and read it; the memory
layer holds, counts and spills it without knowing any frame type.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["PackedData", "packed_nbytes"]

# The first frame of ``to_frames`` is this prefix (nrows, little-endian uint64)
# followed by the adapter's metadata, so a receiver needs no side channel to
# learn the row count.
_NROWS = struct.Struct("<Q")


def _buffer_size(data: Any) -> int:
    # pyarrow.Buffer, bytes, bytearray and memoryview all export the buffer
    # protocol; memoryview(...).nbytes is the size in bytes for any of them.
    size = getattr(data, "size", None)
    if isinstance(size, int):
        return size
    return memoryview(data).nbytes


@dataclass(frozen=True)
class PackedData:
    """One piece of a frame, serialized: a small metadata header + one contiguous buffer.

    Attributes
    ----------
    metadata
        Adapter-defined small header (may be ``b""``); tells the adapter how to
        read ``data`` back (for the built-in adapters: the packing format and,
        where needed, the original column names).
    data
        The bulk bytes: ``bytes``, ``memoryview`` or ``pyarrow.Buffer``. Never
        copied by this class.
    nrows
        Number of rows of the frame piece that ``data`` holds.
    """

    metadata: bytes
    data: Any
    nrows: int

    @property
    def nbytes(self) -> int:
        """Size in bytes: ``len(metadata)`` plus the size of ``data``."""
        return len(self.metadata) + _buffer_size(self.data)

    def to_frames(self) -> list[Any]:
        """Return the frames to send: ``[header, data]``.

        Returns
        -------
        list
            Two buffer objects. ``header`` is ``nrows`` as an 8-byte
            little-endian unsigned integer followed by ``metadata`` (a copy of
            the small header only); ``data`` is ``self.data`` itself, not copied.
        """
        return [_NROWS.pack(self.nrows) + bytes(self.metadata), self.data]

    @classmethod
    def from_frames(cls, frames: Sequence[Any]) -> PackedData:
        """Rebuild a :class:`PackedData` from the output of :meth:`to_frames`.

        Parameters
        ----------
        frames
            ``[header, data]``, each any buffer-protocol object.

        Returns
        -------
        PackedData
            With ``data`` being ``frames[1]`` itself (zero copy).

        Raises
        ------
        ValueError
            If there are not exactly two frames or the header is shorter than
            its 8-byte row-count prefix.
        """
        if len(frames) != 2:
            raise ValueError(f"PackedData needs exactly 2 frames, got {len(frames)}")
        header = memoryview(frames[0]).cast("B")
        if header.nbytes < _NROWS.size:
            raise ValueError(
                f"PackedData header has {header.nbytes} bytes, fewer than its "
                f"{_NROWS.size}-byte row-count prefix"
            )
        (nrows,) = _NROWS.unpack_from(header)
        return cls(metadata=bytes(header[_NROWS.size :]), data=frames[1], nrows=int(nrows))


def packed_nbytes(pieces: Iterable[PackedData]) -> int:
    """Bytes that ``pieces`` hold together: every piece's data, and each distinct metadata once.

    The pieces of one insert share one metadata object (an adapter's schema
    and layout, a few hundred bytes to a few KiB), so ``sum(p.nbytes)``
    would count it once per piece; here it counts once per object.

    Parameters
    ----------
    pieces
        Any pieces.

    Returns
    -------
    int
        Bytes.
    """
    total = 0
    seen: dict[int, int] = {}
    for p in pieces:
        total += _buffer_size(p.data)
        if id(p.metadata) not in seen:
            seen[id(p.metadata)] = len(p.metadata)
    return total + sum(seen.values())
