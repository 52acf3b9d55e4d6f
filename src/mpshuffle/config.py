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

__all__ = ["Options", "resolve_options"]

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
        raw[key.replace("-", "_")] = value
    for key, value in overrides.items():
        if value is not None or key in _NONE_IS_A_VALUE:
            raw[key.replace("-", "_")] = value
    unknown = sorted(set(raw) - set(names))
    if unknown:
        raise OptionError(
            f"unknown mpshuffle option(s) {', '.join(map(repr, unknown))}; "
            f"valid options are: {', '.join(names)}"
        )
    return Options(**raw)
