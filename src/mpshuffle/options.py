"""The options of mpshuffle: one frozen dataclass that holds the defaults and validates itself.

:class:`Options` is the one place where an option's name, default, meaning
and valid values are written. The engine takes an :class:`Options` as it is
(no Dask needed); the Dask integration registers its defaults with
:mod:`dask.config` and resolves the configuration and keyword arguments into
one (:func:`mpshuffle.config.resolve_options`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any

from mpshuffle.errors import OptionError

__all__ = ["MAX_TIMEOUT", "MIN_HOST_BUDGET", "RUN_OPTIONS", "WORKER_OPTIONS", "Options", "parse_bytes"]

# Longest wait accepted, in seconds (a year): every wait must end, and waits
# past threading.TIMEOUT_MAX overflow.
MAX_TIMEOUT = 365 * 24 * 3600.0

# Most bytes a byte-sized option may give: options travel to the workers as
# msgpack integers and are used in int64 arithmetic (2**63 - 1: 8 EiB).
MAX_BYTES = 2**63 - 1

# Byte units: decimal (kB = 1000) and binary (KiB = 1024), case-insensitive.
_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """Parse a size such as ``"4MiB"``, ``"2 GB"``, ``"1.5e3"`` or ``"100"`` into bytes.

    Units: ``B``, ``kB``/``MB``/``GB``/``TB`` (powers of 1000), ``KiB``/``MiB``/
    ``GiB``/``TiB`` (powers of 1024), case-insensitive; no unit means bytes.

    Raises
    ------
    ValueError
        If ``text`` is not a number with one of those units.
    """
    m = _SIZE.match(text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size in bytes: {text!r}")
    size = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not math.isfinite(size):  # "1e400"
        raise ValueError(f"not a size in bytes: {text!r}")
    return int(size)


# Where each option is decided (docs/architecture.md, "Options"): every option
# is the client's, resolved where the graph is built and carried in it,
# except that the options naming something on a worker's own machine, when
# the client leaves them unset (None), are read from that worker's config.
#: Options of one run: each shuffle carries its own, so concurrent shuffles
#: may differ in them without a new generation.
RUN_OPTIONS = ("timeout", "batch_bytes")
#: Options naming a place on the worker's machine (a directory, a network
#: interface, ports): ``None`` on the client leaves them to each worker's
#: own ``dask.config``.
WORKER_OPTIONS = ("spill_dir", "listen_interface", "port")

_PORT_RANGE = re.compile(r"^\s*(\d+)\s*[:-]\s*(\d+)\s*$")


@dataclasses.dataclass(frozen=True)
class Options:
    """Validated options of a generation; the defaults are the shipped ones.

    Values are checked and normalized on construction (a string ``"64MiB"``
    becomes bytes, ``"0.5"`` a float), so an :class:`Options` is always
    valid. With Dask they come from ``dask.config`` under ``mpshuffle.*``
    (environment ``DASK_MPSHUFFLE__<NAME>``, user YAML) and keyword arguments
    of :func:`mpshuffle.dask.bootstrap_dask_cluster`.

    The communicator is not an option: it follows from where the tasks run
    (``tcp``, on the cluster's own protocol ``tcp://`` or ``tls://``, on a
    distributed cluster; ``local`` with Dask's single-process schedulers).

    Attributes
    ----------
    timeout
        Seconds any wait of a shuffle may take (a send, the barrier, extract's
        wait for data, a peer's headers), in ``(0, MAX_TIMEOUT]``.
    bootstrap_timeout
        Seconds the bootstrap's rendezvous and barrier may take.
    spill_host
        Host budget of a worker's shuffle buffers: a fraction in ``(0, 1]``
        of the worker's ``memory_limit`` (a ``float``), or bytes (an ``int``
        > 1, or a string such as ``"2GiB"``).
    spill_dir
        Directory for spill files, or ``None`` for the worker's local directory.
    spill_device
        GPU: fraction in ``(0, 1]`` of device memory at which device buffers
        spill to host (and past ``spill_host`` on to disk).
    pool_size
        GPU: fraction in ``(0, 1]`` of device memory the worker's pool takes
        up front, or ``None`` (no pool).
    batch_bytes
        Bytes gathered per destination rank before a chunk is sent (an ``int``
        or a string such as ``"4MiB"``).
    shared_memory
        Whether ranks of one host exchange large messages through shared
        memory (``/dev/shm``) instead of their socket (a ``bool``, or one of
        ``"true"``/``"false"``, ``"yes"``/``"no"``, ``"on"``/``"off"``,
        ``"1"``/``"0"`` as environment variables give it).
    listen_interface
        Network interface (e.g. ``"eth0"``, ``"ib0"``) whose IPv4 address
        each rank's communicator listens on, or ``None`` for the host of the
        worker's own address (as ``dask worker --interface`` chooses the
        worker's).
    port
        Port of each rank's communicator: an ``int`` in ``[0, 65535]``, a
        range ``"low:high"`` (inclusive; the first free port of it is taken,
        so several workers of one host can share a range), or ``None``/``0``
        for a free port the operating system picks (as ``dask worker
        --worker-port`` takes a port or a range).
    preload_kernels
        Whether each worker loads the insert's compiled kernels (numba's
        cache, or a compile where it has none) on a thread of its own as soon
        as it joins a generation, instead of in its first insert
        (:func:`mpshuffle.table.warm.warm_up`; once per worker process). A
        ``bool``, or a string as for ``shared_memory``.

    Raises
    ------
    OptionError
        Naming the option and the value that is not valid.
    """

    timeout: float = 300.0
    bootstrap_timeout: float = 30.0
    spill_host: float | int = 0.25
    spill_dir: str | None = None
    spill_device: float = 0.5
    pool_size: float | None = None
    batch_bytes: int = 4 * 2**20
    shared_memory: bool = True
    preload_kernels: bool = True
    listen_interface: str | None = None
    port: int | str | None = None

    def __post_init__(self) -> None:
        spill_dir = self.spill_dir
        if spill_dir is not None and not isinstance(spill_dir, (str, os.PathLike)):
            raise OptionError(f"option 'spill_dir' must be a path or None, got {spill_dir!r}")
        normal = {
            "timeout": _seconds("timeout", self.timeout),
            "bootstrap_timeout": _seconds("bootstrap_timeout", self.bootstrap_timeout),
            "spill_host": _spill_host(self.spill_host),
            "spill_dir": os.fspath(spill_dir) if spill_dir is not None else None,
            "spill_device": _fraction("spill_device", self.spill_device),
            "pool_size": None if self.pool_size is None else _fraction("pool_size", self.pool_size),
            "batch_bytes": _bytes("batch_bytes", self.batch_bytes),
            "shared_memory": _bool("shared_memory", self.shared_memory),
            "preload_kernels": _bool("preload_kernels", self.preload_kernels),
            "listen_interface": _interface(self.listen_interface),
            "port": _port(self.port),
        }
        for name, value in normal.items():
            object.__setattr__(self, name, value)

    @classmethod
    def names(cls) -> list[str]:
        """The option names, in order."""
        return [f.name for f in dataclasses.fields(cls)]

    def as_dict(self) -> dict[str, Any]:
        """The options as a dict (what travels to the workers, and dask.config's defaults)."""
        return dataclasses.asdict(self)

    def generation_options(self) -> dict[str, Any]:
        """The options that a generation is made with: all but :data:`RUN_OPTIONS`.

        Two graphs whose generation options are equal can run on one
        generation; a graph with other ones makes a new generation.
        """
        return {k: v for k, v in self.as_dict().items() if k not in RUN_OPTIONS}

    def port_range(self) -> tuple[int, int]:
        """The ports a communicator may listen on, ``(low, high)`` inclusive; ``(0, 0)``: any free port."""
        if self.port is None:
            return (0, 0)
        if isinstance(self.port, int):
            return (self.port, self.port)
        low, high = self.port.split(":")
        return (int(low), int(high))

    def host_budget(
        self, memory_limit: int | None, *, ceiling: float | None = None, in_use: int = 0
    ) -> int | None:
        """Host budget in bytes for a worker with ``memory_limit`` bytes.

        A fractional ``spill_host`` is a fraction of ``memory_limit``, and at
        most half of what the worker's own memory manager leaves: with
        ``ceiling`` (the fraction of ``memory_limit`` at which it acts; for
        Dask, the lower of ``distributed.worker.memory.spill`` and ``pause``)
        and ``in_use`` (the bytes the process holds before the run), the
        budget is ``min(spill_host * memory_limit, max(MIN_HOST_BUDGET,
        (ceiling * memory_limit - in_use) // 2))``; the other half stays for
        the worker's own data (the blocks or partitions going in and out).
        Otherwise a worker whose baseline plus the run's budget passes the
        pause fraction is paused by Dask while the run holds its memory,
        and nothing Dask can spill frees it: the run stalls. A budget in
        bytes is taken as given.

        Parameters
        ----------
        memory_limit
            The worker's memory limit in bytes, or ``None``/0 (none).
        ceiling
            Fraction in ``(0, 1]`` of ``memory_limit`` the worker's memory
            should stay under, or ``None`` (no such rule).
        in_use
            Bytes the worker process holds already (its RSS), >= 0.

        Returns
        -------
        int or None
            Bytes; ``None`` (unbounded) when the budget is a fraction and the
            worker has no memory limit.
        """
        if isinstance(self.spill_host, float):
            if not memory_limit:
                return None
            budget = int(self.spill_host * memory_limit)
            if ceiling is not None:
                left = int(ceiling * memory_limit) - max(0, int(in_use))
                budget = min(budget, max(MIN_HOST_BUDGET, left // 2))
            return budget
        return int(self.spill_host)


#: Smallest host budget that :meth:`Options.host_budget` derives from a fraction
#: (a run with less spills nearly every piece it receives).
MIN_HOST_BUDGET = 16 * 2**20

_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


def _bool(name: str, value: Any) -> bool:
    # Environment variables arrive as strings (DASK_MPSHUFFLE__SHARED_MEMORY=false).
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    if isinstance(value, bool):
        return value
    raise OptionError(f"option {name!r} must be true or false, got {value!r}")


# A bool is an int to Python, but ``timeout=True`` is a mistake, not one second.


def _fraction(name: str, value: Any) -> float:
    try:
        if isinstance(value, bool):
            raise TypeError
        f = float(value)
    except (TypeError, ValueError):
        raise OptionError(f"option {name!r} must be a number in (0, 1], got {value!r}") from None
    if not 0 < f <= 1:
        raise OptionError(f"option {name!r} must be a fraction in (0, 1], got {value!r}")
    return f


def _seconds(name: str, value: Any) -> float:
    try:
        if isinstance(value, bool):
            raise TypeError
        f = float(value)
    except (TypeError, ValueError):
        raise OptionError(f"option {name!r} must be a positive number of seconds, got {value!r}") from None
    if math.isnan(f) or not 0 < f <= MAX_TIMEOUT:
        raise OptionError(f"option {name!r} must be a number of seconds in (0, {MAX_TIMEOUT:g}], got {value!r}")
    return f


def _bytes(name: str, value: Any) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        if isinstance(value, float) and not value.is_integer():  # 1.5, nan, inf
            raise ValueError
        n = parse_bytes(value) if isinstance(value, str) else int(value)
    except (TypeError, ValueError, OverflowError):
        raise OptionError(f"option {name!r} must be a number of bytes, got {value!r}") from None
    if n <= 0:
        raise OptionError(f"option {name!r} must be a positive number of bytes, got {value!r}")
    if n > MAX_BYTES:
        raise OptionError(f"option {name!r} must be at most {MAX_BYTES} bytes (2**63 - 1), got {value!r}")
    return n


def _interface(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise OptionError(f"option 'listen_interface' must be a network interface name or None, got {value!r}")
    return value.strip()


def _port(value: Any) -> int | str | None:
    if value is None:
        return None
    if isinstance(value, str):
        m = _PORT_RANGE.match(value)
        if m is not None:
            low, high = int(m.group(1)), int(m.group(2))
            if not 1 <= low <= high <= 65535:
                raise OptionError(
                    f"option 'port' must be a range low:high with 1 <= low <= high <= 65535, got {value!r}"
                )
            return f"{low}:{high}" if low != high else low
        try:
            value = int(value)
        except ValueError:
            raise OptionError(f"option 'port' must be a port, a range 'low:high' or None, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise OptionError(f"option 'port' must be a port in [0, 65535], a range 'low:high' or None, got {value!r}")
    return value or None


def _spill_host(value: Any) -> float | int:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return _bytes("spill_host", value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
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
    return _bytes("spill_host", int(value))
