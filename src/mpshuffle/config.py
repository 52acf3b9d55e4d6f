"""Options of mpshuffle, in Dask's own way.

Defaults live in ``mpshuffle.yaml`` next to this module and are registered
with :mod:`dask.config` under ``"mpshuffle"`` on import, so Dask also fills
them from ``DASK_MPSHUFFLE__<NAME>`` environment variables and user YAML
files. Keyword arguments of :func:`mpshuffle.dask.bootstrap_dask_cluster`
override them. Options are resolved on the client and sent to the workers
with the bootstrap.

The :class:`~mpshuffle.options.Options` type itself lives in
:mod:`mpshuffle.options`, which imports no Dask: the engine
(:mod:`mpshuffle.shuffler`) is handed options and never reads Dask's
configuration.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import dask.config
import yaml
from dask.utils import parse_bytes

from mpshuffle.errors import OptionError
from mpshuffle.options import Options

__all__ = ["Options", "resolve_options"]

_YAML = os.path.join(os.path.dirname(__file__), "mpshuffle.yaml")
with open(_YAML) as _f:
    dask.config.update_defaults(yaml.safe_load(_f))

COMM_BACKENDS = ("tcp", "local")


def _fraction(name: str, value: Any, *, allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise OptionError(f"option {name!r} must be a number in (0, 1], got {value!r}") from None
    if not 0 < f <= 1:
        raise OptionError(f"option {name!r} must be a fraction in (0, 1], got {value!r}")
    return f


# Longest wait accepted, in seconds (a year): every wait must end, and waits
# past threading.TIMEOUT_MAX overflow.
MAX_TIMEOUT = 365 * 24 * 3600.0


def _positive(name: str, value: Any) -> float:
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise OptionError(f"option {name!r} must be a positive number of seconds, got {value!r}") from None
    if not 0 < f <= MAX_TIMEOUT:
        raise OptionError(
            f"option {name!r} must be a number of seconds in (0, {MAX_TIMEOUT:g}], got {value!r}"
        )
    return f


def _bytes(name: str, value: Any) -> int:
    try:
        n = parse_bytes(value) if isinstance(value, str) else int(value)
    except (TypeError, ValueError):
        raise OptionError(f"option {name!r} must be a number of bytes, got {value!r}") from None
    if n <= 0:
        raise OptionError(f"option {name!r} must be a positive number of bytes, got {value!r}")
    return n


_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


def _bool(name: str, value: Any) -> bool:
    # Environment variables arrive as strings (DASK_MPSHUFFLE__SHARED_MEMORY=false).
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    if isinstance(value, bool):
        return value
    raise OptionError(f"option {name!r} must be true or false, got {value!r}")


def _spill_host(value: Any) -> float | int:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return _bytes("spill_host", value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise OptionError(f"option 'spill_host' must be a fraction in (0, 1] or bytes, got {value!r}")
    if value <= 0:
        raise OptionError(f"option 'spill_host' must be positive, got {value!r}")
    if value <= 1:
        return float(value)
    if value != int(value):
        raise OptionError(
            f"option 'spill_host' must be a fraction in (0, 1] of the worker's memory_limit or a "
            f"whole number of bytes, got {value!r}"
        )
    return int(value)


def resolve_options(**overrides: Any) -> Options:
    """Resolve options: ``dask.config["mpshuffle"]`` updated by ``overrides``.

    Parameters
    ----------
    **overrides
        Option values that take precedence over the configuration. Names use
        underscores (``spill_host``); ``None`` values are ignored.

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
    names = [f.name for f in dataclasses.fields(Options)]
    raw: dict[str, Any] = {}
    for key, value in (dask.config.get("mpshuffle", default={}) or {}).items():
        raw[key.replace("-", "_")] = value
    for key, value in overrides.items():
        if value is not None or key in ("spill_dir", "pool_size"):
            raw[key.replace("-", "_")] = value
    unknown = sorted(set(raw) - set(names))
    if unknown:
        raise OptionError(
            f"unknown mpshuffle option(s) {', '.join(map(repr, unknown))}; "
            f"valid options are: {', '.join(names)}"
        )
    comm = raw.get("comm", "tcp")
    if comm not in COMM_BACKENDS:
        raise OptionError(f"option 'comm' must be one of {', '.join(COMM_BACKENDS)}, got {comm!r}")
    spill_dir = raw.get("spill_dir")
    if spill_dir is not None and not isinstance(spill_dir, (str, os.PathLike)):
        raise OptionError(f"option 'spill_dir' must be a path or None, got {spill_dir!r}")
    return Options(
        comm=comm,
        timeout=_positive("timeout", raw.get("timeout", 300)),
        bootstrap_timeout=_positive("bootstrap_timeout", raw.get("bootstrap_timeout", 30)),
        spill_host=_spill_host(raw.get("spill_host", 0.25)),
        spill_dir=os.fspath(spill_dir) if spill_dir is not None else None,
        spill_device=_fraction("spill_device", raw.get("spill_device", 0.5)),  # type: ignore[arg-type]
        pool_size=_fraction("pool_size", raw.get("pool_size"), allow_none=True),
        batch_bytes=_bytes("batch_bytes", raw.get("batch_bytes", 4 * 2**20)),
        shared_memory=_bool("shared_memory", raw.get("shared_memory", True)),
    )
