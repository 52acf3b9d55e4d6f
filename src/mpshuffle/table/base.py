"""The frame-adapter interface and the registry that picks an adapter for a frame."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from mpshuffle.errors import ShuffleError

if TYPE_CHECKING:
    import numpy.typing as npt

    from mpshuffle.memory.packed import PackedData
    from mpshuffle.memory.pool import HostPool
    from mpshuffle.table.device import DeviceTable

__all__ = ["AdapterRegistry", "FrameAdapter", "check_ids", "get_adapter", "register_adapter"]


class FrameAdapter(ABC):
    """Everything the shuffle needs to know about one kind of frame.

    An adapter hashes a frame's key columns, splits the frame into
    :class:`~mpshuffle.memory.PackedData` pieces (one per output
    partition) and concatenates received pieces back into a frame.

    Attributes
    ----------
    name
        Short name of the frame library, e.g. ``"pandas"``.
    copies_pieces
        Whether :meth:`unpack`'s result holds copies of every byte of the
        pieces, never views of them: then the extract task gives the pieces'
        received shared memory back as soon as it has unpacked them
        (:meth:`~mpshuffle.memory.packed.PieceTable.release_pages`). False
        by default: a frame's columns may be zero-copy views of the pieces.
    """

    name: ClassVar[str]
    copies_pieces: ClassVar[bool] = False

    @abstractmethod
    def matches(self, obj: object) -> bool:
        """Return whether ``obj`` (a frame or a meta) is handled by this adapter."""

    @abstractmethod
    def column_names(self, frame: Any) -> list[Any]:
        """Return the column names of ``frame``, in order."""

    @abstractmethod
    def num_rows(self, frame: Any) -> int:
        """Return the number of rows of ``frame``."""

    @abstractmethod
    def nbytes(self, frame: Any) -> int:
        """Return the in-memory size of ``frame`` in bytes."""

    @abstractmethod
    def partition_ids(
        self, frame: Any, on: Sequence[Any], npartitions: int
    ) -> npt.NDArray[np.int64]:
        """Return the output partition id of every row.

        Parameters
        ----------
        frame
            Shape ``(n, c)``.
        on
            Names of the key columns, in order (the order changes the hash).
        npartitions
            Number of output partitions, ``>= 1``.

        Returns
        -------
        numpy.ndarray
            ``int64``, shape ``(n,)``, values in ``[0, npartitions)``, as
            :func:`mpshuffle.table.hashing.partition_ids`.

        Raises
        ------
        KeyError
            If a key column is missing.
        """

    @abstractmethod
    def split(
        self,
        frame: Any,
        on: Sequence[Any],
        npartitions: int,
        ids: npt.NDArray[np.int64] | None = None,
    ) -> Mapping[int, PackedData]:
        """Split ``frame`` by hash of ``on`` into packed pieces.

        ``ids``, when given, are the rows' output partition ids (``int64``,
        shape ``(n,)``, values in ``[0, npartitions)``) computed by the caller,
        e.g. a range partitioner for sorts; the hash of ``on`` is then not used.

        Returns
        -------
        Mapping
            ``{partition_id: PackedData}`` of the non-empty pieces only (a
            ``dict``, or :class:`~mpshuffle.memory.packed.PackedPieces` where
            the pieces are arrays); the rows of each piece keep their
            original relative order.

        Raises
        ------
        ValueError
            If ``ids`` has another shape or a value outside its range
            (:func:`check_ids`).
        """

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
    ) -> Mapping[int, PackedData]:
        """:meth:`split` on rank ``rank`` of ``nranks``, with memory from ``pool``.

        An adapter that can place its pieces in pooled memory overrides this,
        keeping the pieces that stay on ``rank`` (their partition ``j`` has
        ``j % nranks == rank``) apart from those sent away, so that the
        latter's memory is reused as soon as they are sent. The default
        calls :meth:`split`.
        """
        return self.split(frame, on, npartitions, ids)

    @abstractmethod
    def unpack(self, pieces: Sequence[PackedData], meta: Any) -> Any:
        """Concatenate pieces, in the given order, into one frame shaped like ``meta``.

        Parameters
        ----------
        pieces
            Pieces from :meth:`split` (of any input partitions).
        meta
            Empty frame whose columns and dtypes the result must have.

        Returns
        -------
        frame
            ``[]`` gives :meth:`empty_like` of ``meta``.

        Raises
        ------
        mpshuffle.errors.ShuffleError
            If the data lacks a column of ``meta``, has a column ``meta``
            lacks, or a column cannot be cast to ``meta``'s dtype losslessly.
        """

    @abstractmethod
    def empty_like(self, meta: Any) -> Any:
        """Return a frame with 0 rows and ``meta``'s columns and dtypes."""

    def as_ids(self, frame: Any, ids: Any) -> Any:
        """Return a partitioner's result for ``frame`` as ``int64`` ids where ``frame``'s data is.

        Host adapters give a NumPy array; device adapters an array on the
        frame's device. Shape and range are checked by :func:`check_ids`.
        """
        return np.asarray(ids, dtype=np.int64)

    def device_table(self, frame: Any) -> DeviceTable:
        """Return ``frame`` as the :class:`~mpshuffle.table.device.DeviceTable` a device run takes.

        Only adapters of device frames implement it (without copying the data).

        Raises
        ------
        TypeError
            For host frames, which do not take the device run path.
        """
        raise TypeError(f"{self.name} frames are host data; they do not take the device run path")


def _label_key(label: Any) -> Any:
    """``label`` as a set member: a float NaN label (pandas' for ``None``) equals every other, as in a pandas index."""
    if isinstance(label, float) and math.isnan(label):
        return ("nan",)
    return label


def check_columns(actual: Sequence[Any], expected: Sequence[Any], what: str = "the data") -> None:
    """Raise if a frame's columns and its meta's differ as sets.

    Parameters
    ----------
    actual
        The frame's column names.
    expected
        The meta's column names.
    what
        Names the frame in the message, e.g. ``"input partition 3"``.

    Raises
    ------
    mpshuffle.errors.ShuffleError
        Naming the meta's columns that the frame lacks, or the frame's columns
        that the meta lacks.
    """
    have, want = {_label_key(c) for c in actual}, {_label_key(c) for c in expected}
    missing = [c for c in expected if _label_key(c) not in have]
    if missing:
        raise ShuffleError(
            f"{what} lacks column(s) {missing!r} that the collection's meta declares "
            f"(it has {list(actual)!r})"
        )
    extra = [c for c in actual if _label_key(c) not in want]
    if extra:
        raise ShuffleError(
            f"{what} has column(s) {extra!r} that the collection's meta does not declare "
            f"(meta has {list(expected)!r})"
        )


def check_ids(ids: Any, nrows: int, npartitions: int) -> None:
    """Raise unless ``ids`` are ``nrows`` partition ids in ``[0, npartitions)``.

    Parameters
    ----------
    ids
        Caller-given output partition ids, a 1-D NumPy or CuPy integer array.
    nrows
        Rows of the frame they label.
    npartitions
        Number of output partitions.

    Raises
    ------
    ValueError
        Naming the expected and actual shape, dtype or value range: a row
        with an id outside the range would land in no partition, or another.
    """
    if tuple(ids.shape) != (nrows,):
        raise ValueError(f"partition ids must have shape ({nrows},), got {tuple(ids.shape)}")
    if ids.dtype.kind not in "iu":
        raise ValueError(f"partition ids must be integers, got dtype {ids.dtype}")
    if nrows:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= npartitions:
            raise ValueError(
                f"partition ids must lie in [0, {npartitions}), got values from {lo} to {hi}"
            )


class AdapterRegistry:
    """Ordered set of adapters; the most recently registered match wins.

    The package (``mpshuffle.table``) registers the built-in pandas and pyarrow
    adapters first, so that user registrations override them.
    """

    _adapters: list[FrameAdapter]

    def __init__(self) -> None:
        self._adapters = []

    def register(self, adapter: FrameAdapter) -> None:
        """Add ``adapter``; it takes precedence over those registered before.

        Raises
        ------
        TypeError
            If ``adapter`` is not a :class:`FrameAdapter`.
        """
        if not isinstance(adapter, FrameAdapter):
            raise TypeError(f"expected a FrameAdapter, got {type(adapter).__name__}")
        self._adapters.append(adapter)

    def lookup(self, obj: object) -> FrameAdapter:
        """Return the adapter for ``obj``.

        Raises
        ------
        TypeError
            Naming ``obj``'s type and the registered adapters if none matches.
        """
        for adapter in reversed(self._adapters):
            if adapter.matches(obj):
                return adapter
        cls = type(obj)
        known = ", ".join(a.name for a in self._adapters)
        raise TypeError(
            f"no mpshuffle frame adapter for {cls.__module__}.{cls.__qualname__}; "
            f"registered adapters: {known}. Register one with register_adapter()."
        )


_REGISTRY = AdapterRegistry()


def get_adapter(frame_or_meta: object) -> FrameAdapter:
    """Return the registered adapter for a frame or meta.

    Parameters
    ----------
    frame_or_meta
        A frame (e.g. ``pandas.DataFrame``, ``pyarrow.Table``) or its meta.

    Returns
    -------
    FrameAdapter

    Raises
    ------
    TypeError
        If no adapter handles the object's type (the message names the type).
    """
    return _REGISTRY.lookup(frame_or_meta)


def register_adapter(adapter: FrameAdapter) -> None:
    """Register an adapter for another kind of frame (it overrides earlier ones).

    Parameters
    ----------
    adapter
        The adapter instance.

    Raises
    ------
    TypeError
        If ``adapter`` is not a :class:`FrameAdapter`.
    """
    _REGISTRY.register(adapter)
