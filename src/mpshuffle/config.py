"""Options of mpshuffle in Dask's own way: ``dask.config`` under ``"mpshuffle"``.

The defaults are :class:`~mpshuffle.options.Options`'s, registered with
:mod:`dask.config` on import, so Dask also fills the options from
``DASK_MPSHUFFLE__<NAME>`` environment variables and user YAML files.
Keyword arguments of :func:`mpshuffle.dask.bootstrap_dask_cluster` are set
into this configuration, so both say the same thing through one path.

Where an option is decided (the one rule, docs/architecture.md "Options"):
every option is the client's, resolved where a shuffle's graph is built
(:func:`resolve_options`) and carried in the graph; only the options that
name something on a worker's own machine (:data:`~mpshuffle.options.WORKER_OPTIONS`),
when the client leaves them unset, are read from that worker's own
configuration (:func:`with_worker_config`) as it joins a generation.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import dask.config

from mpshuffle.errors import OptionError
from mpshuffle.options import WORKER_OPTIONS, Options

__all__ = [
    "DEFAULT_MAX_NPARTITIONS", "Options", "max_npartitions", "resolve_options", "set_options", "with_worker_config",
]

# Default of ``mpshuffle.max-npartitions``. Every output partition is an
# extract task that Dask's scheduler places, pins and tracks: at its
# documented ~1 ms of overhead per task (Dask's best practices), 100,000
# extracts cost minutes of scheduler time before any data moves, and a
# partition of the ~100 MB Dask recommends makes that 10 TB of output.
# Past it a graph is far more likely a mistake (npartitions=10**6 on a
# 2,000-row frame) than a plan.
DEFAULT_MAX_NPARTITIONS = 100_000

# Registered with dask.config: the options (exactly Options' defaults) and
# the graph limit, so dask.config.get("mpshuffle") lists every setting.
dask.config.update_defaults({"mpshuffle": {**Options().as_dict(), "max-npartitions": DEFAULT_MAX_NPARTITIONS}})

# Options whose value None means something (rather than "not given").
_NONE_IS_A_VALUE = ("spill_dir", "pool_size", "listen_interface", "port")


def resolve_options(**overrides: Any) -> Options:
    """Resolve options: ``dask.config["mpshuffle"]`` updated by ``overrides``.

    Called where a shuffle's graph is built (on the client), so the graph
    carries the client's options; also on a worker for its own
    :data:`~mpshuffle.options.WORKER_OPTIONS` (:func:`with_worker_config`).

    Parameters
    ----------
    **overrides
        Option values that take precedence over the configuration. Names use
        underscores (``spill_host``); ``None`` values are ignored, except for
        ``spill_dir``, ``pool_size``, ``listen_interface`` and ``port``,
        where ``None`` is a value.

    Returns
    -------
    Options
        The validated options.

    Raises
    ------
    OptionError
        For an unknown option name (the message lists the valid ones) or an
        invalid value.
    """
    names = Options.names()
    raw: dict[str, Any] = {}
    for key, value in (dask.config.get("mpshuffle", default={}) or {}).items():
        if key.replace("-", "_") not in _GRAPH_LIMITS:  # read where graphs are built
            raw[key.replace("-", "_")] = value
    for key, value in overrides.items():
        if value is not None or key in _NONE_IS_A_VALUE:
            raw[key.replace("-", "_")] = value
    unknown = sorted(set(raw) - set(names))
    if unknown:
        limits = [k for k in unknown if k in _GRAPH_LIMITS]
        hint = "".join(
            f"; {k!r} limits the graphs a client builds, not a generation: set it with "
            f"dask.config.set({{'mpshuffle.{k.replace('_', '-')}': ...}})"
            for k in limits
        )
        raise OptionError(
            f"unknown mpshuffle option(s) {', '.join(map(repr, unknown))}; "
            f"valid options are: {', '.join(names)}{hint}"
        )
    return Options(**raw)


# Limits on the graphs that the client builds, read there (not generation
# options: the workers never see them).
_GRAPH_LIMITS = ("max_npartitions",)


def set_options(**options: Any) -> Options:
    """Set options into this process's ``dask.config`` (as ``dask.config.set`` does, for good) and resolve them.

    What :func:`mpshuffle.dask.bootstrap_dask_cluster` does with its keyword
    arguments, so that they and ``dask.config`` are one path: every graph
    built afterwards in this process carries them.

    Parameters
    ----------
    **options
        As for :func:`resolve_options`.

    Returns
    -------
    Options
        The options now in force.

    Raises
    ------
    OptionError
        For an unknown option or an invalid value; nothing is set then.
    """
    resolved = resolve_options(**options)  # checks every value before anything is set
    given = {
        k.replace("-", "_") for k, v in options.items() if v is not None or k.replace("-", "_") in _NONE_IS_A_VALUE
    }
    if given:
        dask.config.set({f"mpshuffle.{name}": getattr(resolved, name) for name in sorted(given)})
    return resolved


def with_worker_config(options: Options) -> Options:
    """``options`` with each worker option the client left unset read from this process's ``dask.config``.

    Called on a worker as it joins a generation: a spill directory, a
    network interface or ports exist on the worker's machine, and ``None``
    from the client leaves them to the worker's own configuration
    (``DASK_MPSHUFFLE__SPILL_DIR`` in its environment, its YAML files).

    Parameters
    ----------
    options
        The generation's options, as the client resolved them.

    Returns
    -------
    Options
        The same options where the client set every worker option (or the
        worker's configuration leaves them unset too), else a copy with the
        worker's values.

    Raises
    ------
    OptionError
        If the worker's configuration holds an invalid value for one of them.
    """
    local = {}
    for name in WORKER_OPTIONS:
        if getattr(options, name) is None:
            value = dask.config.get(f"mpshuffle.{name}", default=None)
            if value is not None:
                local[name] = value
    if not local:
        return options
    try:
        return dataclasses.replace(options, **local)
    except OptionError as e:
        raise OptionError(f"in this worker's own dask.config: {e}") from None



def max_npartitions() -> int:
    """The most output partitions a shuffle graph may have (``mpshuffle.max-npartitions``).

    Returns
    -------
    int
        The limit, >= 1; by default :data:`DEFAULT_MAX_NPARTITIONS`.

    Raises
    ------
    OptionError
        If the configured value is not a whole number >= 1.
    """
    value = dask.config.get("mpshuffle.max-npartitions", default=None)
    if value is None:
        value = dask.config.get("mpshuffle.max_npartitions", default=DEFAULT_MAX_NPARTITIONS)
    bad = OptionError(f"option 'max-npartitions' must be a whole number >= 1, got {value!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise bad
    try:
        # An int as it is; a float or a string ("1e5" too) when it is a whole, finite number.
        n = value if isinstance(value, int) else int(float(value))
    except (ValueError, OverflowError):
        raise bad from None
    if n < 1 or (not isinstance(value, int) and n != float(value)):
        raise bad
    return n
