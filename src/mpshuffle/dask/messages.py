"""The messages between the scheduler plugin and the worker plugins, as frozen dataclasses.

Both sides build and read these types; on the wire (distributed's RPC, which
carries msgpack-able values) each travels as the plain ``dict`` of its fields
(:meth:`Message.to_msg`) and is rebuilt with :meth:`Message.from_msg`, which
refuses a message with missing or unknown fields. Errors travel as fields
(:attr:`Joined.error`, :attr:`RunBinding.error`), never as texts to parse.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Self

__all__ = ["BootstrapSpec", "Generation", "Joined", "Message", "Restarted", "RunBinding", "Verdict"]

@dataclasses.dataclass(frozen=True)
class Message:
    """Base of the plugins' messages: a frozen dataclass that travels as a dict."""

    def to_msg(self) -> dict[str, Any]:
        """The fields as a dict of msgpack-able values (tuples as lists)."""
        return {
            f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
            for f in dataclasses.fields(self)
        }

    @classmethod
    def from_msg(cls, msg: Any) -> Self:
        """Rebuild a message from :meth:`to_msg`'s dict (lists become tuples where the field is one).

        Raises
        ------
        TypeError
            If ``msg`` is not a dict or its keys are not the message's fields.
        """
        if not isinstance(msg, dict):
            raise TypeError(f"a {cls.__name__} message must be a dict, got {type(msg).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        if set(msg) - names:
            raise TypeError(f"unknown fields {sorted(set(msg) - names)} in a {cls.__name__} message")
        tuples = {f.name for f in dataclasses.fields(cls) if str(f.type).startswith("tuple")}
        return cls(**{k: tuple(v) if k in tuples and isinstance(v, list) else v for k, v in msg.items()})


@dataclasses.dataclass(frozen=True)
class BootstrapSpec(Message):
    """Scheduler -> every worker of a new generation (``mpshuffle_bootstrap``).

    Attributes
    ----------
    generation
        Id of the generation.
    workers
        Worker addresses in rank order.
    token
        Random secret every rank presents when it connects.
    options
        The generation's :class:`~mpshuffle.config.Options` as a dict.
    """

    generation: str
    workers: tuple[str, ...]
    token: str
    options: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Generation(Message):
    """One bootstrapped membership of the cluster: the scheduler's answer to a bootstrap.

    Returned by :func:`mpshuffle.dask.bootstrap_dask_cluster`.

    Attributes
    ----------
    id
        Generation id (12 hex digits).
    nranks
        Number of ranks (= workers).
    ranks
        Worker address -> rank; ranks follow the sorted worker addresses.
    bootstrapped
        ``True`` if this call bootstrapped it, ``False`` if it was reused.
    """

    id: str
    nranks: int
    ranks: dict[str, int]
    bootstrapped: bool


@dataclasses.dataclass(frozen=True)
class Joined(Message):
    """A worker's answer to :class:`BootstrapSpec`: its rank and address, or why it could not join.

    Attributes
    ----------
    rank
        The worker's rank (``-1`` with an error).
    address
        Where the rank's communicator listens (``""`` with an error).
    error
        ``"<ErrorType>: <message>"`` if joining failed, else ``None``.
    """

    rank: int
    address: str
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class RunBinding(Message):
    """The scheduler's answer to ``mpshuffle_get_run``: the run a graph is bound to.

    Attributes
    ----------
    op_id
        Id of the run (``-1`` with an error).
    generation
        Id of its generation (``""`` with an error).
    workers
        The generation's worker addresses in rank order.
    error
        Why the graph has no run (it failed, or the bootstrap did), else ``None``.
    """

    op_id: int
    generation: str
    workers: tuple[str, ...]
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class Verdict(Message):
    """The scheduler's answer to ``mpshuffle_run_lost``.

    Attributes
    ----------
    restart
        Whether the run was restarted (the task should be rescheduled).
    alive
        The run's workers the scheduler still counts in the cluster.
    """

    restart: bool
    alive: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Restarted(Message):
    """The scheduler's answer to ``mpshuffle_restart_run``: whether it restarted the run."""

    restarted: bool
