"""Device buffers between ranks over NCCL, through CuPy's bindings (``cupy.cuda.nccl``).

An :class:`NcclTransport` sits beside a host :class:`~mpshuffle.comm.Communicator`
of the same ranks: the host communicator carries the NCCL unique id at
creation and every control message (sizes, finish counts); NCCL moves only
the bulk device bytes, GPU to GPU (NVLink where the GPUs have it), never
staged through host memory.

Creating an NCCL communicator is a collective that blocks until every rank
has joined; :meth:`NcclTransport.acreate` runs it on a thread so that an
event loop (a Dask worker's) is never blocked.

One rank per GPU: each rank uses the CUDA device that is current when the
transport is created (or the ``device`` given).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgpack

from mpshuffle.errors import CommError

if TYPE_CHECKING:
    from mpshuffle.comm.base import Communicator

__all__ = ["NcclTransport"]

# NCCL counts are size_t, but some versions mishandle counts at or past 2**31;
# splitting large buffers costs one more NCCL operation per GiB.
_MAX_OP_BYTES = 1 << 30


class NcclTransport:
    """NCCL point-to-point transfers of device arrays between the ranks of a communicator.

    Build with :meth:`create` (blocking) or :meth:`acreate` (coroutine); all
    ranks must call one of them with the same ``key``.

    Attributes
    ----------
    rank, nranks
        As the host communicator's.
    device
        CUDA device id this rank's transfers use.
    """

    rank: int
    nranks: int
    device: int

    def __init__(self, nccl_comm: Any, rank: int, nranks: int, device: int) -> None:
        import cupy

        self._nccl = nccl_comm
        self.rank = rank
        self.nranks = nranks
        self.device = device
        with cupy.cuda.Device(device):
            self._stream = cupy.cuda.Stream(non_blocking=True)
        self._closed = False

    # -- creation ----------------------------------------------------------
    @staticmethod
    def _tag(key: str) -> tuple[str, str]:
        return ("nccl-uid", key)

    @staticmethod
    def _current_device(device: int | None) -> int:
        import cupy

        return int(cupy.cuda.Device().id) if device is None else int(device)

    @classmethod
    def _init(cls, uid: Any, rank: int, nranks: int, device: int) -> NcclTransport:
        import cupy
        from cupy.cuda import nccl

        # The current device is per thread: set it here, where NCCL binds.
        with cupy.cuda.Device(device):
            nccl_comm = nccl.NcclCommunicator(nranks, uid, rank)
        return cls(nccl_comm, rank, nranks, device)

    @classmethod
    def _make_uid(cls, comm: Communicator, key: str) -> Any:
        from cupy.cuda import nccl

        uid = nccl.get_unique_id()  # bytes in recent CuPy, a tuple of ints in older ones
        payload = msgpack.packb(uid if isinstance(uid, bytes) else list(uid))
        for dest in range(1, comm.nranks):
            comm.send_nowait(dest, cls._tag(key), [payload])
        return uid

    @classmethod
    def create(
        cls, comm: Communicator, *, key: str = "default", device: int | None = None,
        timeout: float = 60.0,
    ) -> NcclTransport:
        """Create the transport on every rank (blocking collective).

        Rank 0 makes the NCCL unique id and sends it to the others over
        ``comm``; then every rank joins the NCCL communicator.

        Parameters
        ----------
        comm
            The host communicator of the ranks.
        key
            Distinguishes concurrent creations on one communicator.
        device
            CUDA device id; the current device if ``None``.
        timeout
            Seconds to wait for the unique id from rank 0.

        Raises
        ------
        CommError
            If the unique id does not arrive or NCCL fails to initialize.
        """
        dev = cls._current_device(device)
        if comm.rank == 0:
            uid = cls._make_uid(comm, key)
        else:
            uid = _uid(comm.recv(0, cls._tag(key), timeout))
        try:
            return cls._init(uid, comm.rank, comm.nranks, dev)
        except Exception as e:
            raise CommError(f"rank {comm.rank}: NCCL communicator creation failed: {e}") from e

    @classmethod
    async def acreate(
        cls, comm: Communicator, *, key: str = "default", device: int | None = None,
        timeout: float = 60.0,
    ) -> NcclTransport:
        """Coroutine twin of :meth:`create`: NCCL's blocking join runs on a thread."""
        dev = cls._current_device(device)
        if comm.rank == 0:
            uid = cls._make_uid(comm, key)
        else:
            frames = await comm.arecv(0, cls._tag(key), timeout)
            uid = _uid(frames)
        try:
            return await asyncio.to_thread(cls._init, uid, comm.rank, comm.nranks, dev)
        except Exception as e:
            raise CommError(f"rank {comm.rank}: NCCL communicator creation failed: {e}") from e

    # -- transfers ----------------------------------------------------------
    def exchange(
        self, sends: Mapping[int, Sequence[Any]], recvs: Mapping[int, Sequence[Any]]
    ) -> None:
        """Send and receive device arrays, all in one NCCL group; blocks until done.

        Every rank calls this together. The arrays of ``sends[peer]`` arrive,
        in list order, in the arrays of ``recvs[self.rank]`` on ``peer``: the
        peer's list must have the same byte sizes in the same order (the
        caller exchanges sizes over the host communicator first). Arrays must
        be C-contiguous; zero-byte arrays are skipped. ``sends[self.rank]`` is
        copied into ``recvs[self.rank]`` on the device.

        Work queued on the current stream (e.g. the kernels that filled the
        send arrays) completes before any byte moves.

        Parameters
        ----------
        sends, recvs
            ``{peer rank: [cupy.ndarray, ...]}``.

        Raises
        ------
        CommError
            If the transport is closed, the local sizes do not match, or NCCL fails.
        """
        import cupy
        from cupy.cuda import nccl

        if self._closed:
            raise CommError(f"rank {self.rank}: NCCL transport is closed")
        own_s, own_r = list(sends.get(self.rank, ())), list(recvs.get(self.rank, ()))
        if [a.nbytes for a in own_s] != [a.nbytes for a in own_r]:
            raise CommError(f"rank {self.rank}: local send and receive sizes differ")
        stream = self._stream
        with cupy.cuda.Device(self.device):
            stream.wait_event(cupy.cuda.get_current_stream().record())
            for src, dst in zip(own_s, own_r, strict=True):
                if src.nbytes:
                    cupy.cuda.runtime.memcpyAsync(
                        dst.data.ptr, src.data.ptr, src.nbytes,
                        cupy.cuda.runtime.memcpyDeviceToDevice, stream.ptr,
                    )
            try:
                nccl.groupStart()
                try:
                    for peer, arrays in sends.items():
                        if peer != self.rank:
                            for a in arrays:
                                for ptr, n in _pieces(a):
                                    self._nccl.send(ptr, n, nccl.NCCL_INT8, peer, stream.ptr)
                    for peer, arrays in recvs.items():
                        if peer != self.rank:
                            for a in arrays:
                                for ptr, n in _pieces(a):
                                    self._nccl.recv(ptr, n, nccl.NCCL_INT8, peer, stream.ptr)
                finally:
                    nccl.groupEnd()
                stream.synchronize()
            except nccl.NcclError as e:
                raise CommError(f"rank {self.rank}: NCCL exchange failed: {e}") from e

    def close(self) -> None:
        """Destroy the NCCL communicator. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._nccl.destroy()


def _uid(frames: Any) -> Any:
    uid = msgpack.unpackb(bytes(frames[0]))
    return uid if isinstance(uid, bytes) else tuple(uid)


def _pieces(a: Any) -> list[tuple[int, int]]:
    if not a.flags.c_contiguous:
        raise CommError("NCCL transfers need C-contiguous device arrays")
    ptr, n = int(a.data.ptr), int(a.nbytes)
    return [(ptr + o, min(_MAX_OP_BYTES, n - o)) for o in range(0, n, _MAX_OP_BYTES)]
