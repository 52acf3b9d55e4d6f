"""Integer arrays in few bytes: ``compact_ints`` and a chunk header's piece arrays round-trip exactly."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from mpshuffle.memory.packed import compact_ints, expand_ints, narrowest
from mpshuffle.memory.postbox import Chunk, compact_pieces, expand_pieces

I64 = np.iinfo(np.int64)
RNG = np.random.default_rng(5)

CASES: dict[str, list[int]] = {
    "empty": [],
    "one": [42],
    "one-min": [I64.min],
    "equal": [7] * 50,
    "zeros": [0] * 3,
    "extremes": [I64.min, I64.max],
    "extremes-back": [I64.max, I64.min, 0, I64.max],
    "steps": list(range(0, 4000, 2)),
    "descending": list(range(10_000, 0, -3)),
    "byte-edges": [0, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1],
    "negative": [-1, -256, -(2**40), 5],
    "random-wide": RNG.integers(I64.min, I64.max, 300, dtype=np.int64).tolist(),
    "random-small": RNG.integers(-3, 200, 1000).tolist(),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_compact_ints_round_trip(name: str) -> None:
    values = CASES[name]
    data = compact_ints(np.array(values, np.int64))
    got, end = expand_ints(data)
    assert end == len(data)
    assert got.dtype == np.int64 and got.tolist() == values
    # Several arrays one after another, read back in turn from their offsets.
    joined = compact_ints(np.array(values, np.int64)) + compact_ints(np.array([1, 2, 3])) + data
    first, at = expand_ints(joined)
    second, at = expand_ints(joined, at)
    third, at = expand_ints(joined, at)
    assert (first.tolist(), second.tolist(), third.tolist(), at) == (values, [1, 2, 3], values, len(joined))


def test_compact_ints_take_the_narrowest_width() -> None:
    header = 17
    assert len(compact_ints(np.full(1000, 2**60))) == header  # all equal: nothing per value
    assert len(compact_ints(np.arange(1000) * 5 + 2**50)) == header + 8  # a constant step: the first value
    assert len(compact_ints(np.arange(1000) % 256 + 2**40)) == header + 1000  # a span of a byte
    assert len(compact_ints(np.arange(1000) * 300)) == header + 8  # steps of 300: constant differences
    assert len(compact_ints(RNG.integers(0, 2**16, 1000))) == header + 2000
    assert len(compact_ints(np.array([I64.min, I64.max]))) == header + 16


def test_expand_ints_refuses_short_or_malformed_bytes() -> None:
    data = compact_ints(np.arange(100) ** 2)
    with pytest.raises(ValueError, match="pass the end|truncated"):
        expand_ints(data[:-1])
    with pytest.raises(ValueError, match="no room"):
        expand_ints(data[:5])
    with pytest.raises(ValueError, match="malformed"):
        expand_ints(bytes([3]) + data[1:])


def test_narrowest() -> None:
    assert narrowest(np.array([0, 255])).dtype == np.uint8
    assert narrowest(np.array([256])).dtype == np.uint16
    assert narrowest(np.array([2**32 - 1])).dtype == np.uint32
    assert narrowest(np.array([2**32])).dtype == np.int64  # concatenates with int64 to int64
    assert narrowest(np.zeros(0, np.int64)).dtype == np.uint8


def _pieces(n: int, frames: list[int], gaps: bool) -> dict[str, Any]:
    pids = np.sort(RNG.choice(10 * n + 1, n, replace=False))
    frame_of = np.repeat(np.arange(len(frames)), frames)
    size = RNG.integers(0, 500, n)
    gap = RNG.integers(0, 64, n) if gaps else np.zeros(n, np.int64)
    offset = np.empty(n, np.int64)
    for k in range(n):
        same = k and frame_of[k] == frame_of[k - 1]
        offset[k] = (offset[k - 1] + size[k - 1] if same else 0) + gap[k]
    return {"pids": pids, "nrows": RNG.integers(1, 4, n), "meta_of": RNG.integers(0, 2, n),
            "frame_of": frame_of, "offset": offset, "size": size}


@pytest.mark.parametrize(("frames", "gaps"), [([0], False), ([1], False), ([500], False), ([200, 1, 299], False),
                                              ([100, 300], True)])
def test_piece_arrays_round_trip(frames: list[int], gaps: bool) -> None:
    arrays = _pieces(sum(frames), [f for f in frames if f], gaps)
    got = expand_pieces(compact_pieces(**arrays))
    for name, values in zip(("pids", "nrows", "meta_of", "frame_of", "offset", "size"), got, strict=True):
        assert values.tolist() == arrays[name].tolist(), name


def test_piece_arrays_in_any_frame_order_round_trip() -> None:
    # Frames that come back (0, 1, 0): each run of one frame counts its offsets on its own.
    arrays = {"pids": np.arange(5), "nrows": np.ones(5, np.int64), "meta_of": np.zeros(5, np.int64),
              "frame_of": np.array([0, 0, 1, 0, 0]), "offset": np.array([0, 8, 0, 40, 48]),
              "size": np.full(5, 8)}
    got = expand_pieces(compact_pieces(**arrays))
    assert [a.tolist() for a in got] == [a.tolist() for a in arrays.values()]


def test_a_chunk_header_costs_a_few_bytes_a_piece() -> None:
    # 1000 one- or two-row pieces of every other partition, back to back in one frame.
    n = 1000
    size = 24 * RNG.integers(1, 3, n)
    data = compact_pieces(np.arange(n) * 2, size // 24, np.zeros(n), np.zeros(n), np.cumsum(size) - size, size)
    assert len(data) < 3 * n  # was 40 bytes a piece (six int64/int32 arrays)
    chunk = Chunk.received(0, "a", 1, 0, pieces=data, metas=[b"m"], frames=[bytes(int(size.sum()))])
    assert chunk.left == n and chunk.data_bytes == int(size.sum())
    with pytest.raises(ValueError, match="outside its frame"):
        Chunk.received(0, "a", 1, 0, pieces=data, metas=[b"m"], frames=[bytes(int(size.sum()) - 1)])
    with pytest.raises(ValueError, match="metadata outside"):
        Chunk.received(0, "a", 1, 0, pieces=data, metas=[], frames=[bytes(int(size.sum()))])


def test_width_is_the_narrowest_unsigned_width_at_every_boundary() -> None:
    from mpshuffle.memory.packed import _width

    spans = [0, 1, 255, 256, 2**16 - 1, 2**16, 2**24, 2**32 - 1, 2**32, 2**40, 2**56, 2**63, 2**64 - 1]
    want = [0, 1, 1, 2, 2, 4, 4, 4, 8, 8, 8, 8, 8]
    assert [_width(s) for s in spans] == want
    # The bytes follow the width: values spanning 2**16 take 4 bytes each, after the 17-byte header.
    assert len(compact_ints(np.array([5, 5 + 2**16, 7]), delta=False)) == 17 + 3 * 4
