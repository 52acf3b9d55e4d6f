"""Frame adapter for ``pyarrow.Table``.

Pieces are Arrow buffers scattered once per column
(:mod:`mpshuffle.table._columns`; types with no raw layout there travel as
Arrow IPC inside the piece). On unpack
every column of every piece is cast to the meta's type when that is lossless
(``null`` columns always; others when a safe cast round-trips to the same
values), then the pieces are concatenated.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import pyarrow as pa

from mpshuffle.errors import ShuffleError
from mpshuffle.memory.packed import PackedData, distinct_metadata
from mpshuffle.table._columns import (
    arrow_columns,
    gather,
    hash_ids,
    is_cols,
    pack,
    rank_ids,
    read_piece,
    scratch_empty,
)
from mpshuffle.table._ipc import ARROW, Header, read_ipc
from mpshuffle.table.base import FrameAdapter, check_ids
from mpshuffle.table.hashing import partition_ids

if TYPE_CHECKING:
    import numpy.typing as npt

    from mpshuffle.memory.pool import HostPool

__all__ = ["ArrowAdapter"]


def _schema(meta: pa.Table | pa.Schema) -> pa.Schema:
    return meta if isinstance(meta, pa.Schema) else meta.schema


class ArrowAdapter(FrameAdapter):
    """Adapter for ``pyarrow.Table`` (a meta may be a ``Table`` or a ``Schema``)."""

    name: ClassVar[str] = "pyarrow"

    def matches(self, obj: object) -> bool:
        """Return whether ``obj`` is a ``pyarrow.Table`` or ``pyarrow.Schema``."""
        return isinstance(obj, (pa.Table, pa.Schema))

    def column_names(self, frame: pa.Table | pa.Schema) -> list[Any]:
        """Return the field names (of a table, or of a schema used as meta)."""
        return list(_schema(frame).names)

    def num_rows(self, frame: pa.Table) -> int:
        """Return the number of rows."""
        return int(frame.num_rows)

    def nbytes(self, frame: pa.Table) -> int:
        """Return ``frame.nbytes``: bytes of the buffers the table (or slice) spans."""
        return int(frame.nbytes)

    def partition_ids(
        self, frame: pa.Table, on: Sequence[Any], npartitions: int
    ) -> npt.NDArray[np.int64]:
        """Return each row's output partition id; see :mod:`mpshuffle.table.hashing`.

        Raises
        ------
        KeyError
            If a column of ``on`` is missing.
        """
        missing = [c for c in on if c not in frame.column_names]
        if missing:
            raise KeyError(f"key column(s) {missing!r} not in table columns {frame.column_names!r}")
        return partition_ids(frame.select(list(on)), npartitions)

    def split(
        self,
        frame: pa.Table,
        on: Sequence[Any],
        npartitions: int,
        ids: npt.NDArray[np.int64] | None = None,
    ) -> Mapping[int, PackedData]:
        """Split by hash of ``on``: one hash pass, one scatter of each column (see ``_columns``).

        Returns
        -------
        dict
            ``{partition_id: PackedData}`` of non-empty pieces, rows in order.

        Raises
        ------
        KeyError
            If a key column is missing.
        """
        return self.split_for(frame, on, npartitions, ids)

    def split_for(
        self,
        frame: pa.Table,
        on: Sequence[Any],
        npartitions: int,
        ids: npt.NDArray[np.int64] | None = None,
        *,
        rank: int = 0,
        nranks: int = 1,
        pool: HostPool | None = None,
    ) -> Mapping[int, PackedData]:
        """:meth:`split`, the pieces' memory from ``pool``, kept and sent pieces apart.

        See :meth:`~mpshuffle.table.FrameAdapter.split_for`.
        """
        columns = arrow_columns(frame)
        if ids is None:
            missing = [c for c in on if c not in frame.column_names]
            if missing:
                raise KeyError(
                    f"key column(s) {missing!r} not in table columns {frame.column_names!r}"
                )
            if frame.num_rows == 0:
                return {}
            by_name = dict(zip(frame.column_names, columns, strict=True))
            split = hash_ids([by_name[c] for c in on], npartitions, frame.num_rows, list(on),
                             empty=scratch_empty(pool))
        else:
            ids = np.asarray(ids)
            check_ids(ids, frame.num_rows, npartitions)
            if frame.num_rows == 0:
                return {}
            split = rank_ids(ids, npartitions, empty=scratch_empty(pool))
        return pack(columns, split, frame.schema, pool=pool, owner=(rank, nranks))

    def unpack(self, pieces: Sequence[PackedData], meta: pa.Table | pa.Schema) -> pa.Table:
        """Concatenate pieces in order into a table with ``meta``'s schema.

        Raises
        ------
        ShuffleError
            If a piece is not Arrow-packed, lacks a field of ``meta`` or has
            one it lacks, or a column cannot be cast losslessly; the message
            names the column.
        """
        schema = _schema(meta)
        if not pieces:
            return self.empty_like(meta)
        gathered = gather(pieces) if all(is_cols(m) for m in distinct_metadata(pieces)) else None
        if gathered is not None:
            # One table of all pieces (same field names and types).
            table = gathered[0]
            self._check_names(table.column_names, schema)
            return pa.Table.from_arrays([self._cast(table.column(f.name), f) for f in schema], schema=schema)
        tables = []
        for piece in pieces:
            if is_cols(piece.metadata):
                table = read_piece(piece)[0]
            elif Header.decode(piece.metadata).fmt != ARROW:
                raise ShuffleError("the pyarrow adapter got a piece not packed as Arrow IPC")
            else:
                table = read_ipc(piece.data)
            self._check_names(table.column_names, schema)
            # Each piece is cast on its own: pieces of different input
            # partitions may differ (int32 here, int64 there), which no
            # concatenation of the raw pieces would accept.
            columns = [self._cast(table.column(f.name), f) for f in schema]
            tables.append(pa.Table.from_arrays(columns, schema=schema))
        return pa.concat_tables(tables)

    @staticmethod
    def _check_names(names: list[str], schema: pa.Schema) -> None:
        missing = [n for n in schema.names if n not in names]
        if missing:
            raise ShuffleError(f"the data lacks column(s) {missing!r} that the meta declares")
        extra = [n for n in names if n not in schema.names]
        if extra:
            raise ShuffleError(f"the data has column(s) {extra!r} that the meta lacks")

    @staticmethod
    def _cast(column: pa.ChunkedArray, field: pa.Field) -> pa.ChunkedArray:
        if column.type == field.type:
            return column
        if pa.types.is_null(column.type):
            return column.cast(field.type)
        try:
            cast = column.cast(field.type, safe=True)
            lossless = cast.cast(column.type).equals(column)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
            lossless = False
        if not lossless:
            raise ShuffleError(
                f"column {field.name!r}: cannot cast type {column.type} to the meta's type "
                f"{field.type} without losing values"
            )
        return cast

    def empty_like(self, meta: pa.Table | pa.Schema) -> pa.Table:
        """Return a table with 0 rows and ``meta``'s schema."""
        return _schema(meta).empty_table()
