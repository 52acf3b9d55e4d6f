"""Load the insert's and the extract's compiled kernels ahead of the first shuffle: :func:`warm_up`.

The kernels (:mod:`mpshuffle.table._kernels`) are numba functions compiled
once per machine into numba's cache, but every process still loads them on
first use: importing numba, then one cache load per combination of argument
types (key and column dtypes, the width of partition ids). On the 2-core
development machine the first insert of a fresh worker spent 1.0-1.4 s
(0.4-0.9 CPU-s) there, and compiling from an empty cache takes seconds.
:func:`warm_up` does that work on a tiny frame of the common column types,
through the same code path as a real insert, so the signatures it loads are
the ones a real insert of such columns asks for. The Dask worker plugin runs
it on a thread as the worker joins a generation (option ``preload_kernels``),
so the cost moves out of the first shuffle's inserts; numba releases the GIL
often enough on the way (longest hold measured: 0.2 s loading, 1.2 s
compiling) that the worker's event loop and heartbeats keep going. A real
insert that starts meanwhile stops it (see :func:`warm_up`).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["paused", "warm_up", "warmed_up"]

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()
_DONE: list[float] = []  # seconds the warm-up of this process took, once done
# Holders of paused(): while there are any, warm_up waits between its steps.
_PAUSE = threading.Condition()
_HOLDERS = [0]

#: Partition counts whose partition-id dtypes the warm-up covers: up to 256
#: partitions ids are ``uint8``, up to 65,536 ``uint16`` (``_pick_dtype``).
PARTITION_COUNTS = (60, 300)


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Hold a running :func:`warm_up` between its steps while the ``with`` body runs.

    For work on the worker's event loop that needs the GIL often and soon,
    above all a generation's bootstrap (each of its messages waits for the
    loop): a warm-up thread loading kernels takes the GIL in stretches, and
    the loop then gets it back only at the interpreter's switch interval
    (5 ms) per hand-off. Measured on the 2-core development machine with 16
    workers: a bootstrap took 3.5 s while the kernels loaded and 0.25 s
    after. (On the lent 16-core host a fresh 16-worker cluster's first graph
    also took 2.2-3.6 s against 0.03 s, but pausing did not change that:
    there every worker was setting up the host's GPU as it joined, which
    :class:`~mpshuffle.shuffler.context.WorkerContext` now does only at its
    first device run.) The warm-up finishes the step it is in
    (one or two signatures: ~0.2 s loading, longer where it compiles) and
    waits. Holds nest; the body may be asynchronous code (nothing here blocks).
    """
    with _PAUSE:
        _HOLDERS[0] += 1
    try:
        yield
    finally:
        with _PAUSE:
            _HOLDERS[0] -= 1
            _PAUSE.notify_all()


def _wait_while_paused() -> None:
    with _PAUSE:
        while _HOLDERS[0]:
            _PAUSE.wait()


def warm_up() -> float:
    """Load (or compile) the insert's kernels for the common column types, once per process.

    Splits 64-row pandas frames of ``int64``, ``int32``, ``float64``,
    ``bool``, ``str``, nullable ``Int64`` (with a missing value) and
    ``datetime64[ns]`` columns by an ``int64``, ``float64``, ``str`` or
    ``datetime64`` key, by given ``int64`` partition ids (a sort's), and by
    pandas' row hash of an ``int64``, ``float64`` or (hashed) ``str`` key
    (Dask's rule, :class:`~mpshuffle.table.hashing.PandasRowHash`), into
    60 and 300 partitions; the 60 partitions' pieces of each hashed split are
    then extracted into one frame (:meth:`PandasAdapter.unpack`, the gather
    and layout kernels of :mod:`mpshuffle.table._gather`, which every extract
    of such columns calls), and dropped. It stops early once
    an insert of this process asked for the kernels (that insert loads what
    it needs; on a worker that starts shuffling at once, loading the rest
    would only take CPU from it), and waits between steps while :func:`paused`
    is held. Then it collects the garbage that loading
    left (see the code). Thread-safe; later calls return at once.

    Returns
    -------
    float
        Seconds the warm-up took in this process (the first call's figure on
        later calls).
    """
    with _LOCK:
        if _DONE:
            return _DONE[0]
        t0 = time.perf_counter()
        _wait_while_paused()
        import numpy as np
        import pandas as pd
        import pyarrow as pa

        from mpshuffle.table import _columns
        from mpshuffle.table.hashing import PandasRowHash
        from mpshuffle.table.pandas import PandasAdapter

        n = 64
        rows = np.arange(n)
        frame = pd.DataFrame({
            "i64": rows.astype(np.int64),
            "i32": rows.astype(np.int32),
            "f64": rows.astype(np.float64) / 3,
            "b": rows % 2 == 0,
            "s": pd.Series([f"v{i}" for i in rows], dtype="str"),
            "n": pd.array([None if i == 0 else i for i in rows], dtype="Int64"),
            "t": pd.to_datetime(rows, unit="s"),
            # What dask.dataframe.read_parquet gives for decimals (e.g. TPC-H's prices).
            "dec": pd.Series(pd.arrays.ArrowExtensionArray(pa.array(rows.astype(np.int32)).cast(pa.decimal128(15, 2)))),
        })
        adapter = PandasAdapter()
        # Small steps, most common first, each loading one or two signatures
        # (columns, key, given ids): an insert that starts meanwhile waits
        # for one step at most.
        # The third element: how rows are placed ("": the key's hash; "ids":
        # given ids, a sort's range partitioner; "pandas": pandas' row hash,
        # Dask's rule, of the key's values or, for "s", of its hashes).
        steps: list[tuple[list[str], list[str], str]] = [
            (["i64", "f64"], ["i64"], ""),
            (["i64", "f64"], ["i64"], "pandas"),
            (["i64", "s"], ["i64"], ""),
            (["f64"], ["f64"], ""),
            (["f64"], ["f64"], "pandas"),
            (["s"], ["s"], ""),
            (["s"], ["s"], "pandas"),
            (["i64", "i32"], ["i64"], ""),
            (["i64", "b"], ["i64"], ""),
            (["i64", "n"], ["i64"], ""),
            (["t"], ["t"], ""),
            (["i64", "dec"], ["i64"], ""),
            (["i64"], ["i64"], "ids"),
        ]
        _columns.WARMING.on = True
        try:
            for npartitions in PARTITION_COUNTS:
                for names, on, placed in steps:
                    _wait_while_paused()
                    if _columns.INSERTING.is_set():
                        # A real insert runs: it loads what it needs itself,
                        # and loading more here would only take its CPU.
                        break
                    ids: Any = None
                    if placed == "ids":
                        ids = rows % npartitions
                    elif placed == "pandas":
                        key = frame[on[0]]
                        hashed = key.dtype.kind not in "iufb"
                        column = pd.util.hash_pandas_object(key, index=False).to_numpy() if hashed else key.to_numpy()
                        ids = PandasRowHash((column,), (hashed,))
                    pieces = adapter.split_for(frame[names], on, npartitions, ids, rank=0, nranks=2)
                    if npartitions == PARTITION_COUNTS[0] and placed != "ids":
                        # The extract's kernels (gather, layouts) for these
                        # columns: without this the first extract loads
                        # them (compiles them, on an empty cache).
                        adapter.unpack(list(pieces.values()), frame[names].iloc[:0])
        finally:
            _columns.WARMING.on = False
        # Loading the kernels leaves ~34,000 objects of cyclic garbage; left
        # alone, a generation-2 collection in the first shuffle freed them,
        # holding the GIL for 0.14 s. Collected here, it holds it off any run.
        gc.collect()
        _DONE.append(time.perf_counter() - t0)
        logger.debug("mpshuffle: kernels warmed up in %.2f s", _DONE[0])
        return _DONE[0]


def warmed_up() -> float | None:
    """Seconds :func:`warm_up` took in this process, or ``None`` if it has not finished here."""
    return _DONE[0] if _DONE else None
