"""Spill directories of dead workers are removed; a live run's never are (issue 18, fault 5).

The owners are real child processes: one killed with SIGKILL after it
spilled (a worker killed mid-shuffle), one alive and holding its files.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from mpshuffle.memory.spill import LOCKLESS_GRACE, SpillDirectory, remove_orphans

_CHILD = textwrap.dedent(
    """
    import os, sys
    from mpshuffle.memory.spill import SpillDirectory
    spill_dir, names = sys.argv[1], sys.argv[2:]
    for name in names:
        d = SpillDirectory(os.path.join(spill_dir, name), owner="child")
        d.append([b"x" * 1000])
        d.append([b"y" * 500])
    print("spilled", flush=True)
    sys.stdin.readline()  # held until the parent says so (or kills us)
    """
)


def _owner(spill_dir: str, *names: str) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, "-c", _CHILD, spill_dir, *names],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "spilled"
    return p


def _entries(path: Any) -> list[str]:
    return sorted(os.listdir(path))


def test_a_killed_owners_directories_go_a_live_owners_stay(tmp_path: Any) -> None:
    dead = _owner(str(tmp_path), "mpshuffle-g1-op1-r0", "mpshuffle-g1-op2-r0")
    alive = _owner(str(tmp_path), "mpshuffle-g1-op1-r1")
    (tmp_path / "user-file").write_text("not ours")
    try:
        dead.send_signal(signal.SIGKILL)
        dead.wait(10)
        assert _entries(tmp_path) == [
            "mpshuffle-g1-op1-r0", "mpshuffle-g1-op1-r0.lock", "mpshuffle-g1-op1-r1",
            "mpshuffle-g1-op1-r1.lock", "mpshuffle-g1-op2-r0", "mpshuffle-g1-op2-r0.lock", "user-file",
        ]
        removed = remove_orphans(str(tmp_path))
        assert sorted(os.path.basename(p) for p in removed) == ["mpshuffle-g1-op1-r0", "mpshuffle-g1-op2-r0"]
        assert _entries(tmp_path) == ["mpshuffle-g1-op1-r1", "mpshuffle-g1-op1-r1.lock", "user-file"]
        assert _entries(tmp_path / "mpshuffle-g1-op1-r1") == ["pieces.bin"]
        assert remove_orphans(str(tmp_path)) == []  # again: nothing more to do
    finally:
        assert alive.stdin is not None
        alive.stdin.write("\n")
        alive.stdin.close()
        alive.wait(10)
    # The live owner exited without removing its directory: now it is an orphan too.
    assert [os.path.basename(p) for p in remove_orphans(str(tmp_path))] == ["mpshuffle-g1-op1-r1"]
    assert _entries(tmp_path) == ["user-file"]


def test_this_processs_live_directory_and_its_nested_outbox_are_kept(tmp_path: Any) -> None:
    run = SpillDirectory(str(tmp_path / "mpshuffle-g2-op1-r0"))
    outbox_only = SpillDirectory(str(tmp_path / "mpshuffle-g2-op2-r0" / "outbox"))  # an older device run's
    run.append([b"a" * 100])
    outbox_only.append([b"b" * 100])
    assert remove_orphans(str(tmp_path)) == []
    assert _entries(tmp_path / "mpshuffle-g2-op2-r0") == ["outbox", "outbox.lock"]
    assert bytes(run.read_ranges([(0, 100)])[0][:100]) == b"a" * 100
    run.remove()
    outbox_only.remove()
    assert _entries(tmp_path) == ["mpshuffle-g2-op2-r0"]  # the outbox's parent: the run removes it
    os.rmdir(tmp_path / "mpshuffle-g2-op2-r0")


def test_a_directory_without_any_lock_goes_only_once_old(tmp_path: Any) -> None:
    """Left by a version without locks, or a nested outbox's parent an instant before its lock."""
    old = tmp_path / "mpshuffle-g3-op1-r0"
    old.mkdir()
    (old / "part-0.bin").write_bytes(b"z" * 10)
    assert remove_orphans(str(tmp_path)) == []  # young: maybe a lock is about to appear
    aged = os.stat(old).st_mtime - LOCKLESS_GRACE - 1
    os.utime(old, (aged, aged))
    assert remove_orphans(str(tmp_path)) == [str(old)]
    assert _entries(tmp_path) == []


def test_a_stray_unheld_lock_file_goes_and_a_new_owner_is_not_fooled(tmp_path: Any) -> None:
    (tmp_path / "mpshuffle-g4-op1-r0.lock").write_text("")
    assert remove_orphans(str(tmp_path)) == []
    assert _entries(tmp_path) == []
    d = SpillDirectory(str(tmp_path / "mpshuffle-g4-op1-r0"))
    d.append([b"q"])
    assert remove_orphans(str(tmp_path)) == []
    assert _entries(tmp_path) == ["mpshuffle-g4-op1-r0", "mpshuffle-g4-op1-r0.lock"]
    d.remove()
    assert _entries(tmp_path) == []


def test_a_missing_spill_dir_is_nothing_to_clean(tmp_path: Any) -> None:
    assert remove_orphans(str(tmp_path / "absent")) == []


@pytest.mark.parametrize("removed_first", [True, False])
def test_remove_after_an_orphan_sweep_of_someone_else_is_harmless(tmp_path: Any, removed_first: bool) -> None:
    d = SpillDirectory(str(tmp_path / "mpshuffle-g5-op1-r0"))
    d.append([b"w"])
    if removed_first:
        d.remove()
    assert remove_orphans(str(tmp_path)) == []
    d.remove()
    assert _entries(tmp_path) == []
