"""Argument types of the command line that refuse out-of-range values.

argparse turns an :class:`argparse.ArgumentTypeError` raised by a ``type=``
callable into ``error: argument --name: <message>`` and exit status 2, so a
bad value stops the command before any cluster starts, naming the option.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["DefaultsHelpFormatter", "int_at_least", "positive_float", "positive_int"]


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type=`` that parses an integer ``>= low``.

    Parameters
    ----------
    low
        The smallest value accepted.

    Returns
    -------
    callable
        ``str -> int``; raises :class:`argparse.ArgumentTypeError` for text
        that is not an integer or is below ``low``.
    """

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return value

    parse.__name__ = f"int_at_least_{low}"
    return parse


#: An integer >= 1 (worker and partition counts).
positive_int = int_at_least(1)


def positive_float(text: str) -> float:
    """Parse a finite number ``> 0`` (sizes, scale factors, GiB) for argparse.

    Parameters
    ----------
    text
        The command line's text.

    Returns
    -------
    float

    Raises
    ------
    argparse.ArgumentTypeError
        If ``text`` is not a number, or is not finite, or is ``<= 0``.
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's formatter that appends ``(default: ...)``, except where the default is ``None``.

    An option whose default is ``None`` says in its own help what it does
    without a value (``--data-dir``: a temporary directory); ``(default:
    None)`` after that said it twice.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)

