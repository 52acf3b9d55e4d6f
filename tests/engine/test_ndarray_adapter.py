"""NDArrayAdapter and BlockPlan: cutting array blocks into rechunk pieces and assembling output blocks."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from mpshuffle.comm import LocalCommunicator
from mpshuffle.config import resolve_options
from mpshuffle.errors import ShuffleError
from mpshuffle.memory.pool import HostPool
from mpshuffle.shuffler.context import WorkerContext
from mpshuffle.table.ndarray import BlockPlan, NDArrayAdapter, _one_place_all, _read_index

# One axis of 10 elements: input blocks (4, 6), output blocks (3, 3, 4).
#   input 0 = [0, 4): output 0 takes 0:3 at 0, output 1 takes 3:4 at 0
#   input 1 = [4, 10): output 1 takes 0:2 at 1, output 2 takes 2:6 at 0
AXIS_A = (((0, 0, 3, 0), (1, 3, 4, 0)), ((1, 0, 2, 1), (2, 2, 6, 0)))
# A second axis of 5 elements: input blocks (5,), output blocks (2, 3).
AXIS_B = (((0, 0, 2, 0), (1, 2, 5, 0)),)
PLAN = BlockPlan(cuts=(AXIS_A, AXIS_B), nout=(3, 2))


def _blocks(full: np.ndarray) -> dict[tuple[int, int], np.ndarray]:
    return {(0, 0): full[0:4, :], (1, 0): full[4:10, :]}


def _rechunk(
    full: np.ndarray, pool: HostPool | None = None, nranks: int = 1, plan: BlockPlan = PLAN
) -> dict[int, np.ndarray]:
    """Cut every block, group the pieces by output partition, assemble each; the output blocks."""
    by_pid: dict[int, list] = {}
    for rank in range(nranks):
        for index, block in _blocks(full).items():
            adapter = NDArrayAdapter(full.dtype, plan, index)
            pieces = adapter.split_for(block, (), plan.npartitions, rank=rank, nranks=nranks, pool=pool)
            assert sorted(pieces) == sorted({b // plan.per_partition for b, _, _ in plan.pieces(index)})
            for pid, piece in pieces.items():
                if pid % nranks == rank:
                    by_pid.setdefault(pid, []).append(piece)
    out = NDArrayAdapter(full.dtype)
    blocks = {}
    for pid, pieces in by_pid.items():
        got = out.unpack(pieces, None)
        assert sorted(got) == list(plan.blocks_of(pid))
        blocks.update(got)
    return blocks


def _expected(full: np.ndarray) -> dict[int, np.ndarray]:
    rows, cols = [(0, 3), (3, 6), (6, 10)], [(0, 2), (2, 5)]
    return {
        i * 2 + j: full[r0:r1, c0:c1] for i, (r0, r1) in enumerate(rows) for j, (c0, c1) in enumerate(cols)
    }


def test_plan_pieces_name_partition_slices_and_offsets() -> None:
    got = list(PLAN.pieces((1, 0)))
    assert got == [
        (2, (slice(0, 2), slice(0, 2)), (1, 0)),
        (3, (slice(0, 2), slice(2, 5)), (1, 0)),
        (4, (slice(2, 6), slice(0, 2)), (0, 0)),
        (5, (slice(2, 6), slice(2, 5)), (0, 0)),
    ]
    assert PLAN.npartitions == PLAN.nblocks == 6
    three = BlockPlan(cuts=PLAN.cuts, nout=PLAN.nout, per_partition=4)
    assert three.npartitions == 2 and list(three.blocks_of(1)) == [4, 5]
    with pytest.raises(ValueError, match="per_partition must be >= 1"):
        BlockPlan(cuts=PLAN.cuts, nout=PLAN.nout, per_partition=0)
    with pytest.raises(ValueError, match="outside the group on axis 0"):
        list(PLAN.pieces((2, 0)))
    with pytest.raises(ValueError, match="has 1 axes"):
        list(PLAN.pieces((0,)))
    with pytest.raises(ValueError, match="output block 3 is outside"):
        BlockPlan(cuts=(((( 3, 0, 1, 0),),),), nout=(3,))


@pytest.mark.parametrize(
    "dtype",
    ["f4", ">i8", "bool", "c16", "M8[ns]", "U3", [("a", "i2"), ("b", "f8", (2,))], "O"],
)
def test_every_dtype_round_trips(dtype: object) -> None:
    full = np.arange(50).reshape(10, 5).astype(dtype if dtype != "O" else "i8")
    if dtype == "O":
        full = full.astype(object)
        full[3, 1] = {"nested": [1, 2]}
    got = _rechunk(full)
    for pid, want in _expected(full).items():
        assert got[pid].dtype == full.dtype
        assert got[pid].shape == want.shape
        if full.dtype.hasobject:
            assert got[pid].tolist() == want.tolist()
        else:  # bytes as they lay (structured fields, byte order)
            assert got[pid].tobytes() == np.ascontiguousarray(want).tobytes()


@pytest.mark.parametrize("per_partition", [2, 4, 6])
def test_one_piece_per_partition_holds_the_cuts_of_its_blocks(per_partition: int) -> None:
    plan = BlockPlan(cuts=PLAN.cuts, nout=PLAN.nout, per_partition=per_partition)
    full = np.arange(50, dtype="u2").reshape(10, 5)
    pieces = NDArrayAdapter(full.dtype, plan, (1, 0)).split(full[4:10], (), plan.npartitions)
    assert sorted(pieces) == sorted({b // per_partition for b in (2, 3, 4, 5)})
    for nranks in (1, 2):
        got = _rechunk(full, nranks=nranks, plan=plan)
        for b, want in _expected(full).items():
            np.testing.assert_array_equal(got[b], want)


def test_pieces_kept_and_sent_lie_in_separate_pooled_buffers() -> None:
    pool = HostPool(limit=2**24)
    full = np.arange(50, dtype="f8").reshape(10, 5)
    block = _blocks(full)[(1, 0)]
    pieces = NDArrayAdapter(full.dtype, PLAN, (1, 0)).split_for(block, (), 6, rank=0, nranks=2, pool=pool)

    def base(pid: int) -> int:
        # The pooled buffer the piece is a slice of (not its address rounded
        # to a block size, which holds only for one size of block).
        parent = pieces[pid].data.parent
        assert parent is not None
        return int(parent.address)

    # Partitions 2 and 4 stay on rank 0, 3 and 5 go to rank 1: one buffer each.
    kept, sent = {base(2), base(4)}, {base(3), base(5)}
    assert len(kept) == len(sent) == 1 and kept.isdisjoint(sent)
    assert all(int(np.frombuffer(p.data, np.uint8).ctypes.data) % 64 == 0 for p in pieces.values())
    for nranks in (1, 2, 3):
        got = _rechunk(full, pool=pool, nranks=nranks)
        for pid, want in _expected(full).items():
            np.testing.assert_array_equal(got[pid], want)


def test_zero_size_pieces_travel_and_assemble() -> None:
    # Input blocks (2, 0, 3) -> output blocks (0, 5): the empty input reaches the empty output.
    plan = BlockPlan(cuts=((((0, 0, 0, 0), (1, 0, 2, 0)), ((1, 0, 0, 2),), ((1, 0, 3, 2),)),), nout=(2,))
    full = np.arange(5, dtype="i4")
    blocks = [full[0:2], full[2:2], full[2:5]]
    by_pid: dict[int, list] = {}
    for i, block in enumerate(blocks):
        for pid, piece in NDArrayAdapter(full.dtype, plan, (i,)).split(block, (), 2).items():
            by_pid.setdefault(pid, []).append(piece)
    out = NDArrayAdapter(full.dtype)
    assert out.unpack(by_pid[0], None)[0].shape == (0,)
    np.testing.assert_array_equal(out.unpack(by_pid[1], None)[1], full)


def test_unknown_extent_is_read_from_the_block() -> None:
    # stop -1: the piece runs to the block's end (an axis of unknown chunk size).
    plan = BlockPlan(cuts=((((0, 0, -1, 0),),), (((0, 0, 2, 0), (1, 2, 4, 0)),)), nout=(1, 2))
    block = np.arange(12).reshape(3, 4)
    pieces = NDArrayAdapter(block.dtype, plan, (0, 0)).split(block, (), 2)
    out = NDArrayAdapter(block.dtype)
    np.testing.assert_array_equal(out.unpack([pieces[1]], None)[1], block[:, 2:4])


def test_blocks_of_another_byte_order_or_a_narrower_kind_are_cast_to_the_declared_dtype() -> None:
    # Found by a breaker (session 24): a big-endian array's blocks arrive on a
    # distributed worker in native order, and map_blocks trusts its dtype=.
    full = np.arange(50, dtype=">i4").reshape(10, 5)
    for declared, block in ((np.dtype(">i4"), full.astype("<i4")), (np.dtype("f8"), full.astype("f4")),
                            (np.dtype("i8"), full.astype("i2"))):
        pieces = NDArrayAdapter(declared, PLAN, (0, 0)).split(block[0:4], (), 6)
        out = NDArrayAdapter(declared)
        got = {b: a for p in pieces.values() for b, a in out.unpack([p], None).items()}
        same = NDArrayAdapter(declared, PLAN, (0, 0)).split(full[0:4].astype(declared), (), 6)
        want = {b: a for p in same.values() for b, a in out.unpack([p], None).items()}
        assert sorted(got) == sorted(want) and all(a.dtype == declared for a in got.values())
        for b, value in want.items():
            np.testing.assert_array_equal(got[b], value)
    with pytest.raises(ShuffleError, match="has dtype int64, the array declares int32"):
        NDArrayAdapter(np.dtype("i4"), PLAN, (0, 0)).split(full[0:4].astype("i8"), (), 6)


def test_bad_blocks_and_missing_pieces_are_named() -> None:
    full = np.arange(50, dtype="f8").reshape(10, 5)
    adapter = NDArrayAdapter(full.dtype, PLAN, (0, 0))
    with pytest.raises(ShuffleError, match="has dtype int64, the array declares float64"):
        adapter.split(full[0:4].astype("i8"), (), 6)
    with pytest.raises(ShuffleError, match="MaskedArray"):
        adapter.split(np.ma.masked_array(full[0:4]), (), 6)
    with pytest.raises(ShuffleError, match="extent 2 on axis 0"):
        adapter.split(full[0:2], (), 6)
    with pytest.raises(ShuffleError, match="needs its block plan"):
        NDArrayAdapter(full.dtype).split(full, (), 6)
    with pytest.raises(TypeError, match="cut by their rechunk plan"):
        adapter.partition_ids(full, [], 6)
    block1 = NDArrayAdapter(full.dtype, PLAN, (1, 0)).split(full[4:10], (), 6)
    with pytest.raises(ShuffleError, match="do not cover it exactly once"):
        # Output 2 takes row 3 from input 0 and rows 4:6 from input 1: give it input 1's piece only.
        NDArrayAdapter(full.dtype).unpack([block1[2]], None)
    with pytest.raises(ShuffleError, match="malformed header"):
        NDArrayAdapter(full.dtype).unpack([type(block1[2])(b"x", b"", 0)], None)
    with pytest.raises(ShuffleError, match="received no pieces"):
        NDArrayAdapter(full.dtype).unpack([], None)


def test_rechunk_pieces_move_through_a_host_run() -> None:
    """The Shuffler takes the adapter like any frame's: insert_frame, barrier, extract."""
    ctx = WorkerContext(LocalCommunicator(), "gen", resolve_options(), workers=("w0",))
    try:
        full = np.arange(50, dtype="i2").reshape(10, 5)
        run = ctx.shuffler(1)
        for i, (index, block) in enumerate(_blocks(full).items()):
            run.insert_frame(i, block, NDArrayAdapter(full.dtype, PLAN, index), (), 6)
        run.barrier(6)
        out = NDArrayAdapter(full.dtype)
        got = {b: a for pid in range(6) for b, a in out.unpack(run.extract(pid), None).items()}
        for pid, want in _expected(full).items():
            np.testing.assert_array_equal(got[pid], want)
        assert run.closed and ctx.shufflers == {}
    finally:
        ctx.close()


@pytest.mark.parametrize(("per_partition", "nranks"), [(1, 1), (2, 2), (3, 3), (2, 1)])
def test_regular_cuts_take_one_copy_and_one_placement(per_partition: int, nranks: int) -> None:
    """Time-to-space: blocks (1, 6) of a (4, 6) array to blocks (4, 2); and back."""
    full = np.arange(24, dtype=">f4").reshape(4, 6)
    row = (((0, 0, 2, 0), (1, 2, 4, 0), (2, 4, 6, 0)),)
    plan = BlockPlan(cuts=(tuple(((0, 0, 1, t),) for t in range(4)), row), nout=(1, 3),
                     per_partition=per_partition)
    pool = HostPool(limit=2**24)
    by_pid: dict[int, list] = {}
    for rank in range(nranks):
        for t in range(4):
            pieces = NDArrayAdapter(full.dtype, plan, (t, 0)).split_for(
                full[t : t + 1], (), plan.npartitions, rank=rank, nranks=nranks, pool=pool
            )
            for pid, piece in pieces.items():
                if pid % nranks == rank:
                    by_pid.setdefault(pid, []).append(piece)
    got = {b: a for pieces in by_pid.values() for b, a in NDArrayAdapter(full.dtype).unpack(pieces, None).items()}
    assert sorted(got) == [0, 1, 2]
    for j in range(3):
        assert got[j].dtype == full.dtype
        np.testing.assert_array_equal(got[j], full[:, 2 * j : 2 * j + 2])


@pytest.mark.parametrize(("per_partition", "nranks"), [(2, 2), (4, 3), (5, 1)])
def test_grid_cuts_go_straight_into_kept_and_sent_pieces(per_partition: int, nranks: int) -> None:
    """Blocks (1, 6, 6) of a (3, 6, 6) array to blocks (3, 2, 2): partitions that cut across rows of the grid."""
    full = np.arange(108, dtype=np.int32).reshape(3, 6, 6)
    side = (((0, 0, 2, 0), (1, 2, 4, 0), (2, 4, 6, 0)),)
    plan = BlockPlan(cuts=(tuple(((0, 0, 1, t),) for t in range(3)), side, side), nout=(1, 3, 3),
                     per_partition=per_partition)
    pool = HostPool(limit=2**24)
    by_pid: dict[int, list] = {}
    for rank in range(nranks):
        for t in range(3):
            pieces = NDArrayAdapter(full.dtype, plan, (t, 0, 0)).split_for(
                full[t : t + 1], (), plan.npartitions, rank=rank, nranks=nranks, pool=pool
            )
            assert sorted(pieces) == list(range(plan.npartitions))
            sent = [p.data for pid, p in pieces.items() if pid % nranks != rank or nranks == 1]
            kept = [p.data for pid, p in pieces.items() if pid % nranks == rank and nranks > 1]
            assert len({d.parent.address for d in sent}) <= 1  # the pieces sent away share one buffer
            if sent:
                lo, hi = sent[0].parent.address, sent[0].parent.address + sent[0].parent.size
                assert all(d.address + d.size <= lo or d.address >= hi for d in kept)  # each kept one is apart
            # The kept pieces share one buffer of their own: no pool block (64 KiB at least) per piece.
            assert len({d.parent.address for d in kept}) <= 1
            if kept:
                assert kept[0].parent.size < 2 * sum(d.size for d in kept)
            for pid, piece in pieces.items():
                if pid % nranks == rank:
                    by_pid.setdefault(pid, []).append(piece)
    got = {b: a for pieces in by_pid.values() for b, a in NDArrayAdapter(full.dtype).unpack(pieces, None).items()}
    assert sorted(got) == list(range(9))
    for b in range(9):
        j1, j2 = divmod(b, 3)
        np.testing.assert_array_equal(got[b], full[:, 2 * j1 : 2 * j1 + 2, 2 * j2 : 2 * j2 + 2])


@pytest.mark.parametrize("dtype", [np.float32, object])
def test_pieces_share_their_metadata_and_carry_the_index_in_their_data(dtype: Any) -> None:
    """The offset index travels in a piece's data (counted, spilled); the metadata is the same for every input."""
    full = np.arange(4 * 6 * 6).reshape(4, 6, 6).astype(dtype)
    side = (((0, 0, 2, 0), (1, 2, 4, 0), (2, 4, 6, 0)),)
    plan = BlockPlan(cuts=(tuple(((0, 0, 1, t),) for t in range(4)), side, side), nout=(1, 3, 3), per_partition=3)
    metas, by_pid = set(), {}
    for t in range(4):
        pieces = NDArrayAdapter(full.dtype, plan, (t, 0, 0)).split_for(full[t : t + 1], (), plan.npartitions)
        for pid, piece in pieces.items():
            metas.add(piece.metadata)
            by_pid.setdefault(pid, []).append(piece)
            assert len(piece.metadata) == 10  # format, ndim, number of cuts
            index = np.frombuffer(piece.data, "<i8", 3 * 8).reshape(3, 8)
            assert index[:, 0].tolist() == [3 * pid, 3 * pid + 1, 3 * pid + 2]  # output blocks
            assert index[:, 2].tolist() == [t, t, t]  # placed at time step t
    assert len(metas) == 1  # 12 pieces, one metadata (it held each piece's offsets before)
    got = {b: a for ps in by_pid.values() for b, a in NDArrayAdapter(full.dtype).unpack(ps, None).items()}
    for b in range(9):
        j1, j2 = divmod(b, 3)
        np.testing.assert_array_equal(got[b], full[:, 2 * j1 : 2 * j1 + 2, 2 * j2 : 2 * j2 + 2])


def _grid_plan(steps: int, side: int, cut: int, per_partition: int) -> BlockPlan:
    """Blocks (1, side, side) of a (steps, side, side) array to blocks (steps, cut, cut)."""
    n = side // cut
    axis = (tuple((j, j * cut, (j + 1) * cut, 0) for j in range(n)),)
    return BlockPlan(cuts=(tuple(((0, 0, 1, t),) for t in range(steps)), axis, axis), nout=(1, n, n),
                     per_partition=per_partition)


@pytest.mark.parametrize(("nranks", "per_partition", "dtype"), [(2, 16, np.float32), (1, 16, np.int16),
                                                               (2, 12, np.dtype([("a", "<i4"), ("b", ">f8")]))])
def test_kept_pieces_are_views_of_the_input_block(nranks: int, per_partition: int, dtype: Any) -> None:
    """With views, a rank's own pieces are byte ranges of the block (no copy), assembled from any order, spilled or not."""
    from mpshuffle.table.ndarray import RAW, VIEW

    steps, side, cut = 4, 40, 5
    full = np.arange(steps * side * side).reshape(steps, side, side).astype(dtype)
    plan = _grid_plan(steps, side, cut, per_partition)
    by_pid: dict[int, list] = {}
    for rank in range(nranks):
        for t in range(steps):
            block = full[t : t + 1].copy()
            pieces = NDArrayAdapter(full.dtype, plan, (t, 0, 0), views=True).split_for(
                block, (), plan.npartitions, rank=rank, nranks=nranks
            )
            mine = {pid: p for pid, p in pieces.items() if pid % nranks == rank}
            assert {p.metadata[0] for p in mine.values()} == {VIEW}
            assert {p.metadata[0] for pid, p in pieces.items() if pid not in mine} <= {RAW, VIEW}
            lo, hi = block.ctypes.data, block.ctypes.data + block.nbytes
            for piece in mine.values():
                assert lo <= piece.data.address and piece.data.address + piece.data.size <= hi
                # One metadata per input block, whatever the partition.
                assert piece.metadata == next(iter(mine.values())).metadata
            for pid, piece in mine.items():
                # Every other piece as if spilled and read back: a copy of its bytes.
                data = piece.data if pid % 2 else bytes(piece.data)
                by_pid.setdefault(pid, []).append(type(piece)(piece.metadata, data, piece.nrows))
    assert sorted(by_pid) == list(range(plan.npartitions))
    for pid, pieces in by_pid.items():
        got = NDArrayAdapter(full.dtype, plan, partition=pid).unpack(pieces[::-1], None)
        assert sorted(got) == list(plan.blocks_of(pid))
        for b, arr in got.items():
            j1, j2 = divmod(b, side // cut)
            np.testing.assert_array_equal(arr, full[:, cut * j1 : cut * (j1 + 1), cut * j2 : cut * (j2 + 1)])


@pytest.mark.parametrize(("per_partition", "sent_as_view"), [(8, True), (16, True), (4, False), (12, False)])
def test_sent_pieces_are_views_where_their_ranges_hold_only_their_cuts(per_partition: int, sent_as_view: bool) -> None:
    """A piece for another rank is its byte range of the block, uncopied, where that range is its cuts.

    Blocks (1, 40, 40) into (4, 5, 5): a row of the output grid is 8
    blocks, so partitions of 8 or 16 blocks are whole rows, each one byte
    range of the input block holding exactly its cuts; partitions of 4 or 12
    blocks span part of a row, and their pieces are copied (RAW). Received
    as bytes (over the wire or read back from disk), every piece assembles
    the right blocks.
    """
    from mpshuffle.table.ndarray import RAW, VIEW

    steps, side, cut, nranks = 4, 40, 5, 2
    full = np.arange(steps * side * side, dtype=np.float32).reshape(steps, side, side)
    plan = _grid_plan(steps, side, cut, per_partition)
    by_pid: dict[int, list] = {}
    for t in range(steps):
        rank = t % nranks
        block = full[t : t + 1].copy()
        pieces = NDArrayAdapter(full.dtype, plan, (t, 0, 0), views=True).split_for(
            block, (), plan.npartitions, rank=rank, nranks=nranks
        )
        lo, hi = block.ctypes.data, block.ctypes.data + block.nbytes
        for pid, piece in pieces.items():
            if pid % nranks == rank:
                continue
            assert piece.metadata[0] == (VIEW if sent_as_view else RAW)
            if sent_as_view:
                assert lo <= piece.data.address and piece.data.address + piece.data.size <= hi
                assert piece.data.size == len(plan.blocks_of(pid)) * cut * cut * full.itemsize  # only its cuts
        for pid, piece in pieces.items():
            by_pid.setdefault(pid, []).append(type(piece)(piece.metadata, bytes(piece.data), piece.nrows))
    for pid, pieces in by_pid.items():
        got = NDArrayAdapter(full.dtype, plan, partition=pid).unpack(pieces, None)
        assert sorted(got) == list(plan.blocks_of(pid))
        for b, arr in got.items():
            j1, j2 = divmod(b, side // cut)
            np.testing.assert_array_equal(arr, full[:, cut * j1 : cut * (j1 + 1), cut * j2 : cut * (j2 + 1)])


def test_views_only_where_their_byte_ranges_are_tight() -> None:
    """Kept pieces are copied where views would hold far more bytes than their cuts, or little of the block."""
    from mpshuffle.table.ndarray import VIEW

    full = np.arange(4 * 40 * 40, dtype=np.float32).reshape(4, 40, 40)
    for nranks, per_partition in ((2, 2), (4, 16)):  # ranges of 2 cuts span whole rows; a quarter of the block
        plan = _grid_plan(4, 40, 5, per_partition)
        pieces = NDArrayAdapter(full.dtype, plan, (0, 0, 0), views=True).split_for(
            full[0:1], (), plan.npartitions, rank=0, nranks=nranks
        )
        assert all(p.metadata[0] != VIEW for pid, p in pieces.items() if pid % nranks == 0)
    pieces = NDArrayAdapter(full.dtype, plan, (0, 0, 0), views=True).split_for(
        np.asfortranarray(full[0:1]), (), plan.npartitions, rank=0, nranks=1
    )
    assert all(p.metadata[0] != VIEW for p in pieces.values())  # only a C-contiguous block


@pytest.mark.parametrize(("nranks", "kept_as_view"), [(2, True), (3, False)])
def test_space_to_time_keeps_views_on_two_ranks_with_an_odd_number_of_partitions(
    nranks: int, kept_as_view: bool
) -> None:
    """A block (14, 6, 6) into blocks (1, 6, 6), 2 per partition: 7 partitions, rank 1 keeps 3 of them.

    3/7 of the block (as space-to-time's 12 of 25 partitions, 0.48) is kept
    as views on both of 2 ranks; on 3 ranks (3, 2 and 2 of 7 partitions) a
    rank keeping less than 0.4 of the block copies its pieces. Every rank's
    pieces assemble the right blocks.
    """
    from mpshuffle.table.ndarray import RAW, VIEW

    steps, side = 14, 6
    full = np.arange(steps * side * side, dtype=np.float32).reshape(steps, side, side)
    whole = ((0, 0, side, 0),)
    times = (tuple((j, j, j + 1, 0) for j in range(steps)),)
    plan = BlockPlan(cuts=(times, (whole,), (whole,)), nout=(steps, 1, 1), per_partition=2)
    assert plan.npartitions == 7
    by_pid: dict[int, list] = {}
    for rank in range(nranks):
        pieces = NDArrayAdapter(full.dtype, plan, (0, 0, 0), views=True).split_for(
            full, (), plan.npartitions, rank=rank, nranks=nranks
        )
        mine = {pid: p for pid, p in pieces.items() if pid % nranks == rank}
        share = len(mine) / plan.npartitions
        expect = VIEW if kept_as_view or share >= 0.4 else RAW
        assert {p.metadata[0] for p in mine.values()} == {expect}, (rank, share)
        by_pid.update({pid: [p] for pid, p in mine.items()})
    if nranks == 2:
        assert {len(ps) for ps in by_pid.values()} == {1} and sorted(by_pid) == list(range(7))
    for pid, ps in by_pid.items():
        got = NDArrayAdapter(full.dtype, plan, partition=pid).unpack(ps, None)
        assert sorted(got) == list(plan.blocks_of(pid))
        for b, arr in got.items():
            np.testing.assert_array_equal(arr, full[b : b + 1])


def test_view_pieces_need_the_plan_and_their_partition() -> None:
    full = np.arange(4 * 40 * 40, dtype=np.float32).reshape(4, 40, 40)
    plan = _grid_plan(4, 40, 5, 30)  # partitions of 30, 30 and 4 blocks
    pieces = NDArrayAdapter(full.dtype, plan, (0, 0, 0), views=True).split_for(
        full[0:1].copy(), (), plan.npartitions, rank=0, nranks=1
    )
    with pytest.raises(ShuffleError, match="needs the block plan and the output partition"):
        NDArrayAdapter(full.dtype).unpack([pieces[0]], None)
    with pytest.raises(ShuffleError, match="does not hold the cuts of output partition 2"):
        NDArrayAdapter(full.dtype, plan, partition=2).unpack([pieces[0]], None)


def test_received_pieces_give_their_pages_back_as_they_are_placed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces in a shared mapping (a received message): each one's whole pages are given back before the next is placed.

    Four time steps of (80, 80) into blocks (4, 20, 20), one partition of 16
    blocks: each input block's piece (25.6 KB) lies at its own page-aligned
    place of one shared anonymous mapping, as a message in ``/dev/shm``.
    When piece k is placed, the whole pages of pieces 0..k-1 read as zeros
    and piece k's do not; afterwards every piece's whole pages are zeros,
    the blocks are right, and the table has nothing more to give back.
    """
    import mmap

    import pyarrow as pa

    import mpshuffle.table.ndarray as nd
    from mpshuffle.memory.packed import PieceTable

    steps, side, cut = 4, 80, 20
    full = np.arange(steps * side * side, dtype=np.float32).reshape(steps, side, side)
    plan = _grid_plan(steps, side, cut, 16)
    assert plan.npartitions == 1
    pieces = [
        NDArrayAdapter(full.dtype, plan, (t, 0, 0), views=True).split_for(
            full[t : t + 1].copy(), (), 1, rank=0, nranks=1
        )[0]
        for t in range(steps)
    ]
    assert {p.metadata[0] for p in pieces} == {nd.VIEW}
    page = mmap.PAGESIZE
    sizes = [p.data.size for p in pieces]
    offsets = [k * (-(-max(sizes) // page) + 1) * page for k in range(steps)]
    mapping = mmap.mmap(-1, offsets[-1] + sizes[-1])
    for p, o in zip(pieces, offsets, strict=True):
        mapping[o : o + p.data.size] = bytes(p.data)
    table = PieceTable(
        pids=np.zeros(steps, np.int64), nrows=[p.nrows for p in pieces], meta_of=list(range(steps)),
        metas=[p.metadata for p in pieces], buffer_of=np.zeros(steps, np.int32), offset=offsets, size=sizes,
        buffers=[pa.py_buffer(memoryview(mapping))],
    )
    table.mapped = [(mapping, 0)]

    def whole_pages_zero(k: int) -> bool:
        lo, hi = -(-offsets[k] // page) * page, (offsets[k] + sizes[k]) // page * page
        assert hi > lo
        return not np.frombuffer(mapping, np.uint8)[lo:hi].any()

    seen: list[list[bool]] = []
    place = nd._place_view

    def spy(*args: Any) -> None:
        seen.append([whole_pages_zero(k) for k in range(steps)])
        place(*args)

    monkeypatch.setattr(nd, "_place_view", spy)
    monkeypatch.setattr(nd, "RELEASE_BATCH_BYTES", 0)  # give back after every piece (else in batches of 4 MiB)
    got = NDArrayAdapter(full.dtype, plan, partition=0).unpack(table, None)
    assert seen == [[j < k for j in range(steps)] for k in range(steps)]
    assert all(whole_pages_zero(k) for k in range(steps))
    assert table.release_pages() == 0
    for b, arr in got.items():
        j1, j2 = divmod(b, side // cut)
        np.testing.assert_array_equal(arr, full[:, cut * j1 : cut * (j1 + 1), cut * j2 : cut * (j2 + 1)])
    del table, got


def test_pieces_back_to_back_are_given_back_as_one_range_and_nothing_else_is() -> None:
    """Pieces 0 and 1 lie back to back, piece 2 after another partition's bytes: two ranges, whole pages only.

    The page across the boundary of pieces 0 and 1 is whole only for the two
    together, so it goes (piece by piece, it would stay); the other
    partition's bytes between pieces 1 and 2 stay as they are.
    """
    import mmap

    import pyarrow as pa

    from mpshuffle.memory.packed import PieceTable

    page = mmap.PAGESIZE
    mapping = mmap.mmap(-1, 12 * page)
    np.frombuffer(mapping, np.uint8)[:] = 7
    offsets = [page // 2, page // 2 + 3 * page, 8 * page + page // 2]
    sizes = [3 * page, 2 * page, 2 * page]
    foreign = (offsets[1] + sizes[1], offsets[2])  # another partition's piece
    table = PieceTable(
        pids=np.zeros(3, np.int64), nrows=[1, 1, 1], meta_of=[0, 0, 0], metas=[b"m"],
        buffer_of=np.zeros(3, np.int32), offset=offsets, size=sizes, buffers=[pa.py_buffer(memoryview(mapping))],
    )
    table.mapped = [(mapping, 0)]
    one_by_one = sum(((o + n) // page - -(-o // page)) * page for o, n in zip(offsets, sizes, strict=True))
    given = table.release_piece_pages(0, 3)
    assert given == 4 * page + 1 * page == one_by_one + page  # pages 1-4 of the run, page 9 of piece 2
    data = np.frombuffer(mapping, np.uint8)
    assert not data[page : 5 * page].any() and not data[9 * page : 10 * page].any()
    assert (data[: page] == 7).all() and (data[5 * page : 9 * page] == 7).all() and (data[10 * page :] == 7).all()
    assert (data[foreign[0] : foreign[1]] == 7).all()
    del table, data


def test_rechunk_outputs_of_one_shape_share_an_output_block_and_object_blocks_stay_numpy() -> None:
    import numpy as np

    from mpshuffle.table.ndarray import _output_array

    out = _output_array((3, 500, 700), np.dtype("f4"))
    assert out.shape == (3, 500, 700) and out.dtype == np.float32 and out.flags.writeable
    assert out.flags.c_contiguous and out.ctypes.data % 64 == 0
    out[:] = 1.5
    assert float(out.sum()) == 1.5 * out.size
    rec = _output_array((4,), np.dtype([("a", "<i4"), ("b", "<f8")]))
    assert rec.dtype.names == ("a", "b") and rec.shape == (4,)
    objs = _output_array((2, 2), np.dtype(object))
    assert objs.dtype == object and all(v is None for v in objs.ravel())  # numpy's, not raw memory
    assert _output_array((0, 5), np.dtype("i8")).shape == (0, 5)
    for zero_size in ("S0", "U0", "V0"):  # no bytes to view: numpy's own empty array
        empty = _output_array((3, 2), np.dtype(zero_size))
        assert empty.shape == (3, 2) and empty.dtype == np.empty((3, 2), np.dtype(zero_size)).dtype


@pytest.mark.parametrize("nranks", [1, 2])
def test_grid_pieces_whose_blocks_are_not_consecutive_in_their_partition(nranks: int) -> None:
    """An input block of half the columns gives cuts for output blocks 0-2 and 6-8 of a partition of 12.

    Each grid piece is still one array of cuts (one assignment), but into a
    list of output blocks, not a run of them: placed right either way.
    """
    full = np.arange(2 * 4 * 6, dtype=np.int16).reshape(2, 4, 6)
    cuts_x = tuple(tuple((3 * h + j, j, j + 1, 0) for j in range(3)) for h in range(2))
    plan = BlockPlan(cuts=(tuple(((0, 0, 1, t),) for t in range(2)), (((0, 0, 2, 0), (1, 2, 4, 0)),), cuts_x),
                     nout=(1, 2, 6), per_partition=12)
    pool = HostPool(limit=2**24)
    pieces = []
    for rank in range(nranks):
        for t in range(2):
            for h in range(2):
                got = NDArrayAdapter(full.dtype, plan, (t, 0, h)).split_for(
                    full[t : t + 1, :, 3 * h : 3 * h + 3], (), plan.npartitions, rank=rank, nranks=nranks, pool=pool
                )
                if rank == 0:
                    pieces.append(got[0])
    # Each piece: 6 cuts of one shape, back to back, for output blocks 0, 1, 2, 6, 7, 8 (or 3-5, 9-11).
    index = np.concatenate([_read_index(p.metadata, p.data)[2] for p in pieces])
    one, runs, alike = _one_place_all(index, index[:, 0], [6] * len(pieces), 3, full.dtype.itemsize)
    assert one.all() and not runs.any() and not alike.any()
    out = NDArrayAdapter(full.dtype).unpack(pieces, None)
    assert sorted(out) == list(range(12))
    for b, block in out.items():
        jy, jx = divmod(b, 6)
        np.testing.assert_array_equal(block, full[:, 2 * jy : 2 * jy + 2, jx : jx + 1])


def test_grid_layouts_are_kept_per_plan_within_their_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of one grid shape share a layout; a new plan (even at a freed plan's id) gets its own; the bound holds."""
    import mpshuffle.table.ndarray as nd

    monkeypatch.setattr(nd, "_GRID_PIECES", {})
    full = np.arange(6 * 8 * 8, dtype=np.float64).reshape(6, 8, 8)

    def rechunk(per_partition: int, nranks: int) -> None:
        plan = _grid_plan(6, 8, 2, per_partition)
        by_pid: dict[int, list] = {}
        for rank in range(nranks):
            for t in range(6):
                pieces = NDArrayAdapter(full.dtype, plan, (t, 0, 0)).split_for(
                    full[t : t + 1], (), plan.npartitions, rank=rank, nranks=nranks, pool=HostPool(limit=2**20)
                )
                for pid, piece in pieces.items():
                    if pid % nranks == rank:
                        by_pid.setdefault(pid, []).append(piece)
        assert sum(entry.plan() is plan for entry in nd._GRID_PIECES.values()) <= nranks  # one per rank, not per block
        got = {b: a for ps in by_pid.values() for b, a in NDArrayAdapter(full.dtype).unpack(ps, None).items()}
        assert sorted(got) == list(range(16))
        for b, block in got.items():
            j1, j2 = divmod(b, 4)
            np.testing.assert_array_equal(block, full[:, 2 * j1 : 2 * j1 + 2, 2 * j2 : 2 * j2 + 2])

    for per_partition, nranks in ((3, 2), (5, 3), (3, 1), (16, 2)):  # freed plans' ids may come back
        rechunk(per_partition, nranks)
    assert 0 < len(nd._GRID_PIECES) and sum(e.nbytes for e in nd._GRID_PIECES.values()) <= nd.GRID_PIECES_MAX_BYTES
    # No plan is kept alive by its layouts; those of plans gone are dropped with the next one made.
    assert all(entry.plan() is None for entry in nd._GRID_PIECES.values())
    monkeypatch.setattr(nd, "GRID_PIECES_MAX_BYTES", 1)  # no layout fits: each block works its own out
    rechunk(5, 2)
    assert nd._GRID_PIECES == {}


def test_grid_layouts_kept_from_many_threads_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inserts on several threads (a worker of several threads) cut blocks of many plans at once: the layouts
    they keep are shared, and no thread sees the others change them (it failed with "dictionary changed size
    during iteration" about once in six rounds of a rechunk on 2 workers x 4 threads)."""
    import sys
    import threading

    import mpshuffle.table.ndarray as nd

    monkeypatch.setattr(nd, "_GRID_PIECES", {})
    monkeypatch.setattr(nd, "GRID_PIECES_MAX_BYTES", 20_000)  # a few layouts: they are forgotten often
    full = np.arange(6 * 8 * 8, dtype=np.float64).reshape(6, 8, 8)
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def cut(seed: int) -> None:
        start.wait()
        try:
            for k in range(60):
                plan = _grid_plan(6, 8, 2, 1 + (seed + k) % 7)  # a new plan each time: new keys, dead ones
                for t in range(6):
                    pieces = NDArrayAdapter(full.dtype, plan, (t, 0, 0)).split_for(
                        full[t : t + 1], (), plan.npartitions, rank=0, nranks=2, pool=None
                    )
                    assert sum(p.nbytes for p in pieces.values()) >= full[t].nbytes // 2
        except BaseException as e:  # noqa: BLE001 -- reported by the main thread
            errors.append(e)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter allows
    try:
        threads = [threading.Thread(target=cut, args=(i,)) for i in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
