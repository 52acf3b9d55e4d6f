"""Dask's own operations with dataframe.shuffle.method = "mpshuffle", on a LocalCluster.

Each test runs one Dask operation through the config line (or
``shuffle_method=``), checks the result against pandas, and checks in the
scheduler's task stream that mpshuffle's tasks (keys ``mpshuffle-...``) ran.
"""

from __future__ import annotations

import asyncio
import difflib
import importlib.util
import re
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from distributed import Client, get_task_stream

import mpshuffle.dask
import mpshuffle.errors
from conftest import worker_state
from mpshuffle.dask import method

MP = {"dataframe.shuffle.method": "mpshuffle"}


def _frames() -> tuple[pd.DataFrame, pd.DataFrame]:
    rng = np.random.default_rng(7)
    n = 3000
    left = pd.DataFrame({
        "k": rng.integers(0, 400, n),
        "g": rng.integers(0, 50, n),
        "v": rng.random(n),
        "s": rng.choice(["a", "b", "c", "d"], n),
    })
    right = pd.DataFrame({"k": np.arange(0, 500, 2), "w": np.arange(250) * 1.5})
    # The dtypes Dask gives these frames (strings become Arrow strings).
    return dd.from_pandas(left, 1).compute(), dd.from_pandas(right, 1).compute()


@contextmanager
def _mpshuffle_ran(client: Client) -> Iterator[dict[str, int]]:
    """Count the tasks that ran, by kind (insert/barrier/extract of mpshuffle, and others)."""
    counts: dict[str, int] = {}
    with get_task_stream(client) as ts:
        yield counts
    for t in ts.data:
        key = t["key"]
        name = key[0] if isinstance(key, tuple) else key
        if name.startswith("mpshuffle"):
            kind = "-".join(name.split("-")[:2])
        elif name.rsplit("-", 1)[0].endswith("-mpshuffle"):
            kind = "mpshuffle-insert"  # fused into its input's task by Dask (MPInsert)
        else:
            kind = "other"
        counts[kind] = counts.get(kind, 0) + 1
    assert counts.get("mpshuffle-insert", 0) > 0 and counts.get("mpshuffle-extract", 0) > 0, counts
    assert counts.get("mpshuffle-barrier", 0) > 0, counts


def _same_rows(got: pd.DataFrame, exp: pd.DataFrame) -> None:
    cols = list(exp.columns)
    pd.testing.assert_frame_equal(
        got.sort_values(cols).reset_index(drop=True), exp.sort_values(cols).reset_index(drop=True)
    )


def _clean(client: Client) -> None:
    for state in client.run(worker_state).values():
        assert state["shufflers"] == [] and state["spill"] == [], state


def test_shuffle(client: Client) -> None:
    left, _ = _frames()
    df = dd.from_pandas(left, npartitions=5)
    with dask.config.set(MP), _mpshuffle_ran(client) as ran:
        out = df.shuffle("k", npartitions=7)
        parts = client.compute(out.to_delayed(), sync=True)
    assert ran["mpshuffle-extract"] == 7
    owner: dict[int, int] = {}
    for j, p in enumerate(parts):
        for key in p["k"].unique():
            assert owner.setdefault(key, j) == j  # every key in one output partition
    pd.testing.assert_frame_equal(pd.concat(parts).sort_index(), left)  # index travels
    _clean(client)


def test_parquet_as_dask_reads_it(client: Client, tmp_path: Path) -> None:
    """Decimals, dates and strings in row groups, read by dask.dataframe.read_parquet: the dtypes and rows of tasks.

    The strings and decimals arrive as Arrow columns in several chunks (one
    per row group) and leave as ArrowDtype / str columns of the meta's dtypes.
    """
    import decimal

    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(5)
    for part in range(3):
        n = 2500
        table = pa.table({
            "k": rng.integers(0, 300, n),
            "price": pa.array([decimal.Decimal(int(v)) / 100 if v % 13 else None for v in rng.integers(0, 10**7, n)],
                              pa.decimal128(15, 2)),
            "day": pa.array([int(v) for v in rng.integers(0, 3000, n)], pa.int32()).cast(pa.date32()),
            "note": pa.array([f"note {v} " * int(v % 5) for v in rng.integers(0, 10**6, n)], pa.string()),
        })
        pq.write_table(table, tmp_path / f"part{part}.parquet", row_group_size=700)
    df = dd.read_parquet(str(tmp_path))
    assert df.npartitions == 3
    expected = df.shuffle("k", npartitions=4, shuffle_method="tasks").compute()
    with dask.config.set(MP), _mpshuffle_ran(client) as ran:
        parts = client.compute(df.shuffle("k", npartitions=4).to_delayed(), sync=True)
    assert ran["mpshuffle-extract"] == 4
    got = pd.concat(parts)
    assert got.dtypes.to_dict() == expected.dtypes.to_dict()
    assert isinstance(got["price"].dtype, pd.ArrowDtype)
    _same_rows(got.astype({"price": object}), expected.astype({"price": object}))
    owner = {key: j for j, p in enumerate(parts) for key in p["k"].unique()}
    assert len(owner) == sum(p["k"].nunique() for p in parts)  # every key in one output partition
    with dask.config.set(MP):
        merged = df.merge(df[["k", "day"]].rename(columns={"day": "day2"}), on="k").compute()
    assert len(merged) == len(expected.merge(expected[["k", "day"]].rename(columns={"day": "day2"}), on="k"))
    _clean(client)


@pytest.mark.parametrize("bad", [{"mpshuffle.timout": 5}, {"mpshuffle.timeout": -1}], ids=["typo", "value"])
def test_bad_options_in_dask_config_are_refused_when_the_graph_is_built(client: Client, bad: dict[str, Any]) -> None:
    """Also once a generation exists, which the workers' bootstrap would not recheck."""
    from mpshuffle.dask import bootstrap_dask_cluster
    from mpshuffle.errors import OptionError

    bootstrap_dask_cluster(client)
    left, right = _frames()
    df = dd.from_pandas(left, npartitions=3)
    name = next(iter(bad)).split(".", 1)[1].replace("-", "_")
    with dask.config.set({**MP, **bad}), get_task_stream(client) as ts:
        with pytest.raises(OptionError, match=name):
            df.shuffle("k", npartitions=4).compute()
        with pytest.raises(OptionError, match=name):
            mpshuffle.dask.merge(df, dd.from_pandas(right, npartitions=2), on="k").compute()
    # Refused on the client: no task of a shuffle ran.
    assert not [t for t in ts.data if "mpshuffle" in str(t["key"])], ts.data
    with dask.config.set(MP):
        _same_rows(df.shuffle("k", npartitions=4).compute(), left)


def test_merge_and_join(client: Client) -> None:
    left, right = _frames()
    a, b = dd.from_pandas(left, npartitions=6), dd.from_pandas(right, npartitions=4)
    for how in ("inner", "left", "right", "outer"):
        with _mpshuffle_ran(client):
            got = a.merge(b, on="k", how=how, shuffle_method="mpshuffle").compute()
        _same_rows(got, left.merge(right, on="k", how=how))
    with dask.config.set(MP), _mpshuffle_ran(client):
        got = a.join(b.set_index("k"), on="k", how="inner").compute()
    _same_rows(got, left.join(right.set_index("k"), on="k", how="inner"))
    _clean(client)


def test_broadcast_join_stays_broadcast(client: Client) -> None:
    left, right = _frames()
    a, b = dd.from_pandas(left, npartitions=32), dd.from_pandas(right, npartitions=2)
    with dask.config.set(MP):
        names = {type(e).__name__ for e in a.merge(b, on="k").optimize(fuse=False).expr.walk()}
        got = a.merge(b, on="k").compute()
    assert "BroadcastJoin" in names and "MPShuffle" not in names, names
    _same_rows(got, left.merge(right, on="k"))
    with dask.config.set({"dataframe.shuffle.method": "tasks"}):
        tasks = {type(e).__name__ for e in a.merge(b, on="k").optimize(fuse=False).expr.walk()}
    assert "BroadcastJoin" in tasks


def test_groupby_split_out(client: Client) -> None:
    left, _ = _frames()
    df = dd.from_pandas(left, npartitions=6)
    with dask.config.set(MP), _mpshuffle_ran(client):
        out = df.groupby("g").agg({"v": "sum", "k": "max"}, split_out=3)
        assert out.npartitions == 3
        got = out.compute()
    pd.testing.assert_frame_equal(got.sort_index(), left.groupby("g").agg({"v": "sum", "k": "max"}))
    _clean(client)


def test_drop_duplicates_split_out(client: Client) -> None:
    left, _ = _frames()
    df = dd.from_pandas(left, npartitions=6)
    with dask.config.set(MP), _mpshuffle_ran(client):
        got = df[["g", "s"]].drop_duplicates(split_out=4).compute()
    _same_rows(got, left[["g", "s"]].drop_duplicates())


def test_set_index_and_sort_values(client: Client) -> None:
    left, _ = _frames()
    df = dd.from_pandas(left.sample(frac=1, random_state=1), npartitions=6)
    with dask.config.set(MP), _mpshuffle_ran(client):
        indexed = df.set_index("v")
        got = indexed.compute()
    assert indexed.known_divisions
    pd.testing.assert_frame_equal(got, left.set_index("v").sort_index())
    with _mpshuffle_ran(client):
        # Per partition: .compute() of a sort gathers it into one partition and sorts there.
        out = df.sort_values(["g", "k"], shuffle_method="mpshuffle")
        got = pd.concat(client.compute(out.to_delayed(), sync=True))
    exp = left.sample(frac=1, random_state=1).sort_values(["g", "k"])
    assert got[["g", "k"]].values.tolist() == exp[["g", "k"]].values.tolist()
    _same_rows(got, exp)
    _clean(client)


def test_int_key_joined_to_float_key_follows_dask(client: Client) -> None:
    a = pd.DataFrame({"k": np.arange(40), "x": np.arange(40)})
    b = pd.DataFrame({"k": np.arange(0, 40, 2, dtype=float), "y": np.arange(20)})
    da, db = dd.from_pandas(a, npartitions=4), dd.from_pandas(b, npartitions=3)
    with dask.config.set(MP), warnings.catch_warnings(record=True), _mpshuffle_ran(client):
        got = da.merge(db, on="k").compute()
    _same_rows(got, a.merge(b, on="k"))


def test_merge_on_index_and_shuffle_on_index_name(client: Client) -> None:
    left, right = _frames()
    a = dd.from_pandas(left, npartitions=5)
    b = dd.from_pandas(right.set_index("k"), npartitions=3).clear_divisions()
    with dask.config.set(MP), _mpshuffle_ran(client):
        got = a.merge(b, left_on="k", right_index=True).compute()
    _same_rows(got, left.merge(right.set_index("k"), left_on="k", right_index=True))
    named = dd.from_pandas(left.set_index("g"), npartitions=4)
    with dask.config.set(MP), _mpshuffle_ran(client):
        parts = client.compute(named.shuffle("g", npartitions=3).to_delayed(), sync=True)
    for j, p in enumerate(parts):
        for other in parts[j + 1:]:
            assert not set(p.index) & set(other.index)
    pd.testing.assert_frame_equal(
        pd.concat(parts).sort_values(["g", "k", "v"]), left.set_index("g").sort_values(["g", "k", "v"])
    )


@pytest.mark.parametrize("scheduler", ["sync", "threads"])
def test_local_schedulers(scheduler: str) -> None:
    left, right = _frames()
    a, b = dd.from_pandas(left, npartitions=4), dd.from_pandas(right, npartitions=3)
    with dask.config.set({**MP, "scheduler": scheduler}):
        got = a.merge(b, on="k", how="left").compute()
        sums = a.groupby("g").v.sum(split_out=2).compute()
        keys = [k[0] if isinstance(k, tuple) else k for k in dict(a.shuffle("k").dask)]
    assert any(str(k).startswith("mpshuffle-insert") for k in keys)
    _same_rows(got, left.merge(right, on="k", how="left"))
    pd.testing.assert_series_equal(sums.sort_index(), left.groupby("g").v.sum())


def test_async_client(cluster: Any) -> None:
    left, right = _frames()
    a, b = dd.from_pandas(left, npartitions=4), dd.from_pandas(right, npartitions=3)

    async def main() -> tuple[pd.DataFrame, pd.Series, list[Any], dict[str, Any]]:
        async with Client(cluster.scheduler_address, asynchronous=True) as c:
            await c.get_task_stream()  # the scheduler records the stream from now on
            start = time.time()
            with dask.config.set(MP):
                joined = await c.compute(a.merge(b, on="k", how="left"))
                sums = await c.compute(a.groupby("g").v.sum(split_out=2))
            stream = await c.get_task_stream(start=start)
            # A sort samples its divisions with dask.compute while the graph is
            # built, which an asynchronous client may refuse (set_index always,
            # sort_values on older dask): mpshuffle gives what Dask's tasks give.
            outcomes: dict[str, Any] = {}
            for op in ("set_index", "sort_values"):
                for m in ("tasks", "mpshuffle"):
                    with dask.config.set({"dataframe.shuffle.method": m}):
                        try:
                            outcomes[op, m] = await c.compute(getattr(a, op)("v"))
                        except Exception as e:  # noqa: BLE001  (whatever Dask raises)
                            outcomes[op, m] = f"{type(e).__name__}: {e}"
            return joined, sums, [t["key"] for t in stream], outcomes

    joined, sums, keys, outcomes = asyncio.run(main())
    _same_rows(joined, left.merge(right, on="k", how="left"))
    pd.testing.assert_series_equal(sums.sort_index(), left.groupby("g").v.sum())
    names = {str(k[0] if isinstance(k, tuple) else k) for k in keys}
    assert any(n.startswith("mpshuffle-insert") for n in names), names
    for op in ("set_index", "sort_values"):
        tasks, mps = outcomes[op, "tasks"], outcomes[op, "mpshuffle"]
        if isinstance(tasks, str):
            assert mps == tasks
        else:
            pd.testing.assert_frame_equal(mps, tasks)


def test_other_methods_unchanged_and_reversible() -> None:
    left, right = _frames()
    a, b = dd.from_pandas(left, npartitions=6), dd.from_pandas(right, npartitions=5)

    def graph_names() -> list[str]:
        out = []
        for m in ("tasks", "disk"):
            out.append(a.shuffle("k", shuffle_method=m).optimize()._name)
            out.append(a.merge(b, on="k", shuffle_method=m).optimize()._name)
            out.append(a.set_index("k", shuffle_method=m).optimize()._name)
        return out

    with_hook = graph_names()
    method.uninstall()
    try:
        assert not method.installed()
        without = graph_names()
        with pytest.raises(ValueError, match="mpshuffle not supported"):
            a.shuffle("k", shuffle_method="mpshuffle").optimize()
    finally:
        method.install()
    assert with_hook == without


def test_unsupported_dask_version_names_the_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    method.check_dask_version("2026.8.0")
    method.check_dask_version("2025.4.0")
    for bad in ("2025.3.1", "2024.12.1", "2026.9.0", "2027.1.0"):
        with pytest.raises(method.UnsupportedDaskError, match="2025.4.0.*2026.9.0"):
            method.check_dask_version(bad)
    monkeypatch.setattr(dask, "__version__", "2027.1.0")
    df = dd.from_pandas(pd.DataFrame({"k": [1, 2, 3]}), npartitions=2)
    with pytest.raises(method.UnsupportedDaskError, match="installed dask is 2027.1.0"):
        df.shuffle("k", shuffle_method="mpshuffle").optimize()
    df.shuffle("k", shuffle_method="tasks").optimize()  # other methods are not affected


def test_supported_versions_are_pyproject_range() -> None:
    root = Path(__file__).resolve().parents[2]
    text = (root / "pyproject.toml").read_text()
    lower, upper = method.SUPPORTED_DASK
    assert f'"dask[dataframe]>={lower},<{upper.removesuffix(".0")}"' in text
    assert f'"distributed>={lower},<{upper.removesuffix(".0")}"' in text


def test_suite_runner_rewrites_only_the_method_choice(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location(
        "run_dask_tests", Path(__file__).resolve().parents[1] / "dask_suite" / "run_dask_tests.py"
    )
    assert spec is not None and spec.loader is not None
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    dask_dir = Path(dask.__file__).parent
    counts = runner.prepare(dask_dir, tmp_path)
    assert counts["conftest.py"] == 1 and sum(counts.values()) > 1
    for rel in [*runner.MODULES, "conftest.py"]:
        old = (dask_dir / rel).read_text().splitlines()
        new = (tmp_path / rel).read_text().splitlines()
        changed = [
            line for line in difflib.unified_diff(old, new, lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---"))
        ]
        if rel == "conftest.py":  # the fixture's params, then the appended plugin
            assert changed[:2] == [
                '-@pytest.fixture(params=["disk", "tasks"])',
                f"+@pytest.fixture(params=[{runner._PARAM}])",
            ]
            continue
        removed = [line for line in changed if line.startswith("-")]
        added = [line for line in changed if line.startswith("+")]
        assert len(removed) == len(added) == counts[rel], rel
        for line in removed:
            assert re.search(r"""["'](tasks|disk|p2p)["']""", line), line
        for line in added:
            assert runner._PARAM in line and "parametrize" in line, line


def test_partition_filter_and_ignore_index() -> None:
    left, _ = _frames()
    df = dd.from_pandas(left, npartitions=5)
    with dask.config.set({**MP, "scheduler": "sync"}):
        out = df.shuffle("k", npartitions=4, ignore_index=True)
        parts = [out.partitions[j].compute() for j in range(4)]
        whole = out.compute()
        one = out.partitions[2]
        names = {type(e).__name__ for e in one.optimize(fuse=False).expr.walk()}
        keys = [str(k[0] if isinstance(k, tuple) else k) for k in dict(one.optimize().dask)]
    assert "MPShuffle" in names
    # Only partition 2 is extracted, under its own key; the collection's key aliases it.
    assert sum(k.startswith("mpshuffle-extract") for k in keys) == 1, keys
    assert sum(len(p) for p in parts) == len(left) == len(whole)
    for j, p in enumerate(parts):
        for other in parts[j + 1:]:
            assert not set(p["k"]) & set(other["k"])
    # With ignore_index a default RangeIndex does not travel: each output
    # partition gets a fresh one (of the meta's type).
    for p in parts:
        pd.testing.assert_index_equal(p.index, pd.RangeIndex(len(p)))
    _same_rows(pd.concat(parts, ignore_index=True), left)
    # Any other index travels even with ignore_index, as Dask's meta says (as with p2p, disk).
    named = dd.from_pandas(left.rename_axis("row"), npartitions=5)
    with dask.config.set({**MP, "scheduler": "sync"}):
        out = named.shuffle("k", npartitions=4, ignore_index=True).compute()
    pd.testing.assert_frame_equal(out.sort_index(), left.rename_axis("row"))


def test_dask_meta_that_the_data_does_not_fit_keeps_the_data_dtype() -> None:
    # An outer merge puts NaN into an int64 column whose meta stays int64 (as
    # in Dask's test_shuffle_nulls_introduced); the next shuffle keeps float64.
    a = pd.DataFrame({"A": [True, False] * 50, "B": range(100)})
    b = pd.DataFrame({"B": [2, 109, 345, 50, 95], "C": [3, 2, 3, 7, 1]})
    da, db = dd.from_pandas(a, npartitions=10), dd.from_pandas(b, npartitions=1)
    with dask.config.set({**MP, "scheduler": "sync"}):
        got = da.merge(db, how="outer", on="B").shuffle("A").compute()
    exp = a.merge(b, how="outer", on="B")
    assert got["C"].dtype == exp["C"].dtype == np.float64
    # Missing values of the object column A come back as None (Arrow nulls), not NaN.
    _same_rows(got.astype({"A": "boolean"}), exp.astype({"A": "boolean"}))


def test_on_lossy_cast_values() -> None:
    from mpshuffle.dask.graph import shuffle_graph
    from mpshuffle.table._reconcile import reconcile

    meta = pd.DataFrame({"k": pd.Series([], dtype="int64")})
    with pytest.raises(ValueError, match="on_lossy_cast must be 'raise' or 'keep'"):
        shuffle_graph([("x", 0)], on=["k"], npartitions=2, meta=meta, on_lossy_cast="ignore")
    frame = pd.DataFrame({"k": [1.0, np.nan]})
    assert reconcile(frame, meta, "keep")["k"].dtype == np.float64
    assert reconcile(pd.DataFrame({"k": [1.0, 2.0]}), meta, "keep")["k"].dtype == np.int64
    with pytest.raises(mpshuffle.errors.ShuffleError, match="column 'k'"):
        reconcile(frame, meta)


def test_the_method_comes_with_import_mpshuffle_dask() -> None:
    # Opt-in: Dask knows the name only once mpshuffle.dask is imported.
    code = (
        "import sys, dask, pandas as pd, dask.dataframe as dd\n"
        "import mpshuffle\n"
        "df = dd.from_pandas(pd.DataFrame({'k': range(20)}), npartitions=3)\n"
        "try:\n"
        "    df.shuffle('k', shuffle_method='mpshuffle').optimize()\n"
        "except ValueError as e:\n"
        "    print(e)\n"
        "import mpshuffle.dask\n"
        "with dask.config.set(scheduler='sync'):\n"
        "    out = df.shuffle('k', npartitions=2, shuffle_method='mpshuffle')\n"
        "    keys = {str(k[0] if isinstance(k, tuple) else k).split('-')[1] for k in dict(out.dask)\n"
        "            if str(k[0] if isinstance(k, tuple) else k).startswith('mpshuffle')}\n"
        "    print(sorted(keys), sorted(out.compute()['k']) == list(range(20)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout.strip()
    assert out.splitlines() == ["mpshuffle not supported", "['barrier', 'extract', 'insert', 'start'] True"]
