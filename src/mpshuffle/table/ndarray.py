"""Frame adapter for NumPy array blocks: the pieces of a rechunk.

A rechunk of an n-dimensional array (:mod:`mpshuffle.dask.rechunk`) moves
the blocks of one chunking into the blocks of another. Within a group of
input and output blocks that overlap (a :class:`BlockPlan`), every input
block is cut into one *cut* per output block it overlaps, and every output
block is assembled from the cuts of the input blocks that overlap it.
Cutting and placing are independent per axis, so the plan holds, per axis
and per input block, the output blocks it reaches and where (the whole
cross product is never stored).

The cost per cut is the whole game: a time-to-space rechunk cuts each of
400 input blocks into 400 cuts (160,000). So output blocks are gathered into
*output partitions* of consecutive blocks (C order, :attr:`BlockPlan.per_partition`
blocks each), and an insert sends **one piece per output partition**: one
buffer holding its cuts for every block of the partition, one after another,
with an offset index in the piece's header. The host run
(:class:`~mpshuffle.shuffler.host.Shuffler`) moves, budgets, spills and
counts pieces, a few per insert, never cuts; :meth:`NDArrayAdapter.unpack`
places every cut of a partition into its output block and returns the
partition's blocks. This adapter is not registered for
:func:`~mpshuffle.table.get_adapter` (a block has no key columns to hash):
the rechunk tasks build one per block.

Piece format
------------
``metadata``: a format byte (:data:`RAW` or :data:`PICKLED`), ``ndim`` and
the number of cuts (``<BBq``), nothing else, so the pieces of a run share a
few distinct metadata. ``data`` starts with the offset index: per cut
``2 + 2 ndim`` little-endian ``int64``, the output block (C-order index in
the group), the cut's byte offset in ``data``, its offsets inside the output
block and its extents. Then the cuts' elements, each in C order, in the
array's own dtype (structured and non-native byte orders as they lie); or,
for dtypes holding Python objects (``object``, structured with object
fields), the pickle (protocol 5) of the list of cuts. ``nrows`` is the
number of elements. Why the index travels in ``data``: a run keeps every
piece's metadata in memory until the run ends, spilled or not, outside its
budget, while ``data`` is counted, spilled and freed; with the index in the
metadata every piece's was distinct, and an out-of-core rechunk (1536 inputs
into 200 partitions) kept 322,000 of them per worker, ~60 MB past the budget. Unpickling runs code chosen by the
sender: pieces come only from the run's own ranks, which the communicator
authenticates. An insert's pieces lie in two buffers from the worker's
:class:`~mpshuffle.memory.pool.HostPool`: one for the pieces its rank
keeps (held, as the run holds their chunk, until the last of them is
extracted) and one for the pieces it sends (reused once sent).

Pieces kept as views (:data:`VIEW`): an insert whose adapter allows it
(``views=True``, the rechunk graph's) keeps the pieces of its own rank's
partitions uncopied where the block's cuts form a regular grid and the
block is C-contiguous: each piece's ``data`` is the byte range of the input
block from its first cut's first byte to its last cut's last byte, its
metadata the head, the block's position in the group and its shape (the
same for every piece of the block). The extract's adapter, which carries
the plan and its partition, works the cuts out again and copies them
straight from that range into the output blocks: one copy per byte and no
fresh memory for the kept half. Spilled and read back, the range is the same
bytes. Only where the ranges are tight (:data:`VIEW_MAX_SLACK`,
:data:`VIEW_MIN_SHARE`): the run's budget counts every range, and the views
keep the whole block alive.

Pieces sent as views: a piece for another rank whose byte range holds
(almost) nothing but its cuts (:data:`VIEW_SEND_SLACK`; a partition of whole
rows of the output grid, as :func:`mpshuffle.dask.rechunk.aligned_per_partition`
chooses for time-to-space) is a :data:`VIEW` piece too: the transport writes
the range straight from the input block into the message, with no copy into
a pooled buffer first, and the receiving extract places it as it places its
own views.
"""

from __future__ import annotations

import functools
import itertools
import math
import pickle
import struct
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import pyarrow as pa

from mpshuffle.errors import ShuffleError
from mpshuffle.memory._pages import aligned_empty, output_empty
from mpshuffle.memory.packed import PackedData, PieceTable
from mpshuffle.table.base import FrameAdapter
from mpshuffle.table.hashing import partition_owner

if TYPE_CHECKING:
    import numpy.typing as npt

    from mpshuffle.memory.pool import HostPool

__all__ = ["PICKLED", "RAW", "VIEW", "BlockPlan", "NDArrayAdapter", "check_plain_block"]

#: Format byte of a piece whose data are its elements, raw.
RAW = 0
#: Format byte of a piece whose data are the pickle of the piece (object dtypes).
PICKLED = 1
#: Format byte of a piece kept on its input block's rank: its data are a byte
#: range of the input block itself (no copy), its cuts found from the plan.
VIEW = 2
_ALIGN = 64  # each piece's buffer (the pool's alignment)
_CUT_ALIGN = 16  # each cut inside a piece
_HEAD = struct.Struct("<BBq")
#: A view piece's metadata after its head, per axis: the input block's position in the group, its extent.
_VIEW_AXIS = struct.Struct("<qq")


@functools.cache
def _view_axes(ndim: int) -> struct.Struct:
    """:data:`_VIEW_AXIS` for ``ndim`` axes, back to back: one unpack for a view piece's metadata."""
    return struct.Struct("<" + "qq" * ndim)

#: Per axis and input block: ``(output block, start, stop, offset)``, where
#: ``start:stop`` is the piece's range in the input block (``stop`` -1: to the
#: block's end, an axis of unknown extent) and ``offset`` its place in the output block.
AxisCuts = tuple[tuple[tuple[int, int, int, int], ...], ...]


@dataclass(frozen=True)
class BlockPlan:
    """How the input blocks of one rechunk group are cut and the cuts placed.

    Blocks are numbered by their position within the group, per axis from 0.

    Attributes
    ----------
    cuts
        ``cuts[axis][i]``: the cuts input block ``i`` (along ``axis``) gives,
        as ``(j, start, stop, offset)``: output block ``j`` along the axis
        takes the input block's range ``start:stop`` (``stop`` -1: to the
        end; its extent is not known before the block is computed) at
        ``offset``. Ordered by ``start``.
    nout
        Output blocks of the group per axis. Output block ``(j0, j1, ...)``
        has the C-order index ``b = numpy.ravel_multi_index((j0, j1, ...), nout)``.
    per_partition
        Output blocks per output partition: block ``b`` is in partition
        ``b // per_partition``.

    Raises
    ------
    ValueError
        If ``cuts`` and ``nout`` differ in length, a cut names an output
        block outside ``nout``, or ``per_partition`` < 1.
    """

    cuts: tuple[AxisCuts, ...]
    nout: tuple[int, ...]
    per_partition: int = 1

    def __post_init__(self) -> None:
        if len(self.cuts) != len(self.nout):
            raise ValueError(
                f"a block plan needs cuts for every axis: {len(self.cuts)} axes of cuts, "
                f"{len(self.nout)} of output blocks"
            )
        if self.per_partition < 1:
            raise ValueError(f"per_partition must be >= 1, got {self.per_partition}")
        for axis, (per_block, n) in enumerate(zip(self.cuts, self.nout, strict=True)):
            for block in per_block:
                for j, *_ in block:
                    if not 0 <= j < n:
                        raise ValueError(f"axis {axis}: output block {j} is outside [0, {n})")

    @property
    def nblocks(self) -> int:
        """Output blocks of the group."""
        return math.prod(self.nout)

    @property
    def npartitions(self) -> int:
        """Output partitions of the group's run: ``ceil(nblocks / per_partition)``."""
        return -(-self.nblocks // self.per_partition)

    def blocks_of(self, partition: int) -> range:
        """The output blocks (C-order indices) of output partition ``partition``."""
        return range(partition * self.per_partition, min(self.nblocks, (partition + 1) * self.per_partition))

    def pieces(self, block: Sequence[int]) -> Iterator[tuple[int, tuple[slice, ...], tuple[int, ...]]]:
        """``(output block, slices in the input block, offsets in the output block)`` of every cut.

        In increasing order of the output block (C-order index in the group).

        Parameters
        ----------
        block
            The input block's position in the group, one index per axis.

        Raises
        ------
        ValueError
            If ``block`` has the wrong number of axes or lies outside the group.
        """
        if len(block) != len(self.cuts):
            raise ValueError(f"block index {tuple(block)} has {len(block)} axes, the plan {len(self.cuts)}")
        per_axis = []
        stride = 1
        for axis in reversed(range(len(block))):
            i = block[axis]
            if not 0 <= i < len(self.cuts[axis]):
                raise ValueError(f"block index {tuple(block)} lies outside the group on axis {axis}")
            per_axis.append([
                (j * stride, slice(a, None if b < 0 else b), offset) for j, a, b, offset in self.cuts[axis][i]
            ])
            stride *= self.nout[axis]
        per_axis.reverse()
        for combo in itertools.product(*per_axis):
            yield (
                sum(c[0] for c in combo), tuple(c[1] for c in combo), tuple(c[2] for c in combo)
            )


def check_plain_block(block: Any, where: Sequence[int] | None = None) -> None:
    """Refuse a rechunk input block that is not a plain ``numpy.ndarray`` (a masked array's mask would be lost).

    Parameters
    ----------
    block
        The block as computed.
    where
        Its index, for the message, where known.

    Raises
    ------
    mpshuffle.errors.ShuffleError
        Naming the block's type.
    """
    if type(block) is not np.ndarray:
        at = "" if where is None else f" {tuple(where)}"
        raise ShuffleError(
            f"rechunk input block{at} is a {type(block).__module__}.{type(block).__qualname__}; "
            "mpshuffle rechunks arrays whose blocks are plain numpy.ndarray"
        )


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _output_array(shape: tuple[int, ...], dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    """An uninitialised array for output blocks that are written once and kept (an extract's).

    Its memory from :func:`~mpshuffle.memory._pages.output_empty` (the kind
    of page that is cheaper on this machine) where the dtype holds no Python
    objects and has a size; ``numpy.empty`` otherwise (object arrays start as
    ``None``; a zero-size dtype such as ``S0`` has no bytes to view).
    """
    if dtype.hasobject or dtype.itemsize == 0:
        return np.empty(shape, dtype=dtype)
    count = int(np.prod(shape, dtype=np.int64))
    return output_empty(count * dtype.itemsize).view(dtype).reshape(shape)


class NDArrayAdapter(FrameAdapter):
    """Cuts NumPy blocks into rechunk pieces and assembles output blocks from them.

    Parameters
    ----------
    dtype
        The array's dtype (every block has it).
    plan
        The group's :class:`BlockPlan`; needed to cut (:meth:`split_for`).
    block
        Position in the group of the block this adapter cuts.
    partition
        The output partition this adapter assembles (:meth:`unpack`); with
        ``plan``, needed for pieces kept as views (:data:`VIEW`).
    views
        Whether :meth:`split_for` may keep this rank's pieces as views of the
        input block (:data:`VIEW`) instead of copies; only for a run whose
        extracts unpack with the plan and their partition.

    Notes
    -----
    Only :meth:`split_for`/:meth:`split` and :meth:`unpack` are a rechunk's;
    a block has no key columns, so :meth:`partition_ids` refuses.
    """

    name: ClassVar[str] = "numpy-block"
    #: :meth:`unpack` copies every cut into fresh output blocks.
    copies_pieces: ClassVar[bool] = True

    def __init__(
        self, dtype: Any, plan: BlockPlan | None = None, block: Sequence[int] | None = None, *,
        partition: int | None = None, views: bool = False,
    ) -> None:
        self.dtype = np.dtype(dtype)
        self.plan = plan
        self.block = None if block is None else tuple(int(i) for i in block)
        self.partition = partition
        self.views = views
        self._grids: dict[tuple[int, int], Any] = {}  # see _regular_grid
        self._layouts: dict[Any, _ViewLayout] = {}  # see _view_cuts
        self._grid_kinds: dict[tuple[int, int], Any] = {}  # see _view_cuts

    def matches(self, obj: object) -> bool:
        """Whether ``obj`` is a plain NumPy array (not a subclass such as a masked array)."""
        return type(obj) is np.ndarray

    def column_names(self, frame: Any) -> list[Any]:
        """A block has no columns: ``[]``."""
        return []

    def num_rows(self, frame: Any) -> int:
        """Elements of the block."""
        return int(frame.size)

    def nbytes(self, frame: Any) -> int:
        """Bytes of the block's elements."""
        return int(frame.nbytes)

    def partition_ids(self, frame: Any, on: Sequence[Any], npartitions: int) -> npt.NDArray[np.int64]:
        """Refused: a block is cut by position (its :class:`BlockPlan`), not by hashing keys.

        Raises
        ------
        TypeError
            Always.
        """
        raise TypeError("array blocks are cut by their rechunk plan, not partitioned by key columns")

    def split(
        self, frame: Any, on: Sequence[Any], npartitions: int, ids: npt.NDArray[np.int64] | None = None
    ) -> dict[int, PackedData]:
        """:meth:`split_for` on one rank, in fresh memory."""
        return self.split_for(frame, on, npartitions, ids)

    def split_for(
        self,
        frame: Any,
        on: Sequence[Any],
        npartitions: int,
        ids: npt.NDArray[np.int64] | None = None,
        *,
        rank: int = 0,
        nranks: int = 1,
        pool: HostPool | None = None,
    ) -> dict[int, PackedData]:
        """Cut block ``frame``: one piece per output partition it reaches, holding its cuts.

        Parameters
        ----------
        frame
            The input block: a NumPy array of the adapter's dtype, shaped as
            the plan's cuts expect.
        on, ids
            Not used (a block is cut by position).
        npartitions
            Output partitions of the run (the plan's :attr:`BlockPlan.npartitions`).
        rank, nranks
            This rank and the run's ranks: pieces of the partitions this
            rank owns (``partition % nranks == rank``) get buffers of their
            own, apart from the buffer of the pieces sent away.
        pool
            Where the pieces' memory comes from; fresh memory without one.

        Returns
        -------
        dict
            ``{partition: PackedData}``; every cut is in, also an empty one
            (every output block hears from every input block it overlaps).

        Raises
        ------
        mpshuffle.errors.ShuffleError
            If the adapter has no plan, the block is not a NumPy array of the
            adapter's dtype, or its shape does not fit the plan's cuts.
        """
        plan, where = self.plan, self.block
        if plan is None or where is None:
            raise ShuffleError("a numpy-block adapter needs its block plan and block index to cut a block")
        check_plain_block(frame, where)
        if frame.dtype != self.dtype:
            # A block may differ from the array's declared dtype where Dask
            # does not enforce it: a big-endian array's blocks arrive on a
            # distributed worker in native byte order, and map_blocks trusts
            # its dtype= argument. A block of the declared dtype in another
            # byte order, or of its kind in fewer bytes (float32 for float64),
            # is cast to it (the output blocks are of that dtype): the values
            # stay exact. Others are refused.
            same_kind_wider = (
                frame.dtype.kind == self.dtype.kind and frame.dtype.kind in "biufc"
                and frame.dtype.itemsize <= self.dtype.itemsize
            )
            if not (np.can_cast(frame.dtype, self.dtype, casting="equiv") or same_kind_wider):
                raise ShuffleError(
                    f"rechunk input block {where} has dtype {frame.dtype}, the array declares {self.dtype}, "
                    "which cannot hold its values exactly"
                )
            frame = frame.astype(self.dtype)
        if frame.ndim != len(plan.cuts):
            raise ShuffleError(
                f"rechunk input block {where} has {frame.ndim} dimensions, the array {len(plan.cuts)}"
            )
        for axis, size in enumerate(frame.shape):
            reach = max((b for _, _, b, _ in plan.cuts[axis][where[axis]]), default=0)
            if reach > size:
                raise ShuffleError(
                    f"rechunk input block {where} has extent {size} on axis {axis}; the array's chunks "
                    f"say {reach}"
                )
        if not self.dtype.hasobject and self.dtype.itemsize:
            grid = _regular_grid(plan, where)
            if grid is not None:
                view_of = where if self.views and frame.size and frame.flags.c_contiguous else None
                return _pack_grid(frame, plan, grid, rank, nranks, pool, view_of)
        # Cuts by partition, in order of output block.
        by_partition: dict[int, list[tuple[int, Any, tuple[int, ...]]]] = {}
        per = plan.per_partition
        for b, slices, offsets in plan.pieces(where):
            by_partition.setdefault(b // per, []).append((b, frame[slices], offsets))
        if self.dtype.hasobject:
            return {
                pid: PackedData(
                    _HEAD.pack(PICKLED, frame.ndim, len(cuts)),
                    _rows(frame.ndim, cuts, [0] * len(cuts)).tobytes()
                    + pickle.dumps([view for _, view, _ in cuts], protocol=5),
                    sum(int(view.size) for _, view, _ in cuts),
                )
                for pid, cuts in by_partition.items()
            }
        return _pack(by_partition, frame.ndim, rank, nranks, pool)

    def unpack(self, pieces: Sequence[PackedData], meta: Any) -> dict[int, Any]:
        """Assemble the output blocks of one output partition from all of its pieces (any order).

        Parameters
        ----------
        pieces
            Every piece of the partition, from :meth:`split_for`.
        meta
            Not used (the adapter's dtype counts).

        Returns
        -------
        dict
            ``{output block: numpy.ndarray}`` (C-order index in the group ->
            the block, C-ordered, shaped by its cuts' extents), for every
            block the pieces hold.

        Raises
        ------
        mpshuffle.errors.ShuffleError
            If there are no pieces, a piece is malformed, or the cuts of a
            block do not cover it exactly once.
        """
        if not pieces:
            raise ShuffleError("an output partition of a rechunk received no pieces")
        read = []
        views: dict[int, _ViewCuts] = {}
        for k, piece in enumerate(pieces):
            if piece.metadata[:1] == bytes([VIEW]):
                views[k] = self._view_cuts(piece.metadata, piece.data)
                read.append((VIEW, len(views[k].layout.strides), views[k].rows))
            else:
                read.append(_read_index(piece.metadata, piece.data))
        ndims = {ndim for _, ndim, _ in read}
        if len(ndims) != 1:
            raise ShuffleError(f"rechunk pieces of {sorted(ndims)} dimensions in one output partition")
        (ndim,) = ndims
        index = np.concatenate([rows for _, _, rows in read])
        blocks, where = np.unique(index[:, 0], return_inverse=True)
        ends = index[:, 2 : 2 + ndim] + index[:, 2 + ndim :]
        extents = np.zeros((len(blocks), ndim), np.int64)
        np.maximum.at(extents, where, ends)
        covered = np.bincount(where, weights=np.prod(index[:, 2 + ndim :], axis=1), minlength=len(blocks))
        raw = self.dtype.itemsize > 0
        # Blocks of one shape (regular chunks) share one array: a piece whose
        # cuts share their place and extent (one input block's cuts of a
        # regular grid) is placed by one assignment, not one per cut. The
        # blocks handed out are views of it.
        same = bool((extents == extents[0]).all())
        stacked = _output_array((len(blocks), *extents[0].tolist()), self.dtype) if same else None
        if stacked is not None:
            out = {int(b): stacked[k] for k, b in enumerate(blocks.tolist())}
        else:
            out = {
                int(b): np.empty(tuple(e), dtype=self.dtype)
                for b, e in zip(blocks.tolist(), extents.tolist(), strict=True)
            }
        at = 0
        # Pieces received in shared memory give their pages back as soon as
        # they are placed (every byte is copied, see copies_pieces): read, a
        # piece is resident in this process, and the extract held all of its
        # received pieces beside its output until the end.
        table = pieces if self.copies_pieces and isinstance(pieces, PieceTable) and pieces.mapped else None
        release = table.release_piece_pages if table is not None else None
        counts = [len(rows) for _, _, rows in read]
        # Which pieces place all their cuts by one assignment into ``stacked``,
        # worked out for all pieces at once (per piece, the checks cost more
        # than the copy of a piece of a few small cuts).
        fits = _one_place_all(index, where, counts, ndim, self.dtype.itemsize) if stacked is not None and raw else None
        one, runs, alike = fits if fits is not None else ((), (), ())
        firsts = index[np.cumsum(counts) - counts].tolist() if fits is not None and len(index) else []
        placed, placed_bytes = 0, 0  # pieces placed, not yet given back (in batches: see release_piece_pages)
        for k, (piece, (fmt, _, rows)) in enumerate(zip(pieces, read, strict=True)):
            mine = where[at : at + len(rows)]
            at += len(rows)
            if release is not None:
                if k and placed_bytes >= RELEASE_BATCH_BYTES:
                    release(placed, k)
                    placed, placed_bytes = k, 0
                placed_bytes += memoryview(piece.data).nbytes
            if fmt == VIEW:
                _place_view(piece.data, views[k], self.dtype, mine, stacked, out, fits is not None and bool(alike[k]))
                continue
            if fits is not None and fmt == RAW and one[k]:
                assert stacked is not None
                first = firsts[k]
                shape = first[2 + ndim :]
                n = math.prod(shape)
                if n:
                    cuts = np.frombuffer(piece.data, self.dtype, n * len(rows), first[1])
                    place = tuple(slice(o, o + e) for o, e in zip(first[2 : 2 + ndim], shape, strict=True))
                    w = int(mine[0])
                    blocks_at: Any = slice(w, w + len(rows)) if runs[k] else mine
                    stacked[(blocks_at, *place)] = cuts.reshape(len(rows), *shape)
                continue
            values = pickle.loads(memoryview(piece.data)[rows.nbytes :]) if fmt == PICKLED else None
            for c, row in enumerate(rows.tolist()):
                shape = row[2 + ndim :]
                n = math.prod(shape)
                if n:
                    if values is not None:
                        cut = values[c]
                    elif raw:
                        cut = np.frombuffer(piece.data, self.dtype, n, row[1]).reshape(shape)
                    else:
                        cut = None
                    if cut is not None:
                        offsets = row[2 : 2 + ndim]
                        out[row[0]][tuple(slice(o, o + s) for o, s in zip(offsets, shape, strict=True))] = cut
        if table is not None:
            table.release_piece_pages(placed, len(table))
            table.forget_mappings()
        sizes = np.array([out[int(b)].size for b in blocks.tolist()], dtype=np.float64)
        if not np.array_equal(covered, sizes):
            bad = int(blocks[np.flatnonzero(covered != sizes)[0]])
            raise ShuffleError(
                f"the cuts of rechunk output block {bad} (shape {out[bad].shape}) do not cover it exactly "
                "once: a piece is missing or came twice"
            )
        return out

    def _view_cuts(self, metadata: bytes, data: Any) -> _ViewCuts:
        """Where the cuts of a :data:`VIEW` piece lie in its data (the plan's cuts of the partition)."""
        plan, partition = self.plan, self.partition
        if plan is None or partition is None:
            raise ShuffleError(
                "a rechunk piece kept as a view of its input block needs the block plan and the output "
                "partition to be assembled; this numpy-block adapter has neither"
            )
        ndim = _HEAD.unpack_from(metadata)[1] if len(metadata) >= _HEAD.size else -1
        if ndim != len(plan.cuts) or len(metadata) != _HEAD.size + ndim * _VIEW_AXIS.size:
            raise ShuffleError(f"a rechunk view piece has a malformed header of {len(metadata)} bytes")
        values = _view_axes(ndim).unpack_from(metadata, _HEAD.size)
        where, shape = values[0::2], values[1::2]
        if any(not 0 <= w < len(c) for w, c in zip(where, plan.cuts, strict=True)):
            raise ShuffleError(f"a rechunk view piece names input block {where}, outside the plan")
        grid = _regular_grid(plan, where, self._grids)
        if grid is None:
            raise ShuffleError(f"a rechunk view piece of input block {where}, whose cuts are not a regular grid")
        # The pieces of one partition from input blocks that differ only in
        # where their cuts land in the output blocks (time-to-space: every
        # time step) share their layout; worked out once per partition. Per
        # axis, what the layout depends on is named once per block index.
        kinds = self._grid_kinds
        parts = []
        for a, (i, g) in enumerate(zip(where, grid, strict=True)):
            part = kinds.get((a, i))
            if part is None:
                part = kinds[a, i] = (g[0], g[1], g[2].tobytes())
            parts.append(part)
        key = (shape, tuple(parts))
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = _view_layout(plan, partition, grid, shape, self.dtype.itemsize)
        if layout.hi <= layout.lo or layout.nbytes != memoryview(data).nbytes:
            raise ShuffleError(
                f"a rechunk view piece of input block {where} does not hold the cuts of output partition "
                f"{partition} ({memoryview(data).nbytes} bytes)"
            )
        rows = layout.rows.copy()
        for a, (g, index) in enumerate(zip(grid, layout.index, strict=True)):
            rows[:, 2 + a] = g[3][index]
        return _ViewCuts(rows, layout)

    def empty_like(self, meta: Any) -> Any:
        """An array with ``meta``'s shape and the adapter's dtype, uninitialized."""
        return np.empty(np.shape(meta), dtype=self.dtype)


@dataclass(frozen=True)
class _ViewLayout:
    """Where the cuts of a partition lie in a :data:`VIEW` piece of input blocks of one grid shape.

    ``rows``: the offset index (byte offsets from the piece's start; the
    columns of the offsets in the output blocks left to each piece);
    ``index``: per axis, each cut's position in the grid along it;
    ``strides``: the block's byte strides; ``lo:hi``: the grid's cuts of
    the partition; ``nbytes``: the piece's bytes; ``segments``: per strided
    copy of :func:`_place_view`'s fast path, ``(byte offset, shape, byte
    strides, first cut, cuts)``.
    """

    rows: npt.NDArray[np.int64]
    index: tuple[npt.NDArray[np.intp], ...]
    strides: list[int]
    lo: int
    hi: int
    nbytes: int
    segments: tuple[tuple[int, tuple[int, ...], tuple[int, ...], int, int], ...]


def _view_layout(plan: BlockPlan, partition: int, grid: _Grid, shape: Sequence[int], itemsize: int) -> _ViewLayout:
    """The :class:`_ViewLayout` of the cuts of ``partition`` in a block of ``shape`` cut by ``grid``."""
    part = _grid_blocks(grid) // plan.per_partition
    lo, hi = (int(i) for i in np.searchsorted(part, [partition, partition + 1]))
    counts = [len(g[2]) for g in grid]
    rows, elem = _grid_rows(grid, shape, lo, hi)
    strides = [st * itemsize for st in _c_strides(shape)]
    ndim = len(grid)
    lengths = [g[1] for g in grid]
    if hi <= lo:
        return _ViewLayout(rows, (), strides, lo, hi, -1, ())
    reach = sum((n - 1) * st for n, st in zip(lengths, _c_strides(shape), strict=True)) + 1
    rows[:, 1] = (elem - elem[0]) * itemsize
    index = tuple(np.asarray(i, dtype=np.intp) for i in np.unravel_index(np.arange(lo, hi), counts))
    segments = []
    done = 0
    for seg in _grid_segments(counts, lo, hi):
        m = len(seg) - 1
        first, last = seg[-1].start, seg[-1].stop
        inner = counts[m + 1 :]
        n = (last - first) * math.prod(inner)
        seg_shape = (last - first, *inner, *lengths)
        steps = (*(lengths[a] * strides[a] for a in range(m, ndim)), *strides)
        segments.append((int(rows[done, 1]), tuple(int(v) for v in seg_shape), tuple(int(v) for v in steps), done, n))
        done += n
    nbytes = (int(elem[-1]) + reach - int(elem[0])) * itemsize
    return _ViewLayout(rows, index, strides, lo, hi, nbytes, tuple(segments))


@dataclass(frozen=True)
class _ViewCuts:
    """The cuts a :data:`VIEW` piece holds: its offset index (byte offsets from the piece's start) and layout."""

    rows: npt.NDArray[np.int64]
    layout: _ViewLayout


def _place_view(
    data: Any, cuts: _ViewCuts, dtype: np.dtype[Any], mine: npt.NDArray[np.intp],
    stacked: npt.NDArray[Any] | None, out: dict[int, Any], together: bool,
) -> None:
    """Copy the cuts of a :data:`VIEW` piece from its byte range of the input block into the output blocks.

    ``together`` (where the output blocks share one array ``stacked``, the
    cuts share their place and extent, and their blocks are consecutive
    there; :func:`_one_place_all`): one strided copy per segment of the grid
    (:func:`_grid_segments`, worked out once per layout) moves them all;
    else one copy per cut.
    """
    rows, strides = cuts.rows, cuts.layout.strides
    ndim = len(strides)
    lengths = rows[0, 2 + ndim :].tolist()

    def at(byte: int, shape: Sequence[int], steps: Sequence[int]) -> Any:
        # A strided view of the piece from ``byte`` on (inside it: the layout says so).
        return np.ndarray(tuple(shape), dtype=dtype, buffer=data, offset=byte, strides=tuple(steps))

    if together and stacked is not None:
        place = tuple(slice(o, o + e) for o, e in zip(rows[0, 2 : 2 + ndim].tolist(), lengths, strict=True))
        for byte, shape, steps, done, n in cuts.layout.segments:
            k = int(mine[done])
            dest = np.reshape(stacked[k : k + n][(slice(None), *place)], shape, copy=False)
            np.copyto(dest, at(byte, shape, steps), casting="no")
        return
    for row in rows.tolist():
        offsets, extents = row[2 : 2 + ndim], row[2 + ndim :]
        out[row[0]][tuple(slice(o, o + e) for o, e in zip(offsets, extents, strict=True))] = at(row[1], extents, strides)


def _one_place_all(
    index: npt.NDArray[np.int64], where: npt.NDArray[np.intp], counts: Sequence[int], ndim: int, itemsize: int
) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.bool_], npt.NDArray[np.bool_]]:
    """Per piece: whether one assignment places all its cuts into the stacked output, by a slice, and alike.

    ``index`` holds the pieces' offset indexes one after the other
    (``counts[k]`` rows for piece ``k``), ``where`` each row's position among
    the output blocks. The first array is true for a piece whose cuts share
    offsets and extents and lie back to back in its data (a grid piece of
    one input block, :func:`_pack_grid`): its cuts are then one array of
    ``(cuts, *extents)`` elements. The second is true where, besides, they
    go to consecutive output blocks (a slice of the stacked output, not a
    list of its blocks). The third is true for a piece whose cuts share
    offsets and extents and go to consecutive output blocks, wherever they
    lie in its data (a :data:`VIEW` piece, see :func:`_place_view`).
    """
    n = np.asarray(counts, np.int64)
    if not len(index):
        return np.zeros(len(n), bool), np.zeros(len(n), bool), np.zeros(len(n), bool)
    piece = np.repeat(np.arange(len(n)), n)
    start = (np.cumsum(n) - n)[piece]
    first = index[start]
    step = np.prod(index[:, 2 + ndim :], axis=1) * itemsize
    pos = np.arange(len(index)) - start
    same = (index[:, 2:] == first[:, 2:]).all(axis=1)
    one = np.bincount(piece, weights=~(same & (index[:, 1] == first[:, 1] + pos * step)), minlength=len(n)) == 0
    consecutive = np.bincount(piece, weights=where != where[start] + pos, minlength=len(n)) == 0
    alike = consecutive & (np.bincount(piece, weights=~same, minlength=len(n)) == 0)
    return one, one & consecutive, alike


def _rows(ndim: int, cuts: Sequence[tuple[int, Any, tuple[int, ...]]], at: Sequence[int]) -> npt.NDArray[np.int64]:
    """A piece's offset index: per cut its output block, byte offset in the data, offsets and extents."""
    rows = np.empty((len(cuts), 2 + 2 * ndim), dtype="<i8")
    for r, ((b, view, offsets), start) in enumerate(zip(cuts, at, strict=True)):
        rows[r, 0] = b
        rows[r, 1] = start
        rows[r, 2 : 2 + ndim] = offsets
        rows[r, 2 + ndim :] = view.shape
    return rows


def _index_bytes(ndim: int, ncuts: int) -> int:
    """Bytes of a piece's offset index (a multiple of 16: each row is ``16 (1 + ndim)`` bytes)."""
    return 8 * (2 + 2 * ndim) * ncuts


def _read_index(metadata: bytes, data: Any) -> tuple[int, int, npt.NDArray[np.int64]]:
    """A piece's format, ``ndim`` and offset index (from its metadata and the start of its data)."""
    if len(metadata) != _HEAD.size:
        raise ShuffleError(f"a rechunk piece has a malformed header of {len(metadata)} bytes")
    fmt, ndim, ncuts = _HEAD.unpack_from(metadata)
    if fmt not in (RAW, PICKLED):
        raise ShuffleError(f"a rechunk piece has unknown format {fmt}")
    width = 2 + 2 * ndim
    size = memoryview(data).nbytes
    if ncuts < 0 or size < _index_bytes(ndim, ncuts):
        raise ShuffleError(f"a rechunk piece's data has {size} bytes, less than the index of {ncuts} cuts of {ndim} axes")
    rows = np.frombuffer(data, "<i8", ncuts * width, 0).reshape(ncuts, width).astype(np.int64)
    return fmt, ndim, rows


def _pack(
    by_partition: dict[int, list[tuple[int, Any, tuple[int, ...]]]], ndim: int, rank: int, nranks: int,
    pool: HostPool | None,
) -> dict[int, PackedData]:
    """Copy the cuts into two buffers: one for the partitions this rank keeps, one for those sent away."""
    # Buffer -1 holds the pieces sent away; buffer -2 the pieces kept (see _pack_grid for why one).
    layout: dict[int, tuple[int, int, int, list[int]]] = {}
    sizes: dict[int, int] = {-1: 0}
    for pid, cuts in by_partition.items():
        owner = -1 if partition_owner(pid, nranks) != rank else -2
        at, total = [], _index_bytes(ndim, len(cuts))
        for _, view, _ in cuts:
            at.append(total)
            total += _round_up(view.nbytes, _CUT_ALIGN)
        base = sizes.get(owner, 0)
        layout[pid] = (owner, base, total, at)
        sizes[owner] = base + _round_up(total, _ALIGN)
    buffers = {
        owner: (pool.allocate(t) if pool is not None else pa.py_buffer(aligned_empty(t))) if t else pa.py_buffer(b"")
        for owner, t in sizes.items()
    }
    arrays = {owner: np.frombuffer(b, dtype=np.uint8) for owner, b in buffers.items() if sizes[owner]}
    pieces = {}
    for pid, cuts in by_partition.items():
        owner, base, total, at = layout[pid]
        rows = _rows(ndim, cuts, at)
        if total:
            target = arrays[owner]
            target[base : base + rows.nbytes] = rows.view(np.uint8).ravel()
            for (_, view, _), start in zip(cuts, at, strict=True):
                if view.nbytes:
                    a = base + start
                    dest = target[a : a + view.nbytes].view(view.dtype).reshape(view.shape)
                    np.copyto(dest, view, casting="no")
            data = buffers[owner].slice(base, total)
        else:
            data = b""
        nelem = sum(int(view.size) for _, view, _ in cuts)
        pieces[pid] = PackedData(_HEAD.pack(RAW, ndim, len(cuts)), data, nelem)
    return pieces


#: Per axis: (first element, cut length, output block * stride per cut, offset per cut).
_Grid = list[tuple[int, int, "npt.NDArray[np.int64]", "npt.NDArray[np.int64]"]]


def _regular_grid(
    plan: BlockPlan, where: tuple[int, ...], cache: dict[tuple[int, int], Any] | None = None
) -> _Grid | None:
    """The block's cuts as a regular grid (equal lengths per axis, back to back), or ``None``.

    Time-to-space and its reverse cut every block so: then one strided copy
    moves all the cuts of the block into cut order, instead of one copy per cut.
    ``cache`` keeps each axis's part by ``(axis, block index)`` (an extract
    reads the grids of many input blocks that share all axes but one).
    """
    grid: _Grid = []
    for axis, i in enumerate(where):
        entry: Any = cache.get((axis, i), False) if cache is not None else False
        if entry is False:
            strides = _c_strides(plan.nout)
            cuts = plan.cuts[axis][i]
            first, length = cuts[0][1], cuts[0][2] - cuts[0][1]
            if length <= 0 or any(b < 0 or a != first + k * length or b - a != length
                                  for k, (_, a, b, _) in enumerate(cuts)):
                entry = None
            else:
                entry = (
                    first, length,
                    np.array([j * strides[axis] for j, _, _, _ in cuts], np.int64),
                    np.array([o for _, _, _, o in cuts], np.int64),
                )
            if cache is not None:
                cache[axis, i] = entry
        if entry is None:
            return None
        grid.append(entry)
    return grid


def _grid_blocks(grid: _Grid) -> npt.NDArray[np.int64]:
    """The output block (C-order index in the group) of every cut of a grid, in cut order (increasing)."""
    block = np.zeros(1, np.int64)
    for g in grid:
        block = (block[:, None] + g[2][None, :]).ravel()
    return block


def _grid_rows(
    grid: _Grid, shape: Sequence[int], lo: int = 0, hi: int | None = None
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """The offset index of a grid's cuts ``lo:hi`` (C order of the grid) and each one's first element in the block.

    Column 1 of the index (the byte offset) is the cut's number; the first
    element is the flat (C-order) position in a C-contiguous block of
    ``shape``, increasing with the cut number.
    """
    ndim = len(grid)
    counts = [len(g[2]) for g in grid]
    hi = math.prod(counts) if hi is None else hi
    number = np.arange(lo, hi, dtype=np.int64)
    index = np.unravel_index(number, counts)
    rows = np.empty((hi - lo, 2 + 2 * ndim), dtype="<i8")
    rows[:, 0] = 0
    rows[:, 1] = number
    elem = np.zeros(hi - lo, np.int64)
    for a, (g, st, i) in enumerate(zip(grid, _c_strides(shape), index, strict=True)):
        rows[:, 0] += g[2][i]
        elem += (g[0] + i * g[1]) * st
        rows[:, 2 + a] = g[3][i]
        rows[:, 2 + ndim + a] = g[1]
    return rows, elem


def _c_strides(shape: Sequence[int]) -> list[int]:
    """Strides in elements of a C-contiguous array of ``shape``."""
    strides, step = [], 1
    for n in reversed(list(shape)):
        strides.append(step)
        step *= int(n)
    return strides[::-1]


def _partition_ranges(part: npt.NDArray[np.int64]) -> list[tuple[int, int]]:
    """The ranges of equal values of the non-decreasing ``part`` (cuts by output partition)."""
    bounds = [0, *(np.flatnonzero(np.diff(part)) + 1).tolist(), len(part)]
    return list(itertools.pairwise(bounds))


def _view_metadata(where: Sequence[int], shape: Sequence[int], ncuts: int) -> bytes:
    """A view piece's metadata: the head, then per axis the input block's position and extent."""
    return _HEAD.pack(VIEW, len(shape), ncuts) + b"".join(
        _VIEW_AXIS.pack(int(w), int(n)) for w, n in zip(where, shape, strict=True)
    )


#: Views of the input block stand in for copies of this rank's pieces only
#: where the byte ranges they hold (each piece's cuts, first byte to last,
#: counted against the run's budget) are at most this many times the bytes
#: of the cuts (a copy's count) ...
VIEW_MAX_SLACK = 2
#: ... and at least this fraction of the block, whose memory they keep alive
#: whole: the budget never misses more than 1.5 times what it counts. Why
#: not half: on 2 ranks an odd number of partitions gives one rank just under
#: half of each block (space-to-time: 12 of 25 partitions, 0.48), and that
#: rank copied its kept pieces into pooled memory held until its last extract
#: (~0.4 GB per worker, the space-to-time peak above P2P's), while the other
#: kept views. On 3 ranks or more (a third of the block or less) they are copied.
VIEW_MIN_SHARE = 0.4
#: An extract gives the pages of the received pieces it has placed back
#: once they add up to this many bytes (one call per run of pieces back to
#: back, :meth:`~mpshuffle.memory.packed.PieceTable.release_piece_pages`),
#: not piece by piece.
RELEASE_BATCH_BYTES = 4 * 2**20
#: A piece sent to another rank goes as a view (its byte range of the input
#: block, written straight into the message: no copy into a pooled buffer
#: first) only where that range is at most this many times its cuts' bytes:
#: every byte of the range crosses, so the range must hold little else.
#: Partitions that tile the block grid whole along the trailing axes
#: (:func:`mpshuffle.dask.rechunk.aligned_per_partition`) give ranges of
#: exactly their cuts.
VIEW_SEND_SLACK = 1.125


def _pack_grid(
    frame: Any, plan: BlockPlan, grid: _Grid, rank: int, nranks: int, pool: HostPool | None,
    view_of: tuple[int, ...] | None = None,
) -> dict[int, PackedData]:
    """Cut a block whose cuts form a regular grid straight into its pieces: one strided copy per byte.

    The cuts lie back to back in C order of the grid (which is the order of
    their output blocks, so each partition's cuts are one byte range). The
    pieces sent away share one buffer (reused once sent), and the pieces this
    rank keeps share another: the run holds them as one chunk, whose memory
    goes only when its last piece is extracted, so a buffer per kept piece
    would free nothing sooner, and it cost a pool block each (64 KiB at
    least): for pieces of 20-40 KB (the out-of-core case: 1536 inputs into
    200 partitions) 1.6-3.2x the bytes the run's budget counted. Every
    byte of the block is copied once, from the block into its piece, by a
    few strided copies per piece (:func:`_grid_segments`).

    With ``view_of`` (the block's position in the group; the block is
    C-contiguous and not empty), the pieces this rank keeps are not copied:
    each is a :data:`VIEW` piece, the byte range of the block from its first
    cut's first byte to its last cut's last byte, which :meth:`NDArrayAdapter.unpack`
    places straight into the output blocks. Why: a copy of the kept half
    costs a copy and a first touch of fresh memory per byte, and the run
    held it beside the input block until its extract (the rechunk's peak).
    Only where the ranges are tight (:data:`VIEW_MAX_SLACK`,
    :data:`VIEW_MIN_SHARE`; otherwise the kept pieces are copied as before):
    the ranges of partitions that interleave in the block overlap, and the
    budget counts every range.

    What does not depend on the block's bytes or on where its cuts land in
    the output blocks (which pieces, their buffers and byte ranges, the
    copies, the offset index but its offsets) is worked out once per grid
    shape and kept (:func:`_grid_pieces`): the blocks of a time-to-space
    rechunk differ only in those, and at 16 ranks a 4 MB block gives 100
    pieces, whose bookkeeping cost ~4x their copies when done per block.
    """
    lay = _grid_pieces(plan, grid, frame.shape, frame.dtype.itemsize, rank, nranks, view_of is not None)
    counts = [len(g[2]) for g in grid]
    lengths = [g[1] for g in grid]
    ndim = len(grid)
    region = frame[tuple(slice(g[0], g[0] + g[1] * n) for g, n in zip(grid, counts, strict=True))]
    split = region.reshape([v for n, length in zip(counts, lengths, strict=True) for v in (n, length)])
    view = split.transpose([*range(0, 2 * ndim, 2), *range(1, 2 * ndim, 2)])

    def fresh(nbytes: int) -> tuple[pa.Buffer | None, Any]:
        if not nbytes:
            return None, None
        buf = pool.allocate(nbytes) if pool is not None else pa.py_buffer(aligned_empty(nbytes))
        return buf, np.frombuffer(buf, dtype=np.uint8)

    # Index 0: the pieces sent away; 1: the pieces kept. Each filled from its start.
    buffers = [fresh(lay.sizes[0]), fresh(lay.sizes[1])]
    if lay.copies:
        rows = lay.rows.copy()
        for a, (g, index) in enumerate(zip(grid, lay.index, strict=True)):
            rows[:, 2 + a] = g[3][index]
        raw = rows.view(np.uint8).reshape(len(rows), -1)
        for (_, shared_bytes), (at, which) in zip(buffers, lay.heads, strict=True):
            if shared_bytes is not None and len(at):
                shared_bytes[(at[:, None] + np.arange(raw.shape[1])).ravel()] = raw[which].ravel()
    pieces = {}
    for pid, keep, start, head, nbytes, segments, nrows, metadata in lay.copies:
        shared, shared_bytes = buffers[keep]
        assert shared is not None
        if nbytes:
            target = np.ndarray((nbytes // lay.cut_bytes, *lengths), frame.dtype, shared_bytes, start + head)
            for where, lo, hi, shape in segments:
                np.copyto(target[lo:hi].reshape(shape), view[where], casting="no")
        pieces[pid] = PackedData(metadata, shared.slice(start, head + nbytes), nrows)
    if lay.views:
        whole = pa.py_buffer(frame)
        metadata = _view_metadata(view_of or (), frame.shape, 0)
        for pid, a, b, nrows in lay.views:
            pieces[pid] = PackedData(metadata, whole.slice(a, b - a), nrows)
    return dict(sorted(pieces.items()))


@dataclass(frozen=True)
class _GridPieces:
    """How :func:`_pack_grid` cuts any block of one grid shape: all of it but the bytes and the cuts' offsets.

    ``rows``: the offset index of every cut (C order of the grid), column 1
    the cut's byte offset in its piece's data, the offsets' columns to be
    filled per block from ``index`` (per axis, each cut's position along
    it); ``sizes``: bytes of the buffer of pieces sent away and of pieces
    kept; ``heads``: per buffer, where each row of the copied pieces'
    indexes goes and which row it is; ``copies``: per copied piece
    ``(partition, buffer, start, index bytes, cut bytes, segments, elements,
    metadata)``, each segment ``(index into the grid view, first cut, end
    cut, shape)``; ``views``: per piece that is a byte range of the block,
    ``(partition, first byte, end byte, elements)``.
    """

    plan: weakref.ref[BlockPlan]
    rows: npt.NDArray[np.int64]
    index: tuple[npt.NDArray[np.intp], ...]
    cut_bytes: int
    sizes: tuple[int, int]
    heads: tuple[tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]], ...]
    copies: tuple[tuple[int, int, int, int, int, tuple[tuple[Any, int, int, tuple[int, ...]], ...], int, bytes], ...]
    views: tuple[tuple[int, int, int, int], ...]

    @property
    def nbytes(self) -> int:
        """About the bytes the layout holds: its arrays, and ~300 per piece for the tuples."""
        arrays = [self.rows, *self.index, *(a for pair in self.heads for a in pair)]
        return sum(a.nbytes for a in arrays) + 300 * (len(self.copies) + len(self.views))


#: :func:`_grid_pieces`' layouts, by plan (its ``id``; the entry holds a weak reference to it, so a plan
#: freed, and another made at its address, is told apart, and a plan is not kept alive here), grid
#: shape, ranks and views.
_GRID_PIECES: dict[Any, _GridPieces] = {}
#: Held while :func:`_grid_pieces` forgets and stores layouts: the inserts of a
#: worker of several threads cut blocks at once, and one thread's scan of the
#: layouts met another's change ("dictionary changed size during iteration").
_GRID_PIECES_LOCK = threading.Lock()
#: The layouts kept are forgotten, all at once, before they would hold more
#: than this many bytes (a block of 160,000 cuts has a layout of ~20 MB).
GRID_PIECES_MAX_BYTES = 64 * 2**20


def _grid_pieces(
    plan: BlockPlan, grid: _Grid, shape: tuple[int, ...], itemsize: int, rank: int, nranks: int, views: bool
) -> _GridPieces:
    """The :class:`_GridPieces` of a block of ``shape`` cut by ``grid`` (see :func:`_pack_grid`), kept per grid shape."""
    key = (id(plan), shape, itemsize, rank, nranks, views, tuple((g[0], g[1], g[2].tobytes()) for g in grid))
    lay = _GRID_PIECES.get(key)
    if lay is not None and lay.plan() is plan:
        return lay
    ndim = len(grid)
    counts = [len(g[2]) for g in grid]
    lengths = [g[1] for g in grid]
    elements = math.prod(lengths)
    cut_bytes = elements * itemsize
    rows, elem = _grid_rows(grid, shape)
    rows[:, 1] *= cut_bytes
    part = rows[:, 0] // plan.per_partition
    ranges = _partition_ranges(part)
    local = [partition_owner(int(part[lo]), nranks) == rank for lo, _ in ranges]
    spans: dict[int, tuple[int, int]] = {}
    every: dict[int, tuple[int, int]] = {}
    sent_views: set[int] = set()
    nbytes_block = math.prod(shape) * itemsize
    if views:
        reach = sum((length - 1) * st for length, st in zip(lengths, _c_strides(shape), strict=True)) + 1
        every = {lo: (int(elem[lo]) * itemsize, (int(elem[hi - 1]) + reach) * itemsize) for lo, hi in ranges}
        spans = {lo: every[lo] for (lo, _), mine in zip(ranges, local, strict=True) if mine}
        held = sum(b - a for a, b in spans.values())
        kept_bytes = sum(hi - lo for (lo, hi), mine in zip(ranges, local, strict=True) if mine) * cut_bytes
        if not (held and held <= VIEW_MAX_SLACK * kept_bytes and held >= VIEW_MIN_SHARE * nbytes_block):
            spans = {}
        sent_views = {
            lo for (lo, hi), mine in zip(ranges, local, strict=True)
            if not mine and every[lo][1] - every[lo][0] <= VIEW_SEND_SLACK * (hi - lo) * cut_bytes
        }
    # Pieces kept apart from those sent: only where more than one rank takes part (see _pack_grid).
    kept = [mine and (nranks > 1 or bool(spans)) for mine in local]
    row_bytes = _index_bytes(ndim, 1)
    at = [0, 0]
    copies = []
    views_out = []
    head_at: list[list[npt.NDArray[np.intp]]] = [[], []]
    head_rows: list[list[npt.NDArray[np.intp]]] = [[], []]
    for (lo, hi), keep in zip(ranges, kept, strict=True):
        pid = int(part[lo])
        if (keep and spans) or (not keep and lo in sent_views):
            a, b = spans[lo] if keep else every[lo]
            views_out.append((pid, a, b, (hi - lo) * elements))
            continue
        head = (hi - lo) * row_bytes
        nbytes = (hi - lo) * cut_bytes
        start = at[keep]
        rows[lo:hi, 1] += head - lo * cut_bytes
        head_at[keep].append(start + np.arange(0, head, row_bytes, dtype=np.intp))
        head_rows[keep].append(np.arange(lo, hi, dtype=np.intp))
        segments = []
        done = 0
        for where in _grid_segments(counts, lo, hi) if nbytes else ():
            # The shape of view[where]: the ranges taken, the axes not indexed, the cut.
            src_shape = (
                *(len(range(*w.indices(n))) for w, n in zip(where, counts, strict=False) if isinstance(w, slice)),
                *counts[len(where):], *lengths,
            )
            n = math.prod(src_shape[: len(src_shape) - ndim])
            segments.append((where, done, done + n, src_shape))
            done += n
        copies.append((pid, int(keep), start, head, nbytes, tuple(segments), (hi - lo) * elements,
                       _HEAD.pack(RAW, ndim, hi - lo)))
        at[keep] += head + nbytes
    heads = []
    for side in (0, 1):
        if head_at[side]:
            # The pieces' indexes, each where its piece starts: their rows' places and rows.
            heads.append((np.concatenate(head_at[side]), np.concatenate(head_rows[side])))
        else:
            heads.append((np.zeros(0, np.intp), np.zeros(0, np.intp)))
    lay = _GridPieces(
        weakref.ref(plan), rows, tuple(np.asarray(i, dtype=np.intp) for i in np.unravel_index(np.arange(len(rows)), counts)),
        cut_bytes, (at[0], at[1]), tuple(heads), tuple(copies), tuple(views_out),
    )
    with _GRID_PIECES_LOCK:
        for old in [k for k, entry in _GRID_PIECES.items() if entry.plan() is None]:
            _GRID_PIECES.pop(old, None)  # its plan is gone: a rechunk that ended
        held = sum(entry.nbytes for entry in _GRID_PIECES.values())
        if held + lay.nbytes > GRID_PIECES_MAX_BYTES:
            _GRID_PIECES.clear()
        if lay.nbytes <= GRID_PIECES_MAX_BYTES:
            _GRID_PIECES[key] = lay
    return lay


def _grid_segments(counts: Sequence[int], lo: int, hi: int) -> Iterator[tuple[Any, ...]]:
    """Index tuples into a grid of ``counts`` cuts that cover cuts ``lo:hi`` (C order), in order.

    Each tuple fixes the leading axes, takes a range of one axis and all of
    the axes after it, so each is one strided copy; a range of cuts gives
    at most two per axis.
    """
    def walk(axis: int, prefix: tuple[Any, ...], lo: int, hi: int) -> Iterator[tuple[Any, ...]]:
        inner = math.prod(counts[axis + 1 :])
        first, last = lo // inner, -(-hi // inner)  # the axis's indices touched
        if lo % inner == 0 and hi % inner == 0:
            yield (*prefix, slice(first, last))
            return
        if last - first == 1:
            yield from walk(axis + 1, (*prefix, first), lo - first * inner, hi - first * inner)
            return
        if lo % inner:
            yield from walk(axis + 1, (*prefix, first), lo - first * inner, inner)
            first += 1
        full_end = hi // inner
        if full_end > first:
            yield (*prefix, slice(first, full_end))
        if hi % inner:
            yield from walk(axis + 1, (*prefix, full_end), 0, hi - full_end * inner)

    if hi > lo:
        yield from walk(0, (), lo, hi)
