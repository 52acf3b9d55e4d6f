"""tpch.generate: a reused directory holds exactly the last call's files of its tables."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from mpshuffle.demo.tpch import generate


def _files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def _rows(root: Path, table: str) -> int:
    folder = root / table
    paths = sorted(folder.glob("*.parquet")) if folder.is_dir() else [root / f"{table}.parquet"]
    return sum(pq.ParquetFile(p).metadata.num_rows for p in paths)


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Callable[[float, int], Path]:
    """A generation into an empty directory per (scale factor, parts): the expected files."""
    made: dict[tuple[float, int], Path] = {}

    def get(scale_factor: float, parts: int) -> Path:
        if (scale_factor, parts) not in made:
            made[scale_factor, parts] = generate(scale_factor, tmp_path_factory.mktemp("fresh"), parts=parts)
        return made[scale_factor, parts]

    return get


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ((0.001, 2), (0.001, 3)),  # more parts: the old parts would be mixed in
        ((0.001, 3), (0.002, 2)),  # fewer parts, other scale factor: part 3 and old data would stay
        ((0.002, 2), (0.001, 1)),  # a folder per table, then one file per table
        ((0.001, 1), (0.002, 2)),  # one file per table, then a folder per table
    ],
)
def test_reused_directory_holds_only_the_second_generation(
    tmp_path: Path, fresh: Callable[[float, int], Path], first: tuple[float, int], second: tuple[float, int]
) -> None:
    expected = fresh(*second)
    reused = tmp_path / "reused"
    generate(first[0], reused, parts=first[1])
    before = {t: _rows(reused, t) for t in ("lineitem", "orders")}
    (reused / "notes.txt").write_text("not a table")
    generate(second[0], reused, parts=second[1])
    assert _files(reused) == sorted([*_files(expected), "notes.txt"])
    for table in ("lineitem", "orders"):
        assert _rows(reused, table) == _rows(expected, table) > 0
        if first[0] != second[0]:
            assert _rows(reused, table) != before[table]


def test_only_the_generated_tables_are_replaced(tmp_path: Path, fresh: Callable[[float, int], Path]) -> None:
    generate(0.001, tmp_path, parts=3)
    orders = {p: (tmp_path / p).read_bytes() for p in _files(tmp_path) if p.startswith("orders/")}
    generate(0.002, tmp_path, parts=2, tables=("lineitem",))
    assert _files(tmp_path) == sorted(
        ["lineitem/lineitem.1.parquet", "lineitem/lineitem.2.parquet"]
        + [f"orders/orders.{i}.parquet" for i in (1, 2, 3)]
    )
    assert {p: (tmp_path / p).read_bytes() for p in orders} == orders
    assert _rows(tmp_path, "lineitem") == _rows(fresh(0.002, 2), "lineitem")


def test_unknown_table_is_refused_before_anything_is_deleted(tmp_path: Path) -> None:
    generate(0.001, tmp_path, parts=2)
    files = _files(tmp_path)
    with pytest.raises(ValueError, match=r"TPC-H tables .* got \('lineitem', '\.\./x'\)"):
        generate(0.001, tmp_path, tables=("lineitem", "../x"))
    assert _files(tmp_path) == files


def test_generator_failure_shows_its_stderr(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError) as info:
        generate(-1, tmp_path)
    message = str(info.value)
    assert message.startswith("tpchgen-cli failed with exit status 2: ")
    assert "--scale-factor=-1" in message  # the command line
    # tpchgen-cli's own words (its stderr), which used to be hidden.
    assert "invalid value '-1' for '--scale-factor" in message


@pytest.mark.parametrize("parts", [0, -3, 2.5, True, "3"])
def test_bad_parts_is_refused(tmp_path: Path, parts: object) -> None:
    with pytest.raises(ValueError, match=rf"parts must be an integer >= 1, got {parts!r}"):
        generate(0.001, tmp_path, parts=parts)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []
