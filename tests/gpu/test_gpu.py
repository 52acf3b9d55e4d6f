"""GPU tests: device tables, on-device partitioning, the NCCL transport, device runs across processes, the pool.

Skipped where CuPy is missing or no CUDA device is visible; the two-rank
case of the multi-process test also needs two devices.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

cupy = pytest.importorskip("cupy")
try:
    _NDEV = cupy.cuda.runtime.getDeviceCount()
except Exception:  # noqa: BLE001 - no driver, or no device
    _NDEV = 0
pytestmark = pytest.mark.skipif(_NDEV < 1, reason="no CUDA device")

from mpshuffle.table import get_adapter
from mpshuffle.table.device import DeviceAdapter, DeviceTable, unpack_piece
from mpshuffle.table.gpu import register_device_adapter
from mpshuffle.table.hashing import partition_ids

HERE = os.path.dirname(__file__)


def _frame(n: int = 5000, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    df = pd.DataFrame(
        {
            "i8": rng.integers(-100, 100, n).astype(np.int8),
            "i64": rng.integers(-(2**62), 2**62, n),
            "u16": rng.integers(0, 60000, n).astype(np.uint16),
            "f32": rng.normal(size=n).astype(np.float32),
            "f64": rng.normal(size=n),
            "b": rng.random(n) > 0.5,
            "row": np.arange(n, dtype=np.int64),
        }
    )
    df.loc[1, "f64"] = np.nan
    df.loc[2, "f64"] = -0.0
    df.loc[3, "f64"] = 0.0
    return df


@pytest.mark.parametrize("on", [["i8"], ["i64"], ["u16"], ["f32"], ["f64"], ["b"], ["i64", "f64", "u16"]])
def test_device_ids_equal_host_ids(on: list[str]) -> None:
    df = _frame()
    t = DeviceTable.from_pandas(df)
    ids = DeviceAdapter().partition_ids(t, on, 13)
    assert isinstance(ids, cupy.ndarray)
    np.testing.assert_array_equal(ids.get(), partition_ids(df[on], 13))


def test_split_and_unpack_stay_on_device() -> None:
    df = _frame()
    assert register_device_adapter()
    t = DeviceTable.from_pandas(df)
    adapter = get_adapter(t)
    assert isinstance(adapter, DeviceAdapter)
    pieces = adapter.split(t, ["i64", "u16"], 7)
    expected = partition_ids(df[["i64", "u16"]], 7)
    assert sorted(pieces) == sorted(set(expected.tolist()))
    for pid, piece in pieces.items():
        assert isinstance(piece.data, cupy.ndarray)  # packed on the device
        got = unpack_piece(piece)
        assert got.xp is cupy
        # membership, dtypes and the original relative order of the rows
        pd.testing.assert_frame_equal(got.to_pandas(), df[expected == pid].reset_index(drop=True))
    whole = adapter.unpack([pieces[p] for p in sorted(pieces)], t.empty_like())
    assert whole.xp is cupy and whole.nrows == len(df)
    assert sorted(whole.columns["row"].get().tolist()) == list(range(len(df)))
    empty = adapter.unpack([], t.empty_like())
    assert empty.nrows == 0 and empty.dtypes == t.dtypes


def test_unpack_rejects_foreign_bytes() -> None:
    from mpshuffle.errors import ShuffleError
    from mpshuffle.table import PackedData

    with pytest.raises(ShuffleError, match="device table format"):
        unpack_piece(PackedData(b"{}", cupy.zeros(8, dtype=cupy.uint8), 1))


def test_device_table_validates_columns() -> None:
    with pytest.raises(ValueError, match="has 3 rows"):
        DeviceTable({"a": cupy.zeros(2), "b": cupy.zeros(3)})
    with pytest.raises(TypeError, match="mix NumPy and CuPy"):
        DeviceTable({"a": cupy.zeros(2), "b": np.zeros(2)})
    with pytest.raises(TypeError, match="dtype complex128"):
        DeviceTable({"a": cupy.zeros(2, dtype=cupy.complex128)})


def test_nccl_transport_on_one_gpu_copies_its_own_share() -> None:
    """One rank's exchange: its own sends land in its own receives, in order; zero bytes skipped."""
    from mpshuffle.comm.local import LocalCommunicator
    from mpshuffle.comm.nccl import NcclTransport
    from mpshuffle.errors import CommError

    comm = LocalCommunicator()
    transport = NcclTransport.create(comm)
    try:
        sends = [cupy.arange(n, dtype=cupy.uint8) + i for i, n in enumerate((1000, 0, 77))]
        recvs = [cupy.zeros(a.nbytes, dtype=cupy.uint8) for a in sends]
        transport.exchange({0: sends}, {0: recvs})
        for s, r in zip(sends, recvs, strict=True):
            np.testing.assert_array_equal(r.get(), s.get())
        with pytest.raises(CommError, match="sizes differ"):
            transport.exchange({0: sends[:1]}, {0: recvs[2:]})
    finally:
        transport.close()
        comm.close()
    with pytest.raises(CommError, match="closed"):
        transport.exchange({}, {})


def test_pool_size_reserves_device_memory() -> None:
    from mpshuffle.memory.device import device_budget, device_memory_bytes, reserve_device_pool

    total = device_memory_bytes()
    pool = cupy.get_default_memory_pool()
    held = reserve_device_pool(0.05)
    assert held >= int(0.05 * total) // 2**20 * 2**20
    assert pool.total_bytes() == held
    a = cupy.empty(2**20, dtype=cupy.uint8)  # served from the reserved block
    assert pool.total_bytes() == held
    del a
    assert device_budget(0.5) == int(0.5 * total)
    with pytest.raises(ValueError, match="pool_size"):
        reserve_device_pool(1.5)
    pool.free_all_blocks()




@pytest.mark.parametrize("nranks", [1, pytest.param(2, marks=pytest.mark.skipif(_NDEV < 2, reason="needs two CUDA devices"))])
@pytest.mark.parametrize("budget", [None, 400_000])
@pytest.mark.timeout(300)
def test_device_run_across_processes(tmp_path, nranks, budget) -> None:  # type: ignore[no-untyped-def]
    """A DeviceRun per process (one GPU each, TCP control messages, NCCL bytes), without Dask."""
    args = [str(tmp_path / "root-address"), str(tmp_path)] + ([str(budget)] if budget else [])
    procs = [
        subprocess.Popen([sys.executable, os.path.join(HERE, "gpu_ranks.py"), str(r), str(nranks), *args])
        for r in range(nranks)
    ]
    assert [p.wait(240) for p in procs] == [0] * nranks
    data = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(nranks)]
    cols = ["k", "j", "x", "src", "row"]
    inputs = pd.concat(
        [pd.DataFrame({c: d[f"in{rnd}_{c}"] for c in cols}) for d in data for rnd in range(3)],
        ignore_index=True,
    )
    outputs = []
    for p in range(5):
        d = data[p % nranks]
        out = pd.DataFrame({c: d[f"out{p}_{c}"] for c in cols})
        assert (partition_ids(out[["k", "j"]], 5) == p).all()
        # rows keep round, then source rank, then source order
        order = list(zip(out["src"] % 10, out["src"] // 10, out["row"], strict=True))
        assert order == sorted(order)
        outputs.append(out)
    got = pd.concat(outputs).sort_values(["src", "row"]).reset_index(drop=True)
    pd.testing.assert_frame_equal(got, inputs.sort_values(["src", "row"]).reset_index(drop=True))
    spilled = sum(int(d["stats"][0]) for d in data)
    assert (spilled > 0) == (budget is not None)
    assert all(int(d["device_used_after"][0]) == 0 for d in data)


def test_cudf_adapter_round_trip() -> None:
    cudf = pytest.importorskip("cudf")
    from mpshuffle.table.cudf import CudfAdapter

    df = _frame(2000).drop(columns=["f64"])
    gdf = cudf.from_pandas(df)
    assert register_device_adapter()
    adapter = get_adapter(gdf)
    assert isinstance(adapter, CudfAdapter)
    pieces = adapter.split(gdf, ["i64"], 5)
    expected = partition_ids(df[["i64"]], 5)
    for pid, piece in pieces.items():
        assert isinstance(piece.data, cupy.ndarray)
        got = adapter.unpack([piece, piece], gdf.iloc[:0])  # a new buffer (two pieces concatenated)
        assert list(got.columns) == list(df.columns)
        # The frame must keep its memory alive: free what can be freed, overwrite the pool.
        gc.collect()
        junk = cupy.full(64 * 2**20, 255, dtype=cupy.uint8)
        want = df[expected == pid].reset_index(drop=True)
        pd.testing.assert_frame_equal(got.to_pandas(), pd.concat([want, want], ignore_index=True))
        del junk


def test_batched_copy_on_the_gpu_equals_the_host_copy() -> None:
    """Every unit width (16, 8, 4, 2, 1 byte), segments of many chunks, segments of 0 bytes."""
    from mpshuffle.memory.device import batched_copy

    rng = np.random.default_rng(5)
    src_h = [rng.integers(0, 256, n, dtype=np.uint8) for n in (300_000, 1_000)]
    dst_h = [np.zeros(n, dtype=np.uint8) for n in (400_000, 2_000)]
    seg = np.array([
        [0, 0, 0, 0, 200_000],  # 16-byte units, 4 chunks
        [0, 200_008, 0, 200_008, 24],  # 8
        [0, 250_004, 0, 250_012, 12],  # 4
        [0, 260_002, 0, 260_006, 6],  # 2
        [0, 270_001, 1, 3, 999],  # 1
        [1, 0, 0, 300_000, 1_000],  # 8 (16 does not divide 300_000 + base)
        [1, 5, 0, 399_000, 0],  # nothing
    ])
    src_d = [cupy.asarray(a) for a in src_h]
    dst_d = [cupy.asarray(a) for a in dst_h]
    batched_copy(src_h, dst_h, seg)
    batched_copy(src_d, dst_d, seg)
    cupy.cuda.get_current_stream().synchronize()
    for h, d in zip(dst_h, dst_d, strict=True):
        np.testing.assert_array_equal(d.get(), h)
    assert dst_h[0][:200_000].tolist() == src_h[0][:200_000].tolist()


@pytest.mark.parametrize("contiguous", [True, False])
def test_device_split_equals_host_split(contiguous: bool) -> None:
    """The pack kernel (contiguous columns) and the array-op path (strided) give the host's pieces."""
    df = _frame(3001, seed=3)
    host = DeviceTable.from_pandas(df, device=False)
    if contiguous:
        dev = DeviceTable.from_pandas(df)
    else:  # every other element of twice as long arrays
        dev = DeviceTable({k: cupy.repeat(cupy.asarray(v), 2)[::2] for k, v in host.columns.items()})
        assert not dev.columns["i64"].flags.c_contiguous
    want = DeviceAdapter().split(host, ["i64"], 17)
    got = DeviceAdapter().split(dev, ["i64"], 17)
    assert sorted(got) == sorted(want)
    for pid, piece in want.items():
        assert got[pid].nrows == piece.nrows and got[pid].metadata == piece.metadata
        g, w = unpack_piece(got[pid]).to_host().columns, unpack_piece(piece).columns
        for k in w:
            np.testing.assert_array_equal(g[k], w[k], err_msg=f"pid {pid}, column {k}")


@pytest.mark.parametrize("host_budget", [None, 3 * 2**20])
def test_device_run_spills_into_reused_page_locked_blocks_and_gathers_each_partition(
    tmp_path, host_budget  # type: ignore[no-untyped-def]
) -> None:
    """Past the device budget (and the host budget: disk), buffers go to pooled page-locked blocks;
    every extract gathers its pieces into one device piece; a second run reuses the blocks."""
    from mpshuffle.comm import LocalCommunicator
    from mpshuffle.memory import BufferResource, MemoryType
    from mpshuffle.memory.device import pinned_empty
    from mpshuffle.memory.pool import HostPool
    from mpshuffle.shuffler.device import DeviceRun
    from mpshuffle.shuffler.device.buffers import STAGE_BYTES, HostBlocks
    from mpshuffle.shuffler.device.state import DeviceState

    register_device_adapter()
    nrows, ninputs, npart = 100_000, 6, 4  # 3.2 MB a table
    resource = BufferResource({MemoryType.DEVICE: 4_000_000, MemoryType.HOST: host_budget}, spill_dir=str(tmp_path))
    spill = HostPool(host_budget or 2**30, resource, per_class=64, fresh=pinned_empty)
    resource.add_reclaimer(MemoryType.HOST, spill.trim)
    blocks = HostBlocks(spill, HostPool(2 * STAGE_BYTES, per_class=2, fresh=pinned_empty))
    rs = cupy.random.RandomState(3)
    inputs = [
        DeviceTable({"k": rs.randint(0, 2**62, nrows, dtype=np.int64),
                     "row": cupy.arange(i * nrows, (i + 1) * nrows, dtype=np.int64),
                     "x": rs.random_sample(nrows), "f": rs.random_sample(nrows).astype(np.float32)})
        for i in range(ninputs)
    ]
    for op in (1, 2):
        comm = LocalCommunicator()
        run = DeviceRun(comm, op, resource=resource, state=DeviceState(0, 4_000_000, 0), key="t",
                        timeout=60, blocks=blocks)
        comm.register_handler("mpsd", run.receive)
        for i, t in enumerate(inputs):
            run.insert(i, t, ["k"], npart)
        run.barrier(npart)
        rows = []
        for j in range(npart):
            pieces = run.extract(j)
            assert len(pieces) == 1 and isinstance(pieces[0].data, cupy.ndarray)
            out = DeviceAdapter().unpack(pieces, inputs[0].empty_like())
            assert (DeviceAdapter().partition_ids(out, ["k"], npart) == j).all()
            r = out.columns["row"].get()
            assert (np.diff(r // nrows) >= 0).all()  # input order kept
            rows.append(r)
        assert np.array_equal(np.sort(np.concatenate(rows)), np.arange(ninputs * nrows))
        stats = run.statistics
        assert stats["bytes_spilled_host"] > 0 and stats["bytes_gathered"] > 0
        assert (stats["bytes_spilled_disk"] > 0) == (host_budget is not None)
        assert run.closed and resource.used(MemoryType.DEVICE) == 0
        comm.close()
    if host_budget is not None:
        assert resource.peak(MemoryType.HOST) <= host_budget
    assert spill.stats()["reused_bytes"] > 0
    spill.close()
    assert [resource.used(mt) for mt in MemoryType] == [0, 0, 0]
