"""Options of mpshuffle in Dask's own way: ``dask.config`` under ``"mpshuffle"``.

The defaults are :class:`~mpshuffle.options.Options`'s, registered with
:mod:`dask.config` on import, so Dask also fills the options from
``DASK_MPSHUFFLE__<NAME>`` environment variables and user YAML files.
Keyword arguments of :func:`mpshuffle.dask.bootstrap_dask_cluster` override
them. Options are resolved on the client and sent to the workers with the
bootstrap.
"""

from __future__ import annotations

from typing import Any

import dask.config

from mpshuffle.errors import OptionError
from mpshuffle.options import Options

__all__ = ["DEFAULT_MAX_NPARTITIONS", "Options", "max_npartitions", "resolve_options"]

# Default of ``mpshuffle.max-npartitions``. Every output partition is an
# extract task that Dask's scheduler places, pins and tracks: at its
# documented ~1 ms of overhead per task (Dask's best practices), 100,000
# extracts cost minutes of scheduler time before any data moves, and a
# partition of the ~100 MB Dask recommends makes that 10 TB of output.
# Past it a graph is far more likely a mistake (npartitions=10**6 on a
# 2,000-row frame) than a plan.
DEFAULT_MAX_NPARTITIONS = 100_000

# Only the options are registered (dask.config holds exactly Options'
# defaults); the graph limit's default lives in max_npartitions.
dask.config.update_defaults({"mpshuffle": Options().as_dict()})

# Options whose value None means something (rather than "not given").
_NONE_IS_A_VALUE = ("spill_dir", "pool_size")


def resolve_options(**overrides: Any) -> Options:
    """Resolve options: ``dask.config["mpshuffle"]`` updated by ``overrides``.

    Parameters
    ----------
    **overrides
        Option values that take precedence over the configuration. Names use
        underscores (``spill_host``); ``None`` values are ignored, except for
        ``spill_dir`` and ``pool_size``, where ``None`` is a value.

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
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise OptionError(f"option 'max-npartitions' must be a whole number >= 1, got {value!r}")
    try:
        n = int(value)
    except ValueError:
        raise OptionError(f"option 'max-npartitions' must be a whole number >= 1, got {value!r}") from None
    if n < 1 or n != float(value):
        raise OptionError(f"option 'max-npartitions' must be a whole number >= 1, got {value!r}")
    return n
