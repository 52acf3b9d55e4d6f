"""warm_up loads the kernel signatures that inserts and extracts of the common column types use."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# In a fresh interpreter: in the test process other tests have loaded
# signatures already, so a signature warm_up misses would go unnoticed.
_SCRIPT = textwrap.dedent(
    """
    import numpy as np
    import pandas as pd
    import pyarrow as pa

    from mpshuffle.memory.pool import HostPool
    from mpshuffle.table import PandasAdapter
    from mpshuffle.table._kernels import kernels
    from mpshuffle.table.warm import warm_up, warmed_up

    assert warmed_up() is None
    seconds = warm_up()
    assert seconds > 0 and warmed_up() == seconds
    # It collected the garbage of loading (tens of thousands of objects),
    # which a shuffle's first full collection would otherwise free.
    import gc
    assert gc.collect() < 100
    assert warm_up() == seconds  # once per process

    def loaded():
        k = kernels()
        return {name: len(getattr(k, name).signatures) for name in vars(k)}

    before = loaded()
    rng = np.random.default_rng(0)
    n = 5000
    frame = pd.DataFrame({
        "key": rng.integers(0, 10**9, n),
        "x": rng.random(n),
        "i": rng.integers(0, 100, n).astype(np.int32),
        "flag": rng.random(n) < 0.5,
        "s": pd.Series([f"w{v:010d}" for v in rng.integers(0, 1000, n)], dtype="str"),
        "n": pd.array([None if v % 7 == 0 else int(v) for v in range(n)], dtype="Int64"),
        "t": pd.to_datetime(rng.integers(0, 10**9, n), unit="s"),
        "dec": pd.Series(pd.arrays.ArrowExtensionArray(pa.array(rng.integers(0, 10**6, n).astype(np.int32)).cast(pa.decimal128(15, 2)))),
    })
    adapter = PandasAdapter()
    for npartitions in (2, 60, 256, 257, 1000):
        for on in (["key"], ["x"], ["s"], ["t"], ["key", "s"], ["x", "t"]):
            for pool in (None, HostPool(2**26)):
                pieces = adapter.split_for(frame, on, npartitions, None, rank=1, nranks=3, pool=pool)
                assert sum(p.nrows for p in pieces.values()) == n
                # The extract's kernels too (gather, layouts): all pieces back into one frame.
                back = adapter.unpack(list(pieces.values()), frame.iloc[:0])
                assert sorted(back["key"]) == sorted(frame["key"]) and list(back.dtypes) == list(frame.dtypes)
        ids = rng.integers(0, npartitions, n)
        pieces = adapter.split_for(frame, ["key"], npartitions, ids, rank=0, nranks=2)
        assert {p: q.nrows for p, q in pieces.items()} == dict(zip(*np.unique(ids, return_counts=True)))
    after = loaded()
    assert after == before, (before, after)
    assert sum(after.values()) >= 10, after
    print("ok", after)
    """
)


def test_warm_up_loads_every_signature_of_common_inserts() -> None:
    out = subprocess.run([sys.executable, "-c", _SCRIPT], check=False, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok")


_AFTER_AN_INSERT = textwrap.dedent(
    """
    import pandas as pd

    from mpshuffle.table import PandasAdapter
    from mpshuffle.table._kernels import kernels
    from mpshuffle.table.warm import warm_up, warmed_up

    frame = pd.DataFrame({"k": range(100), "x": [0.5] * 100})
    pieces = PandasAdapter().split_for(frame, ["k"], 4, None, rank=0, nranks=2)
    assert sum(p.nrows for p in pieces.values()) == 100
    k = kernels()
    before = {name: len(getattr(k, name).signatures) for name in vars(k)}
    assert warm_up() == warmed_up() > 0
    after = {name: len(getattr(k, name).signatures) for name in vars(k)}
    assert after == before, (before, after)
    print("ok")
    """
)


def test_warm_up_stops_once_a_real_insert_ran() -> None:
    # That insert loaded what it needed; more would only take its CPU.
    out = subprocess.run([sys.executable, "-c", _AFTER_AN_INSERT], check=False, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok")


_COMPILED = textwrap.dedent(
    """
    from mpshuffle.table._kernels import kernels
    from mpshuffle.table.warm import warm_up

    warm_up()
    k = kernels()
    misses = {name: sum(getattr(k, name).stats.cache_misses.values()) for name in vars(k)}
    hits = sum(sum(getattr(k, name).stats.cache_hits.values()) for name in vars(k))
    print("misses", {n: c for n, c in misses.items() if c}, "hits", hits)
    """
)


def test_a_second_process_loads_the_kernels_from_numba_cache() -> None:
    # A kernel whose cache key changes from process to process (a closure
    # over other compiled functions did) is compiled again by every worker:
    # seconds of CPU in each fresh worker's first shuffle.
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _COMPILED], check=False, capture_output=True, text=True,
                             timeout=240)
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(out.stdout.strip())
    assert runs[1].startswith("misses {} hits "), runs
    assert int(runs[1].rsplit(" ", 1)[1]) > 0, runs


_PAUSED = textwrap.dedent(
    """
    import sys
    import threading
    import time

    from mpshuffle.table import _columns
    from mpshuffle.table.warm import paused, warm_up, warmed_up

    with paused():
        with paused():  # holds nest
            thread = threading.Thread(target=warm_up, daemon=True)
            thread.start()
            time.sleep(0.5)
        time.sleep(0.2)
        # Held between its steps: waiting there, nothing finished.
        assert thread.is_alive() and warmed_up() is None
        frame, names = sys._current_frames()[thread.ident], []
        while frame is not None:
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        assert "_wait_while_paused" in names, names
    thread.join(240)
    assert not thread.is_alive() and warmed_up() is not None
    assert not _columns.INSERTING.is_set()
    print("ok")
    """
)


def test_warm_up_waits_while_paused_and_finishes_after() -> None:
    out = subprocess.run([sys.executable, "-c", _PAUSED], check=False, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok")
