"""Arrow IPC and pickle pieces: the header codec, row grouping, IPC write and read back.

Pieces of the built-in adapters are raw column buffers
(:mod:`mpshuffle.table._columns`); this module serves the pandas adapter's
whole-frame pickle fallback, the IPC streams of columns without a raw
layout, and pieces of these two formats written by other code. The adapter
metadata (the "header") of such a piece is small JSON:
``{"fmt": "arrow" | "pickle", "names": [...]}`` where ``names`` (optional) are
the original column names when they are not all strings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from mpshuffle.errors import ShuffleError

if TYPE_CHECKING:
    import numpy.typing as npt

__all__ = ["Header", "read_ipc", "split_by_ids", "write_ipc"]

ARROW = "arrow"
PICKLE = "pickle"

@dataclass(frozen=True)
class Header:
    """Decoded adapter metadata of a piece.

    Attributes
    ----------
    fmt
        ``"arrow"`` (IPC stream) or ``"pickle"`` (pickle protocol 5 of a frame).
    names
        Original column names, positionally, when some were not strings
        (Arrow field names are their ``str``); ``None`` otherwise.
    """

    fmt: str
    names: tuple[str | int, ...] | None = None

    def encode(self) -> bytes:
        """Return the JSON bytes of this header."""
        obj: dict[str, Any] = {"fmt": self.fmt}
        if self.names is not None:
            obj["names"] = list(self.names)
        return json.dumps(obj, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, metadata: bytes) -> Header:
        """Parse header bytes; ``b""`` means an Arrow stream with string names.

        Raises
        ------
        ShuffleError
            If the header is not one this module wrote.
        """
        if not metadata:
            return cls(ARROW)
        try:
            obj = json.loads(bytes(metadata))
            fmt = obj["fmt"]
        except (ValueError, KeyError, TypeError) as e:
            raise ShuffleError(f"unreadable piece metadata {bytes(metadata)[:64]!r}") from e
        if fmt not in (ARROW, PICKLE):
            raise ShuffleError(f"unknown piece format {fmt!r}")
        names = obj.get("names")
        return cls(fmt, tuple(names) if names is not None else None)


def write_ipc(table: pa.Table) -> pa.Buffer:
    """Serialize a table (or a zero-copy slice of one) as one Arrow IPC stream.

    The IPC writer copies only the sliced range of each buffer.
    """
    # Size the stream first (no data is copied) and write into one buffer of
    # that size: a growing BufferOutputStream copies the data again at each
    # reallocation, which cost about as much as the write itself.
    mock = pa.MockOutputStream()
    with pa.ipc.new_stream(mock, table.schema) as writer:
        writer.write_table(table)
    buf = pa.allocate_buffer(mock.size())
    with pa.ipc.new_stream(pa.FixedSizeBufferWriter(buf), table.schema) as writer:
        writer.write_table(table)
    return buf


def read_ipc(data: Any) -> pa.Table:
    """Read back a table written by :func:`write_ipc`, zero copy from ``data``."""
    buf = data if isinstance(data, pa.Buffer) else pa.py_buffer(data)
    with pa.ipc.open_stream(buf) as reader:
        return reader.read_all()


def split_by_ids(
    ids: npt.NDArray[np.int64],
) -> tuple[npt.NDArray[np.int64] | None, list[tuple[int, int, int]]]:
    """Group row positions by partition id, keeping the original row order.

    Parameters
    ----------
    ids
        ``int64`` partition id of each row, shape ``(n,)``.

    Returns
    -------
    order
        Stable argsort of ``ids`` (the one gather to apply), or ``None`` when
        the rows are already grouped (no gather needed).
    runs
        ``(partition_id, start, stop)`` of each non-empty partition in the
        gathered rows, ascending by partition id.
    """
    n = len(ids)
    if n == 0:
        return None, []
    if n == 1 or bool(np.all(ids[1:] >= ids[:-1])):
        order, sorted_ids = None, ids
    else:
        order = np.argsort(_narrow(ids), kind="stable")
        sorted_ids = ids[order]
    starts = np.flatnonzero(np.concatenate(([True], sorted_ids[1:] != sorted_ids[:-1])))
    stops = np.append(starts[1:], n)
    runs = [(int(sorted_ids[s]), int(s), int(e)) for s, e in zip(starts, stops, strict=True)]
    return order, runs


def _narrow(ids: npt.NDArray[np.int64]) -> npt.NDArray[Any]:
    # numpy's stable sort is a radix sort for 8- and 16-bit integers (several
    # times faster than its merge sort on int64); ids are >= 0, so narrowing
    # keeps the order whenever they fit.
    top = int(ids.max())
    if top < 2**8:
        return ids.astype(np.uint8)
    if top < 2**16:
        return ids.astype(np.uint16)
    return ids
