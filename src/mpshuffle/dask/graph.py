"""The shuffle as a Dask graph: insert tasks -> one barrier task -> extract tasks.

``shuffle_graph`` works on any collection of frames that has an adapter in
:mod:`mpshuffle.table` (pandas DataFrames, pyarrow Tables, ...). Its tasks
find their run at execution time, not when the graph is built:

* on a ``distributed`` worker, through the worker plugin, which asks the
  scheduler plugin once per run (binding the graph to the current
  generation, bootstrapping one if the workers changed);
* without a distributed Client (Dask's synchronous or threaded scheduler),
  in this process on the ``local`` communicator.

Dask's multiprocessing scheduler cannot run a shuffle (its tasks share no
state) and is refused with a clear error.
"""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing
import pickle
import time
import uuid
from collections.abc import Sequence
from typing import Any, cast

import cloudpickle
import numpy as np
from dask._task_spec import Task, TaskRef
from dask.base import tokenize

from mpshuffle.config import max_npartitions, resolve_options
from mpshuffle.dask.runtime import LocalRuntime, RunInfo, Runtime
from mpshuffle.errors import PartitionGoneError, ShuffleError, phase
from mpshuffle.memory.packed import PieceTable
from mpshuffle.options import Options
from mpshuffle.shuffler.context import WorkerContext
from mpshuffle.shuffler.device import is_device_meta
from mpshuffle.shuffler.host import Shuffler
from mpshuffle.shuffler.run import Run
from mpshuffle.table import FrameAdapter, PandasAdapter, get_adapter
from mpshuffle.table.base import check_columns, check_ids
from mpshuffle.table.device import DeviceTable
from mpshuffle.table.gpu import register_device_adapter
from mpshuffle.table.hashing import PandasRowHash

__all__ = ["ShuffleSpec", "output_tasks", "shuffle_graph", "shuffle_spec"]

_LOCAL = LocalRuntime()


@dataclasses.dataclass(frozen=True)
class ShuffleSpec:
    """What every task of one shuffle graph knows.

    Attributes
    ----------
    token
        Deterministic token of the graph (input keys, columns, partitions).
    on
        Key column names.
    npartitions
        Number of output partitions.
    meta
        An empty frame with the output's columns and dtypes.
    insert_name, barrier_name, extract_name
        Key names of the graph's three kinds of task.
    keep_index
        Whether a pandas index travels with the rows.
    partitioner
        ``None`` (hash partitioning of ``on``), or a picklable callable
        ``partitioner(frame) -> int64 ids`` (shape ``(n,)``, values in
        ``[0, npartitions)``) that replaces the hash, e.g. a range partitioner;
        for pandas frames it may return a
        :class:`~mpshuffle.table.hashing.PandasRowHash` instead (the insert
        then hashes those columns by pandas' row hash, Dask's rule).
    device
        Whether the run is a device run (the meta is device data, see
        :func:`~mpshuffle.shuffler.device.is_device_meta`).
    on_lossy_cast
        ``"raise"`` (a column that does not fit the meta's dtype is an error)
        or ``"keep"`` (it keeps the data's dtype, as in Dask's own shuffles;
        pandas frames).
    options
        The run's options, resolved where the graph was built (the client's
        ``dask.config``): the scheduler and the workers read them from here,
        never from their own configuration (but for the worker options the
        client left unset, see :func:`mpshuffle.config.with_worker_config`).
    select
        ``None`` (every column of the input travels), or the input columns
        that travel, in the output's order (``meta``'s columns): each insert
        computes its rows' partitions from the whole frame, then sends only
        these.
    """

    token: str
    on: tuple[Any, ...]
    npartitions: int
    meta: Any
    insert_name: str
    barrier_name: str
    extract_name: str
    keep_index: bool = False
    partitioner: Any = None
    device: bool = False
    on_lossy_cast: str = "raise"
    options: Options = dataclasses.field(default_factory=Options)
    select: tuple[Any, ...] | None = None

    @property
    def start_name(self) -> str:
        """Key of the shuffle's start task (:func:`started`), which every insert task depends on."""
        return f"{self.insert_name.rsplit('-insert-', 1)[0]}-start-{self.token}"

    def __dask_tokenize__(self) -> tuple[Any, ...]:
        # Every task carries the spec; its token already names the shuffle.
        # Without this, tokenizing the graph normalizes the meta once per task.
        return ("mpshuffle.ShuffleSpec", self.token, self.insert_name, self.extract_name)

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        # Every task carries the spec, and the scheduler pickles each task it
        # sends (and the worker unpickles it): pickling the meta, options and
        # partitioner anew took ~0.3 ms a task, ~1.2 s of scheduler CPU for a
        # 2000 -> 2000 shuffle. The fields are pickled once per spec, and a
        # worker unpickles each distinct spec once (see _spec_of).
        blob = self.__dict__.get("_pickled")
        if blob is None:
            fields = tuple(getattr(self, f.name) for f in dataclasses.fields(self))
            try:
                blob = pickle.dumps(fields, protocol=5)
            except (pickle.PicklingError, AttributeError, TypeError):
                blob = cloudpickle.dumps(fields, protocol=5)  # e.g. a partitioner defined in __main__
            object.__setattr__(self, "_pickled", blob)
        return (_spec_of, (blob,))


@functools.lru_cache(maxsize=64)  # bounded: a long-lived worker sees many shuffles
def _spec_of(blob: bytes) -> ShuffleSpec:
    """The :class:`ShuffleSpec` whose fields pickle to ``blob`` (its ``__reduce__``), unpickled once per process.

    The tasks of one shuffle then share one spec object in a worker.
    """
    spec = ShuffleSpec(*pickle.loads(blob))
    object.__setattr__(spec, "_pickled", blob)
    return spec


def check_npartitions(npartitions: Any, limit: int | None = None) -> int:
    """Return ``npartitions`` as an ``int`` in ``[1, limit]``; ``limit`` by default ``mpshuffle.max-npartitions``.

    Read where the graph is built from the user's ``dask.config`` (the
    client); a graph materialized elsewhere (Dask's own operations, on the
    scheduler) was checked when it was lowered on the client and passes
    ``limit`` on, so the scheduler's configuration never decides.

    Raises
    ------
    TypeError
        If it is not an integer (a float such as ``2.7``, a bool, a string).
    ValueError
        If it is < 1, or above ``mpshuffle.max-npartitions`` (100,000 by
        default; see :func:`mpshuffle.config.max_npartitions` for why): the
        message names the limit and how to raise it.
    """
    if isinstance(npartitions, bool) or not isinstance(npartitions, (int, np.integer)):
        raise TypeError(f"npartitions must be an integer, got {npartitions!r}")
    if npartitions < 1:
        raise ValueError(f"npartitions must be >= 1, got {npartitions}")
    if limit is None:
        limit = max_npartitions()
    if npartitions > limit:
        raise ValueError(
            f"npartitions={int(npartitions)} is more than mpshuffle.max-npartitions ({limit}), the "
            "guard against graphs too large to schedule: every output partition is a task that Dask's "
            f"scheduler places and tracks (about 1 ms each, so ~{int(npartitions) / 1000:,.1f} s of "
            "scheduling here before the data moves). If you mean it, raise the limit: "
            f"dask.config.set({{'mpshuffle.max-npartitions': {int(npartitions)}}})"
        )
    return int(npartitions)


def shuffle_graph(
    input_keys: Sequence[Any],
    *,
    on: Sequence[Any],
    npartitions: int,
    meta: Any,
    keep_index: bool = False,
    name: str = "mpshuffle",
    token: str | None = None,
    partitioner: Any = None,
    on_lossy_cast: str = "raise",
    options: Options | None = None,
    select: Sequence[Any] | None = None,
) -> tuple[dict[Any, Any], list[Any]]:
    """Build the tasks of a shuffle over a collection of frames.

    Parameters
    ----------
    input_keys
        Keys of the input partitions (frames of one adapter's type), in order.
    on
        Key column names; rows with equal keys end up in one output partition.
    npartitions
        Number of output partitions (>= 1).
    meta
        Empty frame with the columns and dtypes of the input (and output);
        with ``select``, of the output (the selected columns).
    keep_index
        Keep a pandas index with the rows (otherwise it is dropped).
    name
        Prefix of the task keys.
    token
        Token for the keys; by default one from the arguments (the options
        included). A token given here is used as it is, so it must already
        tell apart graphs that differ in their options.
    partitioner
        Optional picklable callable mapping an input frame to the ``int64``
        output partition id of each row (shape ``(n,)``, values in
        ``[0, npartitions)``); by default rows are hash partitioned on ``on``.
    on_lossy_cast
        What an extract does with a column whose values do not fit the
        meta's dtype: ``"raise"`` an error, or ``"keep"`` the data's dtype
        (pandas frames; what Dask's own shuffles do).
    options
        The run's :class:`~mpshuffle.options.Options`; by default resolved
        here from this process's ``dask.config`` (call this where the graph
        is built, on the client, or pass the client's options).
    select
        Optional input column names that travel, in output order (``meta``'s
        columns): the partitioner (or the hash of ``on``) sees the whole input
        frame, the shuffle moves only these; an input lacking one of them
        fails its insert with :class:`~mpshuffle.errors.ShuffleError` naming it.

    Returns
    -------
    graph : dict
        Tasks keyed by ``name-start-token`` (the run's start, which every
        insert depends on), ``(name-insert-token, i)``, ``name-barrier-token``
        and ``(name-extract-token, j)``; the input keys' own tasks are not
        included.
    keys : list
        The output keys ``(name-extract-token, j)``, ``j`` in ``range(npartitions)``.

    Raises
    ------
    ValueError
        If ``on`` is empty, ``npartitions`` < 1, ``on_lossy_cast`` is not one
        of its two values, or ``keep_index`` is asked for cudf frames (their
        index does not travel).
    TypeError
        If ``meta``'s type has no frame adapter.
    mpshuffle.errors.OptionError
        If an ``mpshuffle.*`` option in ``dask.config`` is unknown or invalid.

    Notes
    -----
    Output partition ``j`` is produced on the worker of rank
    ``partition_owner(j, nranks)``; rows within it are ordered by input
    partition, then by position in that partition.
    """
    input_keys = list(input_keys)
    spec = shuffle_spec(
        on=on, npartitions=npartitions, meta=meta, keep_index=keep_index, name=name, token=token,
        partitioner=partitioner, on_lossy_cast=on_lossy_cast, options=options, select=select,
        input_keys=input_keys,
    )
    graph: dict[Any, Any] = {spec.start_name: (started, spec)}
    insert_keys = []
    for i, key in enumerate(input_keys):
        k = (spec.insert_name, i)
        # The spec comes from the start task (a TaskRef: a plain string
        # argument is taken for a key only where Dask knows it is one).
        graph[k] = Task(k, insert, TaskRef(key), i, TaskRef(spec.start_name))
        insert_keys.append(k)
    tasks, out = output_tasks(spec, insert_keys)
    graph.update(tasks)
    return graph, out


def shuffle_spec(
    *,
    on: Sequence[Any],
    npartitions: int,
    meta: Any,
    keep_index: bool = False,
    name: str = "mpshuffle",
    token: str | None = None,
    partitioner: Any = None,
    on_lossy_cast: str = "raise",
    options: Options | None = None,
    select: Sequence[Any] | None = None,
    input_keys: Sequence[Any] = (),
    npartitions_limit: int | None = None,
) -> ShuffleSpec:
    """The :class:`ShuffleSpec` that every task of one shuffle carries, its arguments checked.

    Parameters are :func:`shuffle_graph`'s; ``input_keys`` only enters the
    default token (a ``token`` given is used as it is, so it must already
    tell apart shuffles that differ in any of these arguments);
    ``npartitions_limit`` is :func:`check_npartitions`' ``limit``.

    Returns
    -------
    ShuffleSpec
        With key names ``name-insert-token``, ``name-barrier-token`` and
        ``name-extract-token``.

    Raises
    ------
    ValueError, TypeError, mpshuffle.errors.OptionError
        As :func:`shuffle_graph`.
    """
    on = tuple(on)
    if not on:
        raise ValueError("shuffle needs at least one key column in 'on'")
    npartitions = check_npartitions(npartitions, npartitions_limit)
    # Decided once, here, and carried by every task (ShuffleSpec.options):
    # the scheduler and the workers never read their own dask.config for a run.
    if options is None:
        options = resolve_options()
    if select is not None:
        select = tuple(select)
        if partitioner is None and not set(on) <= set(select):
            raise ValueError(
                f"select {list(select)!r} must keep the key columns {list(on)!r} "
                "when no partitioner is given (the hash reads them)"
            )
    if on_lossy_cast not in ("raise", "keep"):
        raise ValueError(f"on_lossy_cast must be 'raise' or 'keep', got {on_lossy_cast!r}")
    device = is_device_meta(meta)
    if device:
        register_device_adapter()  # a CuPy table's adapter, registered on first use
        if keep_index and not isinstance(meta, DeviceTable):
            raise ValueError(
                "a shuffle of cudf frames does not carry the index: pass ignore_index=True "
                "(keep_index=False)"
            )
    get_adapter(meta)  # raises TypeError for unsupported frame types
    token = token or tokenize(
        list(input_keys), on, npartitions, keep_index, name, partitioner, options.as_dict(), select
    )
    return ShuffleSpec(
        token=token,
        on=on,
        npartitions=npartitions,
        meta=meta,
        insert_name=f"{name}-insert-{token}",
        barrier_name=f"{name}-barrier-{token}",
        extract_name=f"{name}-extract-{token}",
        keep_index=keep_index,
        partitioner=partitioner,
        device=device,
        on_lossy_cast=on_lossy_cast,
        options=options,
        select=select,
    )


def output_tasks(
    spec: ShuffleSpec, insert_keys: Sequence[Any], extract_name: str | None = None
) -> tuple[dict[Any, Any], list[Any]]:
    """The barrier and extract tasks of ``spec``'s shuffle, after the insert tasks ``insert_keys``.

    ``insert_keys`` are the keys of tasks that each return an
    :class:`Inserted` (:func:`insert`'s result), in any order; a key may
    name a task that computes its input partition and inserts it in one go
    (Dask's blockwise fusion of the insert into its input's task).
    ``extract_name`` names the extract tasks (by default
    ``spec.extract_name``; the scheduler plugin finds them as the barrier's
    dependents, whatever their name).

    Returns
    -------
    graph : dict
        The barrier ``spec.barrier_name`` and the extracts
        ``(spec.extract_name, j)``.
    keys : list
        The output keys, ``j`` in ``range(spec.npartitions)``.
    """
    graph: dict[Any, Any] = {spec.barrier_name: (barrier, spec, *insert_keys)}
    out = []
    name = spec.extract_name if extract_name is None else extract_name
    for j in range(spec.npartitions):
        k = (name, j)
        graph[k] = (extract, spec.barrier_name, j, spec)
        out.append(k)
    return graph, out


# -- the tasks -----------------------------------------------------------


def started(spec: ShuffleSpec) -> ShuffleSpec:
    """Task: the shuffle's start, on which every insert depends; returns ``spec`` (the inserts take it from here).

    One task that all inserts depend on makes the graph have one root where
    it had one per input partition. Dask orders a graph (``dask.order.order``)
    by walking, for every root it places, every output that root reaches: in
    an all-to-all graph that is n roots x n outputs, 20 s of the scheduler's
    CPU at 5000 -> 5000 (0.22 s with one root; ``benchmarks/results/README.md``).
    """
    return spec


@dataclasses.dataclass(frozen=True)
class Inserted:
    """What an insert task returns to the barrier: the run it inserted into, and its attempt id."""

    op_id: int
    generation: str
    attempt: str


def _runtime(spec: ShuffleSpec) -> Runtime:
    """The worker plugin on a distributed worker, else the local runtime."""
    try:
        from distributed import get_worker

        worker = get_worker()
    except ValueError:
        worker = None
    if worker is None:
        if multiprocessing.parent_process() is not None:
            raise ShuffleError(
                "mpshuffle cannot run on Dask's multiprocessing scheduler: its tasks share no "
                "state. Use a distributed Client, or the 'threads' or 'sync' scheduler."
            )
        return _LOCAL
    from mpshuffle.dask.worker import PLUGIN_NAME, ShuffleWorkerPlugin

    if PLUGIN_NAME not in worker.plugins:
        from distributed import get_client

        from mpshuffle.dask.bootstrap import register_plugins

        register_plugins(get_client())
        # The scheduler answers a registration at once when another one (a
        # task on another worker, the client building the graph) got there
        # first, while that one's broadcast may not have reached this worker
        # yet: wait for it to arrive.
        waited = spec.options.bootstrap_timeout
        deadline = time.monotonic() + waited
        while PLUGIN_NAME not in worker.plugins:
            if time.monotonic() > deadline:
                raise ShuffleError(
                    f"worker {worker.address}: mpshuffle's worker plugin did not arrive within "
                    f"{waited:g} s of registering it (bootstrap_timeout)"
                )
            time.sleep(0.01)
    plugin = cast(ShuffleWorkerPlugin, worker.plugins[PLUGIN_NAME])
    return plugin  # mypy checks here that the plugin implements Runtime


def _bind(spec: ShuffleSpec, inserting: bool = False) -> tuple[RunInfo, WorkerContext, Runtime]:
    runtime = _runtime(spec)
    run = runtime.get_run(
        spec.token, spec.npartitions, options=spec.options, extract_name=spec.extract_name,
        barrier_name=spec.barrier_name, inserting=inserting,
    )
    return run, runtime.context_for(run), runtime


def _run_of(ctx: WorkerContext, run: RunInfo, spec: ShuffleSpec) -> Run:
    """This rank's share of ``run``, with the run's own options from the graph."""
    return ctx.shuffler(
        run.op_id, device=spec.device, timeout=spec.options.timeout, batch_bytes=spec.options.batch_bytes
    )


def _where(ctx: WorkerContext) -> str:
    return f"rank {ctx.rank} ({ctx.workers[ctx.rank] if ctx.workers else ''})"


def insert(frame: Any, input_index: int, spec: ShuffleSpec, adapter: FrameAdapter | None = None) -> Inserted:
    """Task: split input partition ``input_index`` and send its pieces (or keep them, on a device run).

    ``adapter`` splits the frame; by default the registered adapter of its type.
    """
    # Names this execution: if Dask abandons it (its run restarted while it
    # ran), the barrier accepts another attempt's data for this partition.
    attempt = uuid.uuid4().hex[:16]
    with phase("bootstrap"):
        run, ctx, runtime = _bind(spec, inserting=True)
    with runtime.guard("insert", run, ctx):
        meta_adapter = get_adapter(spec.meta) if adapter is None else adapter
        adapter = get_adapter(frame) if adapter is None else adapter
        _check_meta(adapter, frame, input_index, spec)
        whole = frame
        if spec.select is not None:
            names = adapter.column_names(frame)
            present = set(names)
            missing = [c for c in spec.select if c not in present]
            if missing:
                raise ShuffleError(
                    f"input partition {input_index} lacks the column(s) {missing!r} "
                    f"that the shuffle sends (it has {names!r})"
                )
            frame = frame[list(spec.select)]  # a view: pandas copies on write
        check_columns(
            adapter.column_names(frame), meta_adapter.column_names(spec.meta),
            what=f"input partition {input_index}",
        )
        adapter = _with_index(adapter, spec)
        ids = None if spec.partitioner is None else _partitioner_ids(adapter, whole, spec)
        _run_of(ctx, run, spec).insert_frame(
            input_index, frame, adapter, spec.on, spec.npartitions, ids, attempt=attempt
        )
    return Inserted(run.op_id, run.generation, attempt)


def insert_parts(parts: Sequence[tuple[Any, FrameAdapter]], input_index: int, spec: ShuffleSpec) -> Inserted:
    """Task body: insert several frames cut by position (a rechunk's blocks, each with its own adapter) as one input.

    On a host run (:class:`~mpshuffle.shuffler.host.Shuffler`) their pieces
    go together, per destination rank in chunks sized as one insert's
    (:meth:`~mpshuffle.shuffler.host.Shuffler.insert_frames`); on other runs
    each frame is inserted in turn under the same input index and attempt.

    Raises
    ------
    ShuffleError
        If a frame's adapter does not fit the collection's meta, or as
        :func:`insert`.
    """
    attempt = uuid.uuid4().hex[:16]
    with phase("bootstrap"):
        run, ctx, runtime = _bind(spec, inserting=True)
    with runtime.guard("insert", run, ctx):
        for frame, adapter in parts:
            _check_meta(adapter, frame, input_index, spec)
        target = _run_of(ctx, run, spec)
        if isinstance(target, Shuffler):
            target.insert_frames(input_index, list(parts), spec.npartitions, attempt=attempt)
        else:
            for frame, adapter in parts:
                target.insert_frame(input_index, frame, adapter, spec.on, spec.npartitions, attempt=attempt)
    return Inserted(run.op_id, run.generation, attempt)


def _check_meta(adapter: FrameAdapter, frame: Any, input_index: int, spec: ShuffleSpec) -> None:
    """Raise ``ShuffleError`` if ``adapter`` (the frame's) does not take the collection's meta."""
    if not adapter.matches(spec.meta):
        raise ShuffleError(
            f"input partition {input_index} is a {type(frame).__name__}, but the collection's "
            f"meta is a {type(spec.meta).__name__}"
        )


def _with_index(adapter: FrameAdapter, spec: ShuffleSpec) -> FrameAdapter:
    if spec.keep_index and isinstance(adapter, PandasAdapter):
        return PandasAdapter(index=True)
    return adapter


def _partitioner_ids(adapter: FrameAdapter, frame: Any, spec: ShuffleSpec) -> Any:
    # The partitioner sees the task's frame (a cudf frame stays one); its ids
    # go where the frame's data is (host or the frame's GPU). Key columns to
    # hash by pandas' row hash (Dask's rule) go to the insert's fused pass.
    result = spec.partitioner(frame)
    if isinstance(result, PandasRowHash):
        return result
    ids = adapter.as_ids(frame, result)
    try:
        check_ids(ids, adapter.num_rows(frame), spec.npartitions)
    except ValueError as e:
        raise ShuffleError(f"the partitioner {spec.partitioner!r} returned bad ids: {e}") from None
    return ids


def barrier(spec: ShuffleSpec, *inserted: Inserted) -> RunInfo:
    """Task: tell every rank that all inserts are done, and wait for them to confirm.

    Returns the run, for the extract tasks.
    """
    ops = {(r.op_id, r.generation) for r in inserted}
    with phase("bootstrap"):
        run, ctx, runtime = _bind(spec)
    if ops and ops != {(run.op_id, run.generation)}:
        # An insert that was running when its run restarted finished with the
        # old run's result: its data went to the old run, so compute again.
        reason = f"its inserts ran in different runs {sorted(ops)}"
        runtime.restart_run(run, reason)
        raise ShuffleError(f"barrier phase: shuffle {spec.token}: {reason}")
    with runtime.guard("barrier", run, ctx):
        accepted = [r.attempt for r in inserted]
        _run_of(ctx, run, spec).barrier(spec.npartitions, accepted=accepted)
    return run


def extract(run: RunInfo, partition_id: int, spec: ShuffleSpec, adapter: FrameAdapter | None = None) -> Any:
    """Task: wait for output partition ``partition_id`` of ``run`` and return it as a frame.

    ``adapter`` unpacks the pieces; by default the registered adapter of the meta's type.
    """
    runtime = _runtime(spec)
    # Pinned by the scheduler plugin; a task that lands elsewhere moves.
    runtime.check_owner(run, partition_id)
    with phase("extract"):
        ctx = runtime.context_for(run)
    adapter = _with_index(get_adapter(spec.meta) if adapter is None else adapter, spec)
    try:
        with runtime.guard("extract", run, ctx):
            shuffler = _run_of(ctx, run, spec)
            pieces = shuffler.extract(partition_id)
    except PartitionGoneError as e:
        # Dask computes this partition again while the barrier's result is
        # still in memory (its output was released or lost): this rank
        # handed the data out already, so the whole run is computed again.
        runtime.restart_run(run, f"output partition {partition_id} was asked for again ({e})")
        raise
    # Outside the guard: a piece that does not fit the meta is a data error,
    # not a wait that timed out, so it must not retire the generation.
    with phase("extract", _where(ctx)), shuffler.scope():
        if spec.on_lossy_cast != "raise" and isinstance(adapter, PandasAdapter):
            out = adapter.unpack(pieces, spec.meta, on_lossy_cast=spec.on_lossy_cast)
        else:
            out = adapter.unpack(pieces, spec.meta)
    if isinstance(pieces, PieceTable) and (adapter.copies_pieces or pieces.copied):
        # The result holds none of the pieces' bytes: their received memory
        # goes now, not at this rank's last extract.
        pieces.release_pages()
    runtime.extracted(run, ctx)
    return out
