"""The resolved options of a generation, as a plain frozen dataclass.

This module imports nothing but :mod:`mpshuffle.errors`, so the engine can
take options without importing Dask; they are read from Dask's configuration
and validated by :func:`mpshuffle.config.resolve_options`.
"""

from __future__ import annotations

import dataclasses

from mpshuffle.errors import OptionError

__all__ = ["Options"]


@dataclasses.dataclass(frozen=True)
class Options:
    """Resolved, validated options of a generation.

    Attributes
    ----------
    comm
        Communicator backend, one of ``"tcp"``, ``"local"``.
    timeout
        Seconds any wait of a shuffle may take (barrier, extract, receive).
    bootstrap_timeout
        Seconds the bootstrap's rendezvous and barrier may take.
    spill_host
        Host budget for shuffle buffers: a fraction in (0, 1] of the worker's
        ``memory_limit`` (a ``float``), or bytes (an ``int`` > 1).
    spill_dir
        Directory for spill files, or ``None`` for the worker's local directory.
    spill_device
        Fraction in (0, 1] of device memory at which device buffers spill.
    pool_size
        Fraction in (0, 1] of device memory the pool takes up front, or ``None``.
    batch_bytes
        Bytes gathered per destination rank before a chunk is sent.
    shared_memory
        Whether ranks of one host exchange large messages through shared
        memory (``/dev/shm``) instead of their socket.
    """

    comm: str = "tcp"
    timeout: float = 300.0
    bootstrap_timeout: float = 30.0
    spill_host: float | int = 0.25
    spill_dir: str | None = None
    spill_device: float = 0.5
    pool_size: float | None = None
    batch_bytes: int = 4 * 2**20
    shared_memory: bool = True

    def check_distributed(self) -> None:
        """Refuse options that cannot connect the worker processes of a distributed cluster.

        Raises
        ------
        OptionError
            If ``comm`` is not ``"tcp"`` (``"local"`` is for Dask's
            single-process schedulers; it may come from ``mpshuffle.comm`` in
            dask.config as well as from a keyword argument).
        """
        if self.comm != "tcp":
            raise OptionError(
                f"comm={self.comm!r} cannot connect the workers of a distributed cluster; use 'tcp' "
                "('local' is for Dask's single-process schedulers; check mpshuffle.comm in dask.config)"
            )

    def host_budget(self, memory_limit: int | None) -> int | None:
        """Host budget in bytes for a worker with ``memory_limit`` bytes.

        Returns ``None`` (unbounded) when the budget is a fraction and the
        worker has no memory limit.
        """
        if isinstance(self.spill_host, float):
            if not memory_limit:
                return None
            return int(self.spill_host * memory_limit)
        return int(self.spill_host)
