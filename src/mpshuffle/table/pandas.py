"""Frame adapter for ``pandas.DataFrame``.

Packing
-------
Each column is read as buffers where it lies (numpy values, or the Arrow
buffers of Arrow-backed dtypes), hashed in one fused pass and scattered once
into one buffer whose per-partition byte ranges are the pieces
(:mod:`mpshuffle.table._columns`). The pieces carry the Arrow schema with
pandas' metadata (from ``pyarrow.Schema.from_pandas``, which reads dtypes,
not rows), so the reader rebuilds the same dtypes: ``category`` (with
categories), nullable ``Int64``/``boolean``, tz-aware datetimes, the ``str``
dtype.

Each column falls back on its own: a dtype with no raw layout (categoricals,
nested or decimal types) travels as an Arrow IPC stream inside the piece; an
``object`` column Arrow cannot hold losslessly (dicts mixed with numbers,
say), or an ``ArrowDtype`` pandas cannot read back, travels as pickle
protocol 5 of its values. Only a frame whose index levels Arrow cannot hold
(with ``index=True``) is pickled whole. :meth:`PandasAdapter.unpack` reads
any mix of these formats. Unpickling runs code chosen by the sender: pieces
must come only from the shuffle's own ranks, which the communicator
authenticates.

Column names may be strings or integers (or any JSON scalar): Arrow field names
are ``str(name)``, and the original names travel in the header. Names must be
unique, also after ``str``.
"""

from __future__ import annotations

import json
import pickle
import re
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any, ClassVar, Literal, cast

import numpy as np
import pandas as pd
import pyarrow as pa

from mpshuffle.errors import ShuffleError
from mpshuffle.memory.packed import PackedData, distinct_metadata
from mpshuffle.table._columns import (
    Column,
    gather,
    hash_ids,
    is_cols,
    pack,
    pandas_columns,
    pandas_row_split,
    per_schema,
    rank_ids,
    read_piece,
    scratch_empty,
)
from mpshuffle.table._ipc import ARROW, PICKLE, Header, read_ipc, split_by_ids
from mpshuffle.table._reconcile import check_columns, reconcile, same_dtype
from mpshuffle.table.base import FrameAdapter, check_ids
from mpshuffle.table.hashing import PandasRowHash, pandas_row_ids, partition_ids

if TYPE_CHECKING:
    import numpy.typing as npt

    from mpshuffle.memory.pool import HostPool

__all__ = ["PandasAdapter"]

# Conversions Arrow refuses: mixed-type object columns, unsupported objects,
# Python ints past 64 bits (OverflowError), strings with lone surrogates
# (UnicodeEncodeError).
_ARROW_CONVERSION_ERRORS = (
    pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError, UnicodeEncodeError,
)
_JSON_SCALARS = (str, int, float, bool)


def _data_fields(table: pa.Table | pa.Schema) -> list[str]:
    """The fields of ``table`` (or a schema) that are columns of the frame, not a kept index."""
    schema = table if isinstance(table, pa.Schema) else table.schema
    pandas_meta = (schema.metadata or {}).get(b"pandas")
    return list(_data_fields_of(tuple(schema.names), pandas_meta))


@lru_cache(maxsize=256)
def _data_fields_of(names: tuple[str, ...], pandas_meta: bytes | None) -> tuple[str, ...]:
    # Parsing pandas' metadata (JSON) per extract cost ~0.1 ms; every piece of
    # a shuffle has one of a few schemas.
    index = json.loads(pandas_meta).get("index_columns", []) if pandas_meta else []
    return tuple(f for f in names if f not in index)


# Arrow types an ``object`` column may take and still come back as the same
# Python objects. Arrow infers others from the values (struct for dicts, list
# for lists, int64/double for numbers), and those come back changed: dicts gain
# the other rows' keys as None, lists become numpy arrays, 1 becomes 1.0.
_OBJECT_SAFE = (
    pa.types.is_string,
    pa.types.is_large_string,
    pa.types.is_binary,
    pa.types.is_large_binary,
    pa.types.is_boolean,
    pa.types.is_null,
)


def _per_dtype(test: Callable[[Any], bool], dtype: Any) -> bool:
    """``test(dtype)``, remembered per test and dtype; a dtype that does not hash is tried each time."""
    try:
        return _per_dtype_cached(test, dtype)
    except TypeError:  # a dtype that does not hash
        return test(dtype)


@lru_cache(maxsize=512)
def _per_dtype_cached(test: Callable[[Any], bool], dtype: Any) -> bool:
    return test(dtype)


def _extension_round_trips(dtype: Any) -> bool:
    """Whether a column of pandas extension dtype ``dtype`` goes to Arrow and back (remembered per dtype)."""
    return _per_dtype(_extension_converts, dtype)


def _extension_converts(dtype: Any) -> bool:
    """Whether a zero-row column of extension dtype ``dtype`` goes to Arrow and back.

    Pandas' own extension dtypes with an Arrow form (nullable integers,
    ``boolean``, ``string``, ``category``, ``interval``, ``period``, tz-aware
    datetimes) do (where the dtype read back differs, as for python-backed
    ``string``, the extract's reconcile casts it to the meta's); others
    (``Sparse[...]``, which pyarrow refuses with a ``TypeError``, or a third
    party's dtype that cannot convert) travel pickled, as Dask's task and P2P
    shuffles move them. So do ``ArrowDtype`` columns whose type pandas cannot
    name back from the pandas metadata (nested ones such as
    ``list<item: int64>[pyarrow]`` everywhere, dictionary ones under pandas
    2). Tried on a column of zero rows, so the answer is the installed
    pandas' and pyarrow's, once per dtype and process (tried per insert and
    column for ``ArrowDtype`` columns until session 27, it cost 4.5 ms each:
    0.25 s of a worker's 2.7 s in TPC-H lineitem as ``dask.dataframe.read_parquet``
    gives it).
    """
    try:
        empty = pd.DataFrame({"c": pd.array([], dtype=dtype)})
        pa.Table.from_pandas(empty, preserve_index=False).to_pandas()
    except Exception:  # noqa: BLE001 - any failure either way means: do not use Arrow
        return False
    return True


def _object_type_round_trips(t: pa.DataType) -> bool:
    return any(ok(t) for ok in _OBJECT_SAFE)


# Arrow schemas of frames by what decides them (see _schema_of), bounded.
_SCHEMAS: dict[Any, pa.Schema] = {}
_SCHEMAS_MAX = 256


def _schema_of(frame: pd.DataFrame, index: bool, dtypes: tuple[Any, ...]) -> pa.Schema:
    """``pa.Schema.from_pandas(frame, preserve_index=index)``, remembered by the frame's labels and dtypes.

    The schema and its pandas metadata follow from the column labels, their
    dtypes and the labels' own index, and (with ``index``) the index's
    type, names and dtypes; every insert of a shuffle has the same ones, and
    building the schema took ~0.27 ms an insert. A frame with an ``object``
    column or index is not remembered: Arrow infers those types from the values.
    ``dtypes`` is ``tuple(frame.dtypes)``, which the caller has already (~20 us a frame).
    """
    ix = frame.index
    ix_dtypes = tuple(ix.dtypes) if isinstance(ix, pd.MultiIndex) else (ix.dtype,)
    if any(d == object for d in dtypes) or (index and any(d == object for d in ix_dtypes)):
        return pa.Schema.from_pandas(frame, preserve_index=index)
    cols = frame.columns
    try:
        key = (index, tuple(cols), type(cols), tuple(cols.names), str(cols.dtype), dtypes,
               (type(ix), tuple(ix.names), ix_dtypes) if index else None)
        schema = _SCHEMAS.get(key)
    except TypeError:  # a label or dtype that does not hash
        return pa.Schema.from_pandas(frame, preserve_index=index)
    if schema is None:
        schema = pa.Schema.from_pandas(frame, preserve_index=index)
        if len(_SCHEMAS) >= _SCHEMAS_MAX:
            _SCHEMAS.clear()  # not an eviction loop: inserts of other threads may be filling it too
        _SCHEMAS[key] = schema
    return schema


def _pickled_positions(frame: pd.DataFrame, dtypes: tuple[Any, ...]) -> list[int]:
    """Positions of the columns that must travel pickled (each column decides alone).

    An ``object`` column that Arrow cannot convert, or converts to a type
    that does not come back as the same Python objects (see
    ``_OBJECT_SAFE``), and a column of an extension dtype that does not go
    to Arrow and back (``Sparse``, nested ``ArrowDtype``: :func:`_extension_round_trips`).
    ``dtypes`` is ``tuple(frame.dtypes)``.
    """
    out = []
    for i, dtype in enumerate(dtypes):
        if isinstance(dtype, pd.api.extensions.ExtensionDtype) and not _extension_round_trips(dtype):
            out.append(i)
        elif dtype == object:
            column = frame.iloc[:, i]
            try:
                converted = pa.array(column, from_pandas=True)
            except _ARROW_CONVERSION_ERRORS:
                out.append(i)
                continue
            if not _object_type_round_trips(converted.type) or (
                converted.null_count and not _objects_come_back(column.to_numpy())
            ):
                out.append(i)
    return out


def _objects_come_back(values: npt.NDArray[Any]) -> bool:
    """Whether an ``object`` array that Arrow takes as strings, bytes or booleans comes back as the same objects.

    Arrow keeps one kind of missing value (null, back as ``None``):
    ``NaN``, ``pd.NA`` or ``NaT`` among strings came back as ``None``. Such
    columns travel pickled, as Dask's task shuffle moves them. (Values of
    ``numpy.str_`` or ``numpy.bool_`` still come back as ``str`` or
    ``bool``: telling them apart costs a Python call per value, ~75 ms per
    million.)
    """
    missing = pd.isna(values)
    return not missing.any() or all(v is None for v in values[missing])


def _objects_round_trip_index(frame: pd.DataFrame, index_columns: Sequence[Column]) -> bool:
    """Whether every ``object`` index level got an Arrow type that round-trips, its missing values included."""
    if isinstance(frame.index, pd.RangeIndex):
        return True
    dtypes = list(frame.index.dtypes) if frame.index.nlevels > 1 else [frame.index.dtype]
    for k, (dtype, col) in enumerate(zip(dtypes, index_columns, strict=False)):
        if dtype == object and col.array is not None and (
            not _object_type_round_trips(col.array.type)
            or (col.array.null_count and not _objects_come_back(frame.index.get_level_values(k).to_numpy()))
        ):
            return False
    return True


_INDEX_FIELD = re.compile(r"__index_level_\d+__")


def _index_fits_arrow(frame: pd.DataFrame) -> bool:
    """Whether ``frame``'s index goes to Arrow and back with its names and dtypes (with ``index=True``).

    Arrow names a kept index level's field ``str(name)``, or
    ``__index_level_<i>__`` for a level without a name, and its conversion
    back reads names from the fields: a level named ``5`` or ``("a", "b")``
    comes back named ``"5"`` or ``"('a', 'b')"``, a level named
    ``"__index_level_0__"`` comes back without a name, and a level whose
    field has a column's name (an index ``0`` beside a column ``"0"``) makes
    the extract drop that column. Such frames, and those with an index level
    of an extension dtype Arrow's conversion cannot read back (``ArrowDtype``
    of ``list`` or ``dictionary``), travel pickled, as Dask's task shuffle
    moves them: exact, slower.
    """
    index = frame.index
    names = list(index.names)
    if any(n is not None and not isinstance(n, str) for n in names):
        return False
    if any(n is not None and _INDEX_FIELD.fullmatch(n) for n in names):
        return False
    fields = [n if n is not None else f"__index_level_{i}__" for i, n in enumerate(names)]
    if {str(c) for c in frame.columns} & set(fields):
        return False
    if isinstance(index, pd.RangeIndex):
        return True
    dtypes = list(index.dtypes) if index.nlevels > 1 else [index.dtype]
    return all(not isinstance(d, pd.api.extensions.ExtensionDtype) or _index_round_trips(d) for d in dtypes)


def _index_round_trips(dtype: Any) -> bool:
    """Whether a kept index level of extension dtype ``dtype`` goes to Arrow and back (remembered per dtype)."""
    return _per_dtype(_index_converts, dtype)


def _index_converts(dtype: Any) -> bool:
    """Whether a zero-row index level of ``dtype`` comes back from Arrow in ``dtype`` through the extract's conversion."""
    try:
        empty = pd.DataFrame({"c": np.empty(0, np.int64)}, index=pd.Index(pd.array([], dtype=dtype), name="i"))
        table = pa.Table.from_pandas(empty, preserve_index=True)
        back = PandasAdapter(index=True)._index_as_sent(table.to_pandas(), table)
    except Exception:  # noqa: BLE001 - any failure either way means: do not use Arrow
        return False
    return same_dtype(back.index.dtype, dtype)


def _zero_copy_dtype(t: pa.DataType) -> np.dtype[Any] | None:
    """The NumPy dtype a frame column of Arrow type ``t`` can view without a copy, or ``None``."""
    if (pa.types.is_integer(t) or pa.types.is_floating(t)) and t != pa.float16():
        return np.dtype(t.to_pandas_dtype())
    if pa.types.is_timestamp(t) and t.tz is None and t.unit in ("s", "ms", "us", "ns"):
        return np.dtype(f"datetime64[{t.unit}]")
    if pa.types.is_duration(t) and t.unit in ("s", "ms", "us", "ns"):
        return np.dtype(f"timedelta64[{t.unit}]")
    return None


def _owned_to_pandas(table: pa.Table, schema: pa.Schema | None = None) -> pd.DataFrame | None:
    """``table.to_pandas()`` without copying its integer and float columns, for a table this process wrote.

    ``to_pandas`` copies every numeric and time column into a new consolidated block:
    for a gathered partition (:func:`~mpshuffle.table._columns.gather`, whose
    buffers are fresh numpy arrays nothing else holds) that is a second copy
    of most of the output's bytes into fresh pages, with both copies alive
    at once. Here Arrow converts with ``split_blocks=True``, which gives
    those columns as views of the table's buffers, read-only; each is then
    replaced by a writable numpy view of the same buffer (the buffer is
    mutable: the gather's own array), so the frame behaves as one from
    ``to_pandas`` does (its columns can be set in place).

    Integer, float, timezone-naive timestamp and duration columns (units
    ``s``, ``ms``, ``us``, ``ns``, which pandas holds as they are) are taken
    this way. Returns ``None`` (the caller converts as usual) where a column of
    another fixed-width type (timestamps with a time zone, dates, decimals,
    ...) would also come out read-only, or where such a column's buffer cannot
    be matched to a writable view (several chunks, an immutable buffer).

    Parameters
    ----------
    table
        A table whose buffers nothing else refers to (length n rows).
    schema
        The schema object ``table`` was made with, if the caller has it:
        where every column can be viewed, the frame is then built without
        ``to_pandas``, by a plan remembered per schema object (see
        :func:`_direct_frame`).

    Returns
    -------
    pandas.DataFrame or None
        The frame ``table.to_pandas(use_threads=False)`` gives (same columns,
        index and dtypes), or ``None``.
    """
    direct = _direct_frame(table, schema)
    if direct is not None:
        return direct
    views: dict[int, np.ndarray] = {}
    for column in table.columns:
        t = column.type
        if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_boolean(t):
            continue  # Arrow-backed strings, or converted (copied) as today
        dtype = _zero_copy_dtype(t)
        if dtype is None:
            return None
        if column.null_count:
            continue  # converted through float or nullable: copied as today
        if column.num_chunks != 1:
            return None
        chunk = column.chunk(0)
        data = chunk.buffers()[1]
        if data is None or not data.is_mutable:
            return None
        view = np.frombuffer(data, dtype)[chunk.offset : chunk.offset + len(chunk)]
        views[view.__array_interface__["data"][0]] = view
    if not views or not table.num_rows:
        return None
    frame = table.to_pandas(use_threads=False, split_blocks=True)
    columns: dict[int, Any] = {}
    for i in range(frame.shape[1]):
        array = frame.iloc[:, i].array
        values = None
        if isinstance(array, pd.arrays.NumpyExtensionArray):
            values = array.to_numpy()
        elif isinstance(array, (pd.arrays.DatetimeArray, pd.arrays.TimedeltaArray)) and array.dtype.kind in "mM":
            values = np.asarray(array)  # the array's own datetime64/timedelta64 values (tz-naive)
        if values is not None and not values.flags.writeable:
            # A zero-copy view of the table (a converted column, e.g. one with
            # nulls, is a fresh writable array and stays as it is).
            writable = views.get(values.__array_interface__["data"][0])
            if writable is None or writable.dtype != values.dtype or len(writable) != len(values):
                return None  # a column we cannot give back writable: convert as usual
            columns[i] = writable
        else:
            columns[i] = array
    out = pd.DataFrame(columns, index=frame.index, copy=False)
    out.columns = frame.columns
    return out


# What converting a table of a given schema gives, by schema object (per_schema); see _frame_plan.
_FRAME_PLANS: dict[int, tuple[pa.Schema, _FramePlan | None]] = {}


class _FramePlan:
    """How :func:`_direct_frame` builds the frame of a table of one schema (see :func:`_frame_plan`)."""

    __slots__ = ("columns", "dtypes", "index", "labels")

    def __init__(
        self, labels: pd.Index, columns: list[int], dtypes: list[np.dtype[Any]],
        index: tuple[int, np.dtype[Any], Any] | None,
    ) -> None:
        self.labels = labels  # the frame's column index
        self.columns = columns  # the table's columns of the frame's columns, in order
        self.dtypes = dtypes  # their NumPy dtypes
        self.index = index  # (table column, dtype, name) of a one-level index, or None: a RangeIndex


def _frame_plan(schema: pa.Schema, remember: bool = True) -> _FramePlan | None:
    """How ``to_pandas`` converts a table of ``schema``, where it views every column; else ``None``.

    A plan where every field is of a type :func:`_zero_copy_dtype` views,
    ``to_pandas`` of the schema's empty table gives exactly that NumPy
    dtype for each column (no extension dtype named by the pandas
    metadata), and the metadata keeps no index (the frame gets a fresh
    ``RangeIndex``) or one level of such a type (a kept index, as Dask's
    ``shuffle`` keeps it), which ``pandas.Index`` of the values gives as
    ``to_pandas`` does (same class, dtype and name). With ``remember``,
    remembered per schema object: the pieces' schemas are parsed once per
    distinct metadata (:func:`~mpshuffle.table._columns.gather` returns
    them), while ``pyarrow.Table.schema`` is a new object at every access.
    """
    if not remember:
        return _make_frame_plan(schema)
    return per_schema(_FRAME_PLANS, schema, _make_frame_plan)  # type: ignore[no-any-return]


def _make_frame_plan(schema: pa.Schema) -> _FramePlan | None:
    meta = schema.pandas_metadata
    if meta is None:
        return None
    dtypes = [_zero_copy_dtype(t) for t in schema.types]
    if any(d is None for d in dtypes):
        return None
    index_columns = meta.get("index_columns") or []
    if len(index_columns) > 1 or not all(isinstance(c, str) for c in index_columns):
        return None  # several levels, or a RangeIndex kept as metadata: through to_pandas
    names = schema.names
    at = [names.index(c) for c in index_columns if names.count(c) == 1]
    if len(at) != len(index_columns):
        return None
    empty = schema.empty_table().to_pandas(use_threads=False, split_blocks=True)
    columns = [k for k in range(len(names)) if k not in at]
    got = list(empty.dtypes)
    if len(got) != len(columns) or not all(
        isinstance(g, np.dtype) and g == dtypes[k] for g, k in zip(got, columns, strict=True)
    ):
        return None
    index: tuple[int, np.dtype[Any], Any] | None = None
    if at:
        dtype = cast("np.dtype[Any]", dtypes[at[0]])
        made = pd.Index(np.empty(0, dtype), name=empty.index.name, copy=False)
        if type(made) is not type(empty.index) or made.dtype != empty.index.dtype or made.name != empty.index.name:
            return None
        index = (at[0], dtype, empty.index.name)
    elif not (isinstance(empty.index, pd.RangeIndex) and empty.index.name is None):
        return None
    return _FramePlan(empty.columns, columns, [cast("np.dtype[Any]", dtypes[k]) for k in columns], index)


def _arrow_dtype_columns(table: pa.Table, meta: pd.DataFrame, str_names: bool) -> dict[str, tuple[int, pd.Series]]:
    """The data columns of ``table`` that ``meta`` wants as a ``pandas.ArrowDtype`` of their own Arrow type.

    Returns ``{field name: (position in meta, column)}``, each column an
    ``ArrowExtensionArray`` over the table's own chunks (zero copy).
    ``Table.to_pandas`` restores such a dtype only from the pieces' pandas
    metadata, which pyarrow writes as ``object`` for decimals: every
    ``decimal128[pyarrow]`` value of TPC-H lineitem read by
    ``dask.dataframe.read_parquet`` became a Python ``Decimal`` and was cast
    back by :func:`~mpshuffle.table._reconcile.reconcile`, 2.9 s for 600,000
    rows (session 27). ``str_names``: the fields are named ``str(label)``
    (the header kept the labels).
    """
    fields = {name: k for k, name in enumerate(table.column_names)}
    out: dict[str, tuple[int, pd.Series]] = {}
    for position, (label, dtype) in enumerate(meta.dtypes.items()):
        if not isinstance(dtype, pd.ArrowDtype):
            continue
        name = str(label) if str_names else label
        k = fields.get(name) if isinstance(name, str) else None
        if k is None or table.column_names.count(name) != 1 or table.schema.field(k).type != dtype.pyarrow_dtype:
            continue
        out[name] = (position, pd.Series(pd.arrays.ArrowExtensionArray(table.column(k)), name=name, copy=False))
    return out


def _without_columns(table: pa.Table, names: Mapping[str, Any]) -> pa.Table:
    """``table`` without the fields ``names``, its pandas metadata without their entries."""
    keep = [k for k, name in enumerate(table.column_names) if name not in names]
    rest = table.select(keep)
    pandas_meta = rest.schema.pandas_metadata
    if pandas_meta is None:
        return rest
    pandas_meta = dict(pandas_meta)
    pandas_meta["columns"] = [
        c for c in pandas_meta.get("columns") or []
        if not (isinstance(c, dict) and c.get("field_name", c.get("name")) in names)
    ]
    return rest.replace_schema_metadata({**(rest.schema.metadata or {}), b"pandas": json.dumps(pandas_meta).encode()})


def _with_columns(frame: pd.DataFrame, columns: Mapping[str, tuple[int, pd.Series]]) -> pd.DataFrame:
    """``frame`` with ``columns`` (from :func:`_arrow_dtype_columns`) inserted at their positions in the meta."""
    nrows = len(next(iter(columns.values()))[1])
    if frame.shape[1] == 0 and len(frame) != nrows:
        # Arrow converts a table of no columns (every one taken here) to no rows.
        frame = pd.DataFrame(index=pd.RangeIndex(nrows))
    for name, (position, column) in sorted(columns.items(), key=lambda item: item[1][0]):
        column.index = frame.index
        frame.insert(min(position, frame.shape[1]), name, column)
    return frame


def _direct_frame(table: pa.Table, schema: pa.Schema | None = None) -> pd.DataFrame | None:
    """The frame :func:`_owned_to_pandas` gives, built from the buffers without ``to_pandas``, or ``None``.

    For a table whose every column ``to_pandas`` would view (see
    :func:`_frame_plan`), one chunk each, without nulls, over a mutable
    buffer: each column becomes a writable NumPy view of its buffer, and
    the frame is built as :func:`_owned_to_pandas` builds it from those
    views, with the column index ``to_pandas`` gives the schema, and a
    fresh ``RangeIndex`` or the kept index over its column's buffer.
    ``to_pandas`` of a gathered partition of a few hundred rows cost most
    of an extract's unpack at 2000 -> 2000, nearly all of it per call, not
    per row. ``schema``: the schema object ``table`` was made with (its
    plan is remembered by that object), or ``None``.
    """
    plan = _frame_plan(table.schema, remember=False) if schema is None else _frame_plan(schema)
    n = table.num_rows
    if plan is None or not n:
        return None
    views = []
    for column in table.columns:
        if column.num_chunks != 1 or column.null_count:
            return None
        chunk = column.chunk(0)
        data = chunk.buffers()[1]
        if data is None or not data.is_mutable:
            return None
        views.append((data, chunk.offset))
    dtypes = plan.dtypes
    columns = {
        i: np.frombuffer(views[k][0], dtypes[i])[views[k][1] : views[k][1] + n]
        for i, k in enumerate(plan.columns)
    }
    if plan.index is None:
        index = pd.RangeIndex(n)
    else:
        k, dtype, name = plan.index
        data, offset = views[k]
        index = pd.Index(np.frombuffer(data, dtype)[offset : offset + n], name=name, copy=False)
    out = pd.DataFrame(columns, index=index, copy=False)
    out.columns = plan.labels
    return out


def _arrow_type_fits(arrow_type: pa.DataType, dtype: Any) -> bool:
    """Whether a column of ``arrow_type`` is what pandas ``dtype`` holds in Arrow (string types: any of them)."""
    expected = _arrow_type_of(dtype)
    if expected is None:
        return False
    if arrow_type == expected:
        return True
    strings = (pa.types.is_string, pa.types.is_large_string, pa.types.is_string_view)
    return any(t(arrow_type) for t in strings) and any(t(expected) for t in strings)


@lru_cache(maxsize=256)
def _extension_dtype(name: Any) -> Any:
    """The pandas extension dtype a pandas-metadata ``numpy_type`` names, if it converts from Arrow; else ``None``."""
    if not isinstance(name, str):
        return None
    try:
        dtype = pd.api.types.pandas_dtype(name)
    except (TypeError, ValueError):
        return None
    if not isinstance(dtype, pd.api.extensions.ExtensionDtype) or not hasattr(dtype, "__from_arrow__"):
        return None
    return dtype


@lru_cache(maxsize=256)
def _arrow_type_of(dtype: Any) -> pa.DataType | None:
    """The Arrow type pandas gives an empty array of ``dtype``; ``None`` if Arrow cannot hold it."""
    try:
        return pa.array(pd.array([], dtype=dtype)).type
    except (TypeError, ValueError, NotImplementedError, pa.ArrowException):
        return None


def _nullable_ints(table: pa.Table, frame: pd.DataFrame) -> pd.DataFrame:
    """Give Arrow integer columns with nulls a nullable pandas dtype, not ``float64``.

    ``to_pandas`` follows the pandas metadata of the table's (first piece's)
    schema: where that says ``int64`` but concatenated pieces added nulls, it
    converts through ``float64``, which rounds integers above 2**53. A
    nullable ``Int*``/``UInt*`` column is exact; :func:`reconcile` then casts
    it to the meta's dtype, or names the column if that would lose values.
    """
    if not any(column.null_count for column in table.columns):
        return frame
    fixed = {}
    for name in frame.columns:
        if not isinstance(name, str) or name not in table.column_names:
            continue
        column = table.column(name)
        t = column.type
        if pa.types.is_integer(t) and column.null_count and frame[name].dtype.kind == "f":
            sign = "UInt" if pa.types.is_unsigned_integer(t) else "Int"
            dtype = pd.api.types.pandas_dtype(f"{sign}{t.bit_width}")
            fixed[name] = pd.Series(dtype.__from_arrow__(column), index=frame.index, name=name)
    if fixed:
        frame = frame.copy(deep=False)
        for name, series in fixed.items():
            frame[name] = series
    return frame


def _insert_pickled(frame: pd.DataFrame, pickled: Sequence[dict[int, pd.Series]]) -> pd.DataFrame:
    """Put pickled columns back at their positions, concatenated over the pieces."""
    if not pickled or not pickled[0]:
        return frame
    frame = frame.copy(deep=False)
    for position in sorted(pickled[0]):
        parts = [p[position] for p in pickled]
        values = pd.concat(parts, ignore_index=True) if len(parts) > 1 else parts[0]
        # As a Series of its own dtype: an object array given as it is is
        # inferred (datetime.datetime objects became datetime64).
        frame.insert(position, parts[0].name, pd.Series(values.array, index=frame.index, dtype=values.dtype, copy=False))
    return frame


class PandasAdapter(FrameAdapter):
    """Adapter for ``pandas.DataFrame``.

    Parameters
    ----------
    index
        Keep the index through the shuffle (as Arrow columns). ``False``
        (default) drops it like ``ignore_index=True``: the output gets a fresh
        ``RangeIndex``.
    """

    name: ClassVar[str] = "pandas"
    index: bool

    def __init__(self, index: bool = False) -> None:
        self.index = bool(index)

    def matches(self, obj: object) -> bool:
        """Return whether ``obj`` is a ``pandas.DataFrame``."""
        return isinstance(obj, pd.DataFrame)

    def column_names(self, frame: pd.DataFrame) -> list[Any]:
        """Return ``list(frame.columns)``."""
        return list(frame.columns)

    def num_rows(self, frame: pd.DataFrame) -> int:
        """Return the number of rows."""
        return len(frame)

    def nbytes(self, frame: pd.DataFrame) -> int:
        """Return ``frame.memory_usage(deep=True).sum()`` in bytes (index included)."""
        return int(frame.memory_usage(deep=True, index=True).sum())

    def partition_ids(
        self, frame: pd.DataFrame, on: Sequence[Any], npartitions: int
    ) -> npt.NDArray[np.int64]:
        """Return each row's output partition id; see :mod:`mpshuffle.table.hashing`.

        Raises
        ------
        KeyError
            If a column of ``on`` is missing.
        """
        missing = [c for c in on if c not in frame.columns]
        if missing:
            raise KeyError(
                f"key column(s) {missing!r} not in frame columns {list(frame.columns)!r}"
            )
        return partition_ids(frame[list(on)], npartitions)

    def split(
        self,
        frame: pd.DataFrame,
        on: Sequence[Any],
        npartitions: int,
        ids: npt.NDArray[np.int64] | PandasRowHash | None = None,
    ) -> Mapping[int, PackedData]:
        """Split by hash of ``on`` into packed pieces (see the module docstring).

        Returns
        -------
        dict
            ``{partition_id: PackedData}`` of non-empty pieces, rows in their
            original order.

        Raises
        ------
        KeyError
            If a key column is missing.
        ShuffleError
            If two columns have the same label. (Labels Arrow's field names
            cannot carry, such as ``0`` beside ``"0"`` or a ``Timestamp``,
            make the frame travel pickled.)
        """
        return self.split_for(frame, on, npartitions, ids)

    def split_for(
        self,
        frame: pd.DataFrame,
        on: Sequence[Any],
        npartitions: int,
        ids: npt.NDArray[np.int64] | PandasRowHash | None = None,
        *,
        rank: int = 0,
        nranks: int = 1,
        pool: HostPool | None = None,
    ) -> Mapping[int, PackedData]:
        """:meth:`split`, the pieces' memory from ``pool``, kept and sent pieces apart.

        See :meth:`~mpshuffle.table.FrameAdapter.split_for`. ``ids`` may also
        be a :class:`~mpshuffle.table.hashing.PandasRowHash` of the frame's
        rows: the rows then go by pandas' row hash of its columns, computed
        in the fused pass (``on`` is not used).
        """
        if isinstance(ids, PandasRowHash):
            if ids.nrows != len(frame):
                raise ValueError(f"pandas' row hash has {ids.nrows} rows, the frame {len(frame)}")
        elif ids is None:
            missing = [c for c in on if c not in frame.columns]
            if missing:
                raise KeyError(
                    f"key column(s) {missing!r} not in frame columns {list(frame.columns)!r}"
                )
        else:
            ids = np.asarray(ids)
            check_ids(ids, len(frame), npartitions)
        names = self._names(frame)
        if len(frame) == 0:
            return {}
        if names is False or (self.index and not _index_fits_arrow(frame)):
            # Labels or an index that Arrow's field names or conversion would change.
            return self._split_pickle(frame, self._ids(frame, on, npartitions, ids))
        # The columns once, their dtypes from them: ``frame.dtypes`` builds a
        # Series of its own (~50 us on each new input frame).
        items = list(frame.items())
        dtypes = tuple(series.dtype for _, series in items)
        pickled = _pickled_positions(frame, dtypes)
        kept = frame.iloc[:, [i for i in range(frame.shape[1]) if i not in pickled]] if pickled else frame
        try:
            schema = _schema_of(kept, self.index, tuple(kept.dtypes) if pickled else dtypes)
            columns = pandas_columns(kept, self.index, schema, None if pickled else items)
        except _ARROW_CONVERSION_ERRORS:
            return self._split_pickle(frame, self._ids(frame, on, npartitions, ids))
        if self.index and not _objects_round_trip_index(frame, columns[kept.shape[1]:]):
            return self._split_pickle(frame, self._ids(frame, on, npartitions, ids))
        by_name = {str(c): col for c, col in zip(kept.columns, columns, strict=False)}
        empty = scratch_empty(pool)
        for i in pickled:
            col = Column("pickle", i, series=frame.iloc[:, i], source=frame.iloc[:, i])
            columns.append(col)
            by_name[str(frame.columns[i])] = col
        if ids is None:
            split = hash_ids([by_name[str(c)] for c in on], npartitions, len(frame), list(on), empty=empty)
        elif isinstance(ids, PandasRowHash):
            split = pandas_row_split(ids, npartitions, empty=empty)
        else:
            split = rank_ids(ids, npartitions, empty=empty)
        return pack(columns, split, schema, names, pool=pool, owner=(rank, nranks))

    def _ids(
        self, frame: pd.DataFrame, on: Sequence[Any], npartitions: int, ids: Any
    ) -> npt.NDArray[np.int64]:
        if isinstance(ids, PandasRowHash):
            return pandas_row_ids(ids, npartitions)
        return self.partition_ids(frame, on, npartitions) if ids is None else ids

    def _names(self, frame: pd.DataFrame) -> tuple[Any, ...] | None | Literal[False]:
        """The column labels for the header: ``None`` where all are strings, else the labels as JSON scalars, or
        ``False`` where the labels cannot travel that way (the frame then travels pickled).

        Arrow names a field ``str(label)`` and the header restores labels by
        that string, so labels that are not JSON scalars (a ``Timestamp``,
        a tuple) or whose strings collide (``0`` beside ``"0"``) cannot be
        told apart on the way back; Dask's task shuffle moves such frames
        pickled, and so does this; as it does a frame whose column index is
        categorical.

        Raises
        ------
        ShuffleError
            If two columns have the same label.
        """
        columns = [c.item() if isinstance(c, np.generic) else c for c in frame.columns]
        if isinstance(frame.columns.dtype, pd.CategoricalDtype):
            # pyarrow records a categorical column index in its metadata and
            # cannot read that back ("data type 'categorical' not understood").
            return False
        if not frame.columns.is_unique:
            raise ShuffleError(f"column names must be unique, got {columns!r}")
        if all(isinstance(c, str) for c in columns):
            return None
        if not all(isinstance(c, _JSON_SCALARS) for c in columns) or len({str(c) for c in columns}) != len(columns):
            return False
        return tuple(columns)

    def _split_pickle(
        self, frame: pd.DataFrame, ids: npt.NDArray[np.int64]
    ) -> Mapping[int, PackedData]:
        order, runs = split_by_ids(ids)
        if order is not None:
            frame = frame.take(order)
        if not self.index:
            frame = frame.reset_index(drop=True)
        header = Header(PICKLE).encode()
        return {
            pid: PackedData(header, pickle.dumps(frame.iloc[start:stop], protocol=5), stop - start)
            for pid, start, stop in runs
        }

    def unpack(
        self, pieces: Sequence[PackedData], meta: pd.DataFrame, on_lossy_cast: str = "raise"
    ) -> pd.DataFrame:
        """Concatenate pieces in the given order into a frame with ``meta``'s dtypes.

        Arrow pieces are concatenated as Arrow (``promote_options="default"``,
        so Arrow ``null`` columns of all-None pieces promote) and converted
        once; then every column is cast toward ``meta``'s dtype when lossless
        (a lossy one raises, or with ``on_lossy_cast="keep"`` keeps its dtype,
        see :func:`~mpshuffle.table._reconcile.reconcile`).

        Raises
        ------
        ShuffleError
            If a piece lacks a column of ``meta`` (or has one ``meta`` lacks),
            or a column cannot be cast to ``meta``'s dtype without loss; the
            message names the column (and both dtypes).
        """
        if not pieces:
            return self.empty_like(meta)
        if all(is_cols(m) for m in distinct_metadata(pieces)):
            frame, dtypes = self._unpack_cols(pieces, meta)
            return reconcile(frame, meta, on_lossy_cast, dtypes=dtypes)
        headers = [Header.decode(p.metadata) for p in pieces]
        if all(h.fmt == ARROW for h in headers):
            tables = [read_ipc(p.data) for p in pieces]
            for table, header in zip(tables, headers, strict=True):
                check_columns(self._restored(_data_fields(table), header), meta)
            try:
                frame = self._to_pandas(pa.concat_tables(tables, promote_options="default"), headers[0], meta=meta)
            except (pa.ArrowInvalid, pa.ArrowTypeError):
                # Types Arrow cannot unify: let pandas concatenate (to object)
                # and reconcile name the column that does not fit the meta.
                frame = self._concat_frames(pieces, meta)
        else:
            frame = self._concat_frames(pieces, meta)
        return reconcile(frame, meta, on_lossy_cast)

    def _index_as_sent(self, frame: pd.DataFrame, table: pa.Table) -> pd.DataFrame:
        """``frame`` (converted from ``table`` by :meth:`_to_pandas` or :func:`_direct_frame`) with each kept index
        level in the dtype it was sent with.

        Arrow keeps each index level as a column, and its conversion back
        gives a level the NumPy dtype of its Arrow type even where the pieces'
        pandas metadata names an extension dtype (it restores those for
        columns only): a nullable ``Int64`` index with missing values came
        back ``float64`` (integers above 2**53 rounded), a ``string`` one as
        pandas' default ``str``, a ``boolean`` one as ``object``. A level
        whose metadata names an extension dtype that converts from Arrow
        (``__from_arrow__``), from a column of that dtype's own Arrow type, is
        rebuilt from the column, exactly. The meta's index dtype is not a
        target: Dask's task shuffle returns the index as it was sent, and so
        does this (other levels are left as converted).
        """
        if not self.index:
            return frame
        pandas_meta = table.schema.pandas_metadata or {}
        fields = pandas_meta.get("index_columns") or []
        if not fields or len(fields) != frame.index.nlevels or not all(isinstance(f, str) for f in fields):
            return frame  # a RangeIndex kept as metadata
        sent_as = {c.get("field_name"): c.get("numpy_type") for c in pandas_meta.get("columns") or [] if isinstance(c, dict)}
        levels, changed = [], False
        for k, field in enumerate(fields):
            level = frame.index.get_level_values(k)
            sent = _extension_dtype(sent_as.get(field))
            if sent is not None and not same_dtype(level.dtype, sent) and table.column_names.count(field) == 1:
                column = table.column(field)
                exact = None
                if _arrow_type_fits(column.type, sent):
                    try:
                        exact = sent.__from_arrow__(column)
                    except (TypeError, ValueError, NotImplementedError, pa.ArrowException):
                        exact = None
                if exact is not None and len(exact) == len(frame):
                    level, changed = pd.Index(exact, name=level.name, copy=False), True
            levels.append(level)
        if not changed:
            return frame
        index = levels[0] if len(levels) == 1 else pd.MultiIndex.from_arrays(levels, names=frame.index.names)
        frame = frame.copy(deep=False)
        frame.index = index
        return frame

    def _unpack_cols(
        self, pieces: Sequence[PackedData], meta: pd.DataFrame
    ) -> tuple[pd.DataFrame, Sequence[Any] | None]:
        """The pieces as one frame, and its columns' dtypes where they are known without asking it (else ``None``)."""
        gathered = gather(pieces)
        if gathered is not None:
            # One table for all pieces; their schemas have the same field
            # types, so checking the names of each distinct schema is enough.
            table, names, schemas = gathered
            header = Header(ARROW, tuple(names) if names is not None else None)
            for schema in schemas:
                check_columns(self._restored(_data_fields(schema), header), meta)
            direct = _direct_frame(table, schemas[0])
            if direct is not None:
                # What _to_pandas gives (no nulls: nothing for _nullable_ints), with its dtypes.
                if header.names is not None:
                    direct.columns = self._restored([str(c) for c in direct.columns], header)
                plan = _frame_plan(schemas[0])
                return self._index_as_sent(direct, table), plan.dtypes if plan is not None else None
            return self._to_pandas(table, header, owned=True, schema=schemas[0], meta=meta), None
        parts = [read_piece(p) for p in pieces]
        header = Header(ARROW, tuple(parts[0][2]) if parts[0][2] is not None else None)
        checked = set()
        for table, pickled, _ in parts:
            # Pieces of one input partition share a schema: check each distinct
            # one once (parsing the pandas metadata per piece cost as much as
            # reading the pieces, with 60 pieces per output partition).
            pandas_meta = (table.schema.metadata or {}).get(b"pandas")
            key = (tuple(table.column_names), pandas_meta, tuple(s.name for s in pickled.values()))
            if key in checked:
                continue
            checked.add(key)
            names = self._restored(_data_fields(table), header) + [s.name for s in pickled.values()]
            check_columns(names, meta)
        if len({tuple(sorted(p)) for _, p, _ in parts}) > 1:
            # A column pickled in some input partitions and not in others:
            # let pandas concatenate (to object); reconcile checks the meta.
            return self._concat_frames(pieces, meta), None
        try:
            frame = self._to_pandas(pa.concat_tables([t for t, _, _ in parts], promote_options="default"), header,
                                    meta=meta)
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            return self._concat_frames(pieces, meta), None
        return _insert_pickled(frame, [p for _, p, _ in parts]), None

    def _concat_frames(self, pieces: Sequence[PackedData], meta: pd.DataFrame) -> pd.DataFrame:
        frames = []
        for piece in pieces:
            if is_cols(piece.metadata):
                table, pickled, names = read_piece(piece)
                header = Header(ARROW, tuple(names) if names is not None else None)
                part = _insert_pickled(self._to_pandas(table, header, meta=meta), [pickled])
            else:
                header = Header.decode(piece.metadata)
                if header.fmt == PICKLE:
                    part = pickle.loads(piece.data)
                else:
                    part = self._to_pandas(read_ipc(piece.data), header, meta=meta)
            check_columns(list(part.columns), meta)
            frames.append(part)
        return pd.concat(frames, ignore_index=not self.index)

    def _restored(self, field_names: list[str], header: Header) -> list[Any]:
        if header.names is None:
            return field_names
        # The index (when kept) adds fields after the columns; names cover columns only.
        by_str = {str(n): n for n in header.names}
        return [by_str.get(f, f) for f in field_names]

    def _to_pandas(
        self, table: pa.Table, header: Header, owned: bool = False, schema: pa.Schema | None = None,
        meta: pd.DataFrame | None = None,
    ) -> pd.DataFrame:
        # One thread: Dask runs extracts in parallel already, and Arrow's pool
        # threads on top of every task thread cost CPU time, not only wall time
        # (0.067 against 0.049 CPU-s/GB for the benchmark's partitions).
        wrapped = _arrow_dtype_columns(table, meta, header.names is not None) if meta is not None else {}
        if wrapped:
            table = _without_columns(table, wrapped)
        # The rest of a gathered table keeps its zero-copy numeric columns; its
        # schema is no longer the one a direct-frame plan was made for.
        converted = _owned_to_pandas(table, None if wrapped else schema) if owned else None
        if converted is None:
            converted = table.to_pandas(use_threads=False)
        if wrapped:
            converted = _with_columns(converted, wrapped)
        # What the conversion loses beside the data: integers with nulls, a kept index's extension dtypes.
        frame = self._index_as_sent(_nullable_ints(table, converted), table)
        if header.names is not None:
            frame.columns = self._restored([str(c) for c in frame.columns], header)
        return frame

    def empty_like(self, meta: pd.DataFrame) -> pd.DataFrame:
        """Return ``meta`` with 0 rows (and a fresh ``RangeIndex`` unless ``index``)."""
        empty = meta.iloc[:0]
        return empty if self.index else empty.reset_index(drop=True)
