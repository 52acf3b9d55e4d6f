"""Options: dask.config defaults < DASK_MPSHUFFLE__* environment < keyword arguments; validation."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import dask.config
import pytest

from mpshuffle.config import Options, max_npartitions, resolve_options
from mpshuffle.errors import OptionError

VALID = [f.name for f in dataclasses.fields(Options)]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """No DASK_MPSHUFFLE__* variables; dask.config re-read from the environment after the test."""
    import os

    for key in list(os.environ):
        if key.startswith("DASK_MPSHUFFLE__"):
            monkeypatch.delenv(key)
    yield monkeypatch
    monkeypatch.undo()
    dask.config.refresh()


def test_shipped_defaults_are_registered_with_dask_config(clean_env: pytest.MonkeyPatch) -> None:
    dask.config.refresh()
    assert dask.config.get("mpshuffle.spill_host") == 0.25
    assert dask.config.get("mpshuffle.batch_bytes") == 4 * 2**20
    opts = resolve_options()
    assert opts == Options() == Options(
        timeout=300.0, bootstrap_timeout=30.0, spill_host=0.25, spill_dir=None,
        spill_device=0.5, pool_size=None, batch_bytes=4 * 2**20, shared_memory=True,
        preload_kernels=True, listen_interface=None, port=None,
    )
    # The defaults are written once, in Options: dask.config holds exactly them,
    # and the graph limit (not an option of a generation) beside them.
    assert dask.config.get("mpshuffle") == {**Options().as_dict(), "max-npartitions": 100_000}
    assert dask.config.get("mpshuffle.max-npartitions") == dask.config.get("mpshuffle.max_npartitions") == 100_000
    assert max_npartitions() == 100_000


def test_environment_overrides_defaults_and_kwargs_override_both(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("DASK_MPSHUFFLE__SPILL_HOST", "64MiB")
    clean_env.setenv("DASK_MPSHUFFLE__TIMEOUT", "12")
    clean_env.setenv("DASK_MPSHUFFLE__SPILL_DIR", "/tmp/from-env")
    dask.config.refresh()
    opts = resolve_options()
    assert opts.spill_host == 64 * 2**20
    assert opts.timeout == 12.0
    assert opts.spill_dir == "/tmp/from-env"
    assert opts.batch_bytes == 4 * 2**20  # untouched: still the shipped default
    clean_env.setenv("DASK_MPSHUFFLE__SHARED_MEMORY", "false")
    dask.config.refresh()
    assert resolve_options().shared_memory is False
    assert resolve_options(shared_memory=True).shared_memory is True
    clean_env.setenv("DASK_MPSHUFFLE__PRELOAD_KERNELS", "off")
    dask.config.refresh()
    assert resolve_options().preload_kernels is False
    assert resolve_options(preload_kernels=True).preload_kernels is True

    opts = resolve_options(spill_host=0.5, timeout=3, spill_dir="/tmp/from-kwargs")
    assert (opts.spill_host, opts.timeout, opts.spill_dir) == (0.5, 3.0, "/tmp/from-kwargs")
    # None means "not given" for a kwarg, except where None is itself a value.
    assert resolve_options(timeout=None).timeout == 12.0
    assert resolve_options(spill_dir=None).spill_dir is None


def test_dask_config_set_is_between_env_and_kwargs(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("DASK_MPSHUFFLE__SPILL_DEVICE", "0.3")
    dask.config.refresh()
    assert resolve_options().spill_device == 0.3
    with dask.config.set({"mpshuffle.spill_device": 0.7, "mpshuffle.pool-size": 0.4}):
        opts = resolve_options()
        assert (opts.spill_device, opts.pool_size) == (0.7, 0.4)
        assert resolve_options(spill_device=0.9).spill_device == 0.9
    assert resolve_options().spill_device == 0.3


@pytest.mark.parametrize(
    ("value", "expected"),
    [(1, 1.0), (0.25, 0.25), ("0.5", 0.5), (2, 2), (2**20, 2**20), ("1MiB", 2**20), ("2 GiB", 2 * 2**30)],
)
def test_spill_host_is_a_fraction_or_bytes(value: object, expected: float) -> None:
    got = resolve_options(spill_host=value).spill_host
    assert got == expected and type(got) is type(expected)


def test_host_budget_in_bytes() -> None:
    assert resolve_options(spill_host=0.25).host_budget(4 * 2**30) == 2**30
    assert resolve_options(spill_host=0.25).host_budget(None) is None
    assert resolve_options(spill_host="64MiB").host_budget(None) == 64 * 2**20


def test_a_fractional_budget_leaves_half_of_what_the_worker_manager_leaves() -> None:
    from mpshuffle.options import MIN_HOST_BUDGET

    gib = 2**30
    options = resolve_options(spill_host=0.25)
    # Room enough: the fraction counts (0.7 * 4 GiB - 0.5 GiB = 2.3 GiB, half of it 1.15 GiB > 1 GiB).
    assert options.host_budget(4 * gib, ceiling=0.7, in_use=gib // 2) == gib
    # A small worker: 0.7 * 768 MiB - 350 MiB = 187.6 MiB left, half of it for the run.
    mib = 2**20
    assert options.host_budget(768 * mib, ceiling=0.7, in_use=350 * mib) == (int(0.7 * 768 * mib) - 350 * mib) // 2
    # Nothing left: the smallest budget, never 0 or negative.
    assert options.host_budget(512 * mib, ceiling=0.7, in_use=600 * mib) == MIN_HOST_BUDGET
    # No limit stays unbounded; a budget in bytes is taken as given.
    assert options.host_budget(None, ceiling=0.7, in_use=gib) is None
    assert resolve_options(spill_host="1GiB").host_budget(768 * mib, ceiling=0.7, in_use=350 * mib) == gib



@pytest.mark.parametrize(
    ("name", "value", "match"),
    [
        ("spill_host", -1, "'spill_host' must be positive"),
        ("spill_host", 0, "'spill_host' must be positive"),
        ("spill_host", "lots", "'spill_host' must be a number of bytes"),
        ("spill_host", True, "'spill_host' must be a fraction in \\(0, 1\\] or bytes"),
        ("spill_host", 1.5, "'spill_host' must be a fraction .* or a whole number of bytes"),
        ("spill_device", 1.5, "'spill_device' must be a fraction in \\(0, 1\\]"),
        ("spill_device", 0, "'spill_device' must be a fraction in \\(0, 1\\]"),
        ("spill_device", "half", "'spill_device' must be a number in \\(0, 1\\]"),
        ("pool_size", 2, "'pool_size' must be a fraction in \\(0, 1\\]"),
        ("pool_size", -0.1, "'pool_size' must be a fraction in \\(0, 1\\]"),
        ("timeout", -5, "'timeout' must be a number of seconds in \\(0, "),
        ("timeout", "soon", "'timeout' must be a positive number"),
        ("timeout", float("inf"), "'timeout' must be a number of seconds in \\(0, "),
        ("timeout", float("nan"), "'timeout' must be a number of seconds in \\(0, "),
        ("timeout", 1e12, "'timeout' must be a number of seconds in \\(0, "),
        ("bootstrap_timeout", 0, "'bootstrap_timeout' must be a number of seconds in \\(0, "),
        ("batch_bytes", 0, "'batch_bytes' must be a positive number of bytes"),
        ("batch_bytes", "big", "'batch_bytes' must be a number of bytes"),
        ("spill_dir", 3, "'spill_dir' must be a path or None"),
        ("shared_memory", "maybe", "'shared_memory' must be true or false"),
        ("shared_memory", 1, "'shared_memory' must be true or false"),
        ("preload_kernels", "later", "'preload_kernels' must be true or false"),
        # Not finite, not whole, or a bool: an OptionError naming the option,
        # never an OverflowError/ValueError from int() nor a silent 1.
        ("spill_host", float("nan"), "'spill_host' must be a fraction in \\(0, 1\\] or bytes"),
        ("spill_host", float("inf"), "'spill_host' must be a fraction in \\(0, 1\\] or bytes"),
        ("spill_host", "1e400", "'spill_host' must be a fraction in \\(0, 1\\] or bytes"),
        ("batch_bytes", "1e400", "'batch_bytes' must be a number of bytes"),
        ("batch_bytes", float("inf"), "'batch_bytes' must be a number of bytes"),
        ("batch_bytes", float("nan"), "'batch_bytes' must be a number of bytes"),
        ("batch_bytes", 1.5, "'batch_bytes' must be a number of bytes"),
        # Past int64: refused here, not by msgpack in the bootstrap of every shuffle.
        ("batch_bytes", 2**64, "'batch_bytes' must be at most 9223372036854775807 bytes"),
        ("batch_bytes", 1e30, "'batch_bytes' must be at most"),
        ("batch_bytes", "20000000 TiB", "'batch_bytes' must be at most"),
        ("spill_host", 2**64, "'spill_host' must be at most"),
        ("spill_host", 1e30, "'spill_host' must be at most"),
        ("timeout", True, "'timeout' must be a positive number of seconds"),
        ("bootstrap_timeout", False, "'bootstrap_timeout' must be a positive number of seconds"),
        ("spill_device", True, "'spill_device' must be a number in \\(0, 1\\]"),
        ("pool_size", True, "'pool_size' must be a number in \\(0, 1\\]"),
    ],
)
def test_invalid_values_raise_option_error(name: str, value: object, match: str) -> None:
    with pytest.raises(OptionError, match=match):
        resolve_options(**{name: value})


def test_invalid_value_from_the_environment_is_named(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("DASK_MPSHUFFLE__SPILL_DEVICE", "2")
    dask.config.refresh()
    with pytest.raises(OptionError, match="'spill_device' must be a fraction"):
        resolve_options()
    # A valid keyword argument wins over the invalid environment value.
    assert resolve_options(spill_device=0.5).spill_device == 0.5


def test_unknown_names_raise_listing_the_valid_ones(clean_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(OptionError) as info:
        resolve_options(spil_host=0.5)
    msg = str(info.value)
    assert "'spil_host'" in msg
    assert all(name in msg for name in VALID)

    clean_env.setenv("DASK_MPSHUFFLE__SPILL_HOSTS", "1GiB")
    dask.config.refresh()
    with pytest.raises(OptionError, match="unknown mpshuffle option.*'spill_hosts'.*valid options are: timeout"):
        resolve_options()


def test_a_graph_limit_given_as_a_generation_option_says_where_it_belongs() -> None:
    with pytest.raises(OptionError, match=r"'max_npartitions' limits the graphs.*'mpshuffle.max-npartitions'"):
        resolve_options(max_npartitions=5)


def test_option_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        resolve_options(timeout=-1)


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [("batch_bytes", "4MiB", 4 * 2**20), ("batch_bytes", "1.5kB", 1500), ("spill_host", "2 GiB", 2 * 2**30),
     ("timeout", "12", 12.0), ("spill_device", "0.25", 0.25), ("spill_dir", None, None)],
)
def test_options_validate_and_normalize_themselves_without_dask_config(name: str, value: object, expected: object) -> None:
    from mpshuffle.options import Options as EngineOptions

    assert getattr(EngineOptions(**{name: value}), name) == expected


@pytest.mark.parametrize(
    ("name", "value", "match"),
    [("batch_bytes", True, "'batch_bytes' must be a number of bytes"), ("batch_bytes", "4 MiBs", "number of bytes"),
     ("timeout", float("nan"), "'timeout' must be a number of seconds"), ("pool_size", 0, "'pool_size' must be a fraction")],
)
def test_options_refuse_bad_values_on_construction(name: str, value: object, match: str) -> None:
    from mpshuffle.options import Options as EngineOptions

    with pytest.raises(OptionError, match=match):
        EngineOptions(**{name: value})


def test_comm_is_not_an_option(clean_env: pytest.MonkeyPatch) -> None:
    """The communicator follows from where the tasks run, so asking for one is an unknown option."""
    with pytest.raises(OptionError, match="unknown mpshuffle option.*'comm'"):
        resolve_options(comm="tcp")


def test_options_are_resolved_only_where_graphs_are_built() -> None:
    """The rule's shape: ``resolve_options`` runs where a graph is built (or in
    ``set_options``), never on the scheduler or the workers, which take a
    run's options from its graph (and ``with_worker_config`` the worker
    options the client left unset)."""
    import ast
    from pathlib import Path

    import mpshuffle

    root = Path(mpshuffle.__file__).parent
    callers = {}
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", getattr(node.func, "attr", None))
                if name in ("resolve_options", "with_worker_config"):
                    callers.setdefault(name, set()).add(path.relative_to(root).as_posix())
    assert callers["resolve_options"] == {
        "config.py",  # set_options
        "dask/graph.py",  # shuffle_graph, when no options are passed: on the client
        "dask/client_preload.py",  # preload_kernels, as a client starts: on the client
        # graph_options: shuffle, merge, sort_values, set_index, rechunk, and
        # Shuffle._lower of the config line (on the client; not _layer, on the scheduler)
        "dask/dataframe.py",
    }
    assert callers["with_worker_config"] == {"dask/worker.py"}
