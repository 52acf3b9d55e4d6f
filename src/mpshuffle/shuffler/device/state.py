"""The GPU of one rank: device choice, pool, budget, NCCL transport and exchange turns.

:func:`setup_device` picks a worker's GPU and sizes its budget;
:class:`DeviceState` holds it for the rank's runs, with the generation's NCCL
transport (created on first use, on an exchange thread) and the order in
which the rank runs exchanges.

Exchanges of one generation run one at a time on each rank, in the order rank
0 runs them (:meth:`DeviceState.turn`): two device shuffles whose barriers run
concurrently (both sides of a join, say) reach the ranks in different orders,
and ranks that ran them as they came would wait on each other.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np

from mpshuffle.errors import ShuffleError, ShuffleTimeoutError
from mpshuffle.table.cudf import is_cudf_frame
from mpshuffle.table.device import DeviceTable

if TYPE_CHECKING:
    from mpshuffle.comm import Communicator
    from mpshuffle.comm.nccl import NcclTransport
    from mpshuffle.options import Options

__all__ = ["DEVICE_TAG", "DeviceState", "is_device_meta", "setup_device"]

logger = logging.getLogger(__name__)

# Control messages handled on the progress thread: ("mpsd", op_id, kind).
DEVICE_TAG = "mpsd"


def is_device_meta(meta: object) -> bool:
    """Whether a shuffle of frames like ``meta`` takes the device run path.

    True for a :class:`DeviceTable` whose columns are not NumPy arrays (CuPy)
    and for a ``cudf.DataFrame`` (its columns are taken as CuPy arrays, see
    :class:`~mpshuffle.table.cudf.CudfAdapter`); NumPy-backed device tables
    (the host twin) use the host path. Never imports cudf or CuPy.
    """
    if isinstance(meta, DeviceTable):
        return meta.xp is not np
    return is_cudf_frame(meta)


class DeviceState:
    """The GPU of one rank and its NCCL transport (created on first use).

    Attributes
    ----------
    device
        CUDA device id this rank uses.
    budget
        Device bytes the shuffle buffers may hold before spilling (``spill_device``).
    pool_bytes
        Bytes CuPy's memory pool holds after the ``pool_size`` reservation (0 without one).
    """

    def __init__(self, device: int, budget: int, pool_bytes: int) -> None:
        self.device = device
        self.budget = budget
        self.pool_bytes = pool_bytes
        self._transport: NcclTransport | None = None
        # One exchange at a time per rank: NCCL operations of two exchanges
        # on one communicator must not interleave.
        self.exchange_lock = threading.Lock()
        # Exchanges rank 0 started, in its order, that this rank has still to run.
        self._turns: list[int] = []
        self._turns_changed = threading.Condition()

    def add_turn(self, op_id: int) -> None:
        """Record that rank 0 started the exchange of ``op_id`` (progress thread; never blocks)."""
        with self._turns_changed:
            self._turns.append(op_id)
            self._turns_changed.notify_all()

    def drop_turn(self, op_id: int) -> None:
        """Forget ``op_id``'s turn (its exchange ended, or its run closed or failed here)."""
        with self._turns_changed:
            if op_id in self._turns:
                self._turns.remove(op_id)
                self._turns_changed.notify_all()

    @contextlib.contextmanager
    def turn(self, comm: Communicator, op_id: int, timeout: float, check: Callable[[], None]) -> Iterator[None]:
        """Hold this rank's exchange slot for ``op_id``, in the order rank 0 runs exchanges.

        Ranks may learn of two runs' barriers in different orders; were each
        to run its exchanges as they come, rank 0 could wait in run A for a
        peer busy in run B and both would stall. So rank 0 runs exchanges in
        its own order and, on taking the slot, sends ``turn`` to every other
        rank; the others run exchanges strictly in the order of those
        messages.

        Parameters
        ----------
        comm
            The generation's host communicator.
        op_id
            The run whose exchange is about to start.
        timeout
            Seconds a rank other than 0 waits with no exchange ahead of it
            ending before it gives up.
        check
            Called while waiting; raises if the run failed meanwhile.

        Raises
        ------
        ShuffleTimeoutError
            If rank 0 did not start ``op_id``'s exchange in time, naming the
            exchanges queued ahead of it.
        """
        if comm.nranks == 1:
            with self.exchange_lock:
                yield
            return
        if comm.rank == 0:
            with self.exchange_lock:
                for dest in range(1, comm.nranks):
                    comm.send_nowait(dest, (DEVICE_TAG, op_id, "turn"), [])
                yield
            return
        try:
            with self._turns_changed:
                deadline, ahead = time.monotonic() + timeout, list(self._turns)
                while not self._turns or self._turns[0] != op_id:
                    check()
                    if self._turns != ahead:  # an exchange ahead ended or a turn came: progress
                        deadline, ahead = time.monotonic() + timeout, list(self._turns)
                    if time.monotonic() > deadline:
                        raise ShuffleTimeoutError(
                            f"device shuffle op {op_id} on rank {comm.rank}: rank 0 did not start its "
                            f"exchange within {timeout:g} s (exchanges queued here: {self._turns})"
                        )
                    self._turns_changed.wait(0.1)
            with self.exchange_lock:
                yield
        finally:
            self.drop_turn(op_id)

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Make this rank's GPU current in the calling thread (CUDA's current device is per thread)."""
        import cupy

        with cupy.cuda.Device(self.device):
            yield

    def transport(self, comm: Communicator, key: str, timeout: float) -> NcclTransport:
        """The NCCL transport over ``comm``'s ranks; the first call is collective.

        Called under :attr:`exchange_lock` from an exchange thread, which is
        where NCCL's blocking join happens.
        """
        if self._transport is None:
            from mpshuffle.comm.nccl import NcclTransport

            self._transport = NcclTransport.create(comm, key=key, device=self.device, timeout=timeout)
        return self._transport

    def check_table(self, frame: DeviceTable, what: str, rank: int) -> None:
        """Refuse a CuPy table with a column on another GPU than this rank's.

        Raises
        ------
        ShuffleError
            Naming ``what`` (e.g. the input partition), the column and both GPUs.
        """
        if frame.xp is np:
            return
        for name, col in frame.columns.items():
            dev = getattr(getattr(col, "device", None), "id", self.device)
            if int(dev) != self.device:
                raise ShuffleError(
                    f"{what}: column {name!r} is on GPU {dev}, but rank {rank} uses GPU "
                    f"{self.device}; run one worker per GPU (CUDA_VISIBLE_DEVICES per worker, as "
                    "dask-cuda's LocalCUDACluster does) or build each partition on its worker's GPU"
                )

    def close(self) -> None:
        """Destroy the NCCL communicator, if one was created. Idempotent."""
        t, self._transport = self._transport, None
        if t is not None:
            t.close()


def setup_device(options: Options, rank: int) -> DeviceState | None:
    """Pick this rank's GPU, reserve the pool and size the device budget.

    Where ``CUDA_VISIBLE_DEVICES`` is set, the device is the first one it
    lists (dask-cuda's LocalCUDACluster gives worker ``i`` the list rotated to
    start at GPU ``i``; a worker pinned to one GPU sees only that one);
    otherwise ``rank % ndevices`` among the visible ones. Registers the device
    frame adapter.

    Parameters
    ----------
    options
        ``pool_size`` (fraction of the device CuPy's pool takes now, or
        ``None``) and ``spill_device`` (fraction of the device at which the
        shuffle's device buffers spill to host).
    rank
        This worker's rank.

    Returns
    -------
    DeviceState or None
        ``None`` where CuPy does not import or no GPU is visible.

    Raises
    ------
    MemoryError
        If the pool reservation does not fit on the device.
    """
    try:
        import cupy

        ndev = int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001 - no CuPy, no driver or no device: no device path
        return None
    if ndev < 1:
        return None
    from mpshuffle.memory.device import device_budget, reserve_device_pool
    from mpshuffle.table.gpu import register_device_adapter

    register_device_adapter()
    # A worker given its GPUs in CUDA_VISIBLE_DEVICES uses the first one listed
    # (dask-cuda lists the worker's own GPU first, then the others); a worker
    # that sees every GPU of the machine takes one by rank.
    device = 0 if os.environ.get("CUDA_VISIBLE_DEVICES", "").strip() else rank % ndev
    with cupy.cuda.Device(device):
        pool = reserve_device_pool(options.pool_size) if options.pool_size else 0
        budget = device_budget(options.spill_device)
    logger.info(
        "mpshuffle: rank %d uses GPU %d (CUDA_VISIBLE_DEVICES=%s), pool %d bytes, device budget %d bytes",
        rank, device, os.environ.get("CUDA_VISIBLE_DEVICES"), pool, budget,
    )
    return DeviceState(device, budget, pool)
