"""Exceptions raised by mpshuffle.

Every error names what failed, in which phase (``bootstrap``, ``insert``,
``barrier``, ``extract``), and where possible the rank and worker involved.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = [
    "BootstrapError",
    "CommError",
    "CommTimeoutError",
    "MPShuffleError",
    "OptionError",
    "PartitionGoneError",
    "ShuffleError",
    "ShuffleTimeoutError",
    "SpillError",
    "phase",
]


class MPShuffleError(Exception):
    """Base class of every error that mpshuffle raises itself."""


class OptionError(MPShuffleError, ValueError):
    """An option has an unknown name or an invalid value."""


class CommError(MPShuffleError):
    """A communicator failed: a peer is gone, a connection was refused or broke."""


class CommTimeoutError(CommError, TimeoutError):
    """A wait on the communicator (a barrier, a receive) ran past its timeout.

    Parameters
    ----------
    message
        What was waited for.
    missing
        Ranks that did not arrive, in ascending order.
    """

    missing: tuple[int, ...]

    def __init__(self, message: str, missing: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.missing = tuple(missing)


class BootstrapError(MPShuffleError):
    """Bootstrapping the communicator across the cluster's workers failed."""


class ShuffleError(MPShuffleError):
    """A shuffle failed in one of its phases (insert, barrier, extract)."""


class ShuffleTimeoutError(ShuffleError, TimeoutError):
    """A wait of a shuffle (a send, the barrier, an extract) ran past its timeout.

    The message names the ranks and workers that were waited for.

    Parameters
    ----------
    message
        What was waited for, naming the ranks.
    missing
        The ranks waited for in vain (ascending), where known.
    """

    missing: tuple[int, ...]

    def __init__(self, message: str, missing: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.missing = tuple(missing)


class PartitionGoneError(ShuffleError):
    """An output partition was asked for after its rank handed it out.

    The rank extracted it already, or the run ended there and its state was
    freed. Through Dask, the extract task then has the run computed again.
    """


class SpillError(ShuffleError):
    """Spilling a buffer to disk failed (for example, the disk is full)."""


@contextlib.contextmanager
def phase(name: str, where: str = "") -> Iterator[None]:
    """Name the phase (and place) in any error raised inside the block.

    Errors of mpshuffle's own types are re-raised with the phase prefixed to
    their message; any other exception is wrapped in :class:`ShuffleError`
    whose ``__cause__`` is the original error.

    Parameters
    ----------
    name
        The phase: ``"bootstrap"``, ``"insert"``, ``"barrier"`` or ``"extract"``.
    where
        Optional place, e.g. ``"rank 1 (tcp://127.0.0.1:40000)"``.

    Raises
    ------
    ShuffleError
        Wrapping any exception raised in the block that is not already an
        :class:`MPShuffleError` naming this phase.
    """
    prefix = f"{name} phase" + (f" on {where}" if where else "")
    try:
        yield
    except MPShuffleError as e:
        if str(e).startswith(prefix) or "phase" in str(e).split(":", 1)[0]:
            raise
        e.args = (f"{prefix}: {e}", *e.args[1:])
        raise
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:
        if _is_control_flow(e):
            raise
        raise ShuffleError(f"{prefix}: {type(e).__name__}: {e}") from e


def _is_control_flow(e: BaseException) -> bool:
    # Dask's Reschedule must reach the worker untouched.
    return type(e).__name__ == "Reschedule"
