"""The ``local`` communicator: one rank in one process, no network."""

from __future__ import annotations

import asyncio
import threading

from mpshuffle.comm.base import Communicator, Frames, Tag

__all__ = ["LocalCommunicator"]


class LocalCommunicator(Communicator):
    """A communicator of a single rank (``rank == 0``, ``nranks == 1``).

    Messages to rank 0 are delivered in process. It still runs a progress
    thread so that handlers see the same threading as with ``tcp``.
    """

    def __init__(self) -> None:
        super().__init__(0, 1)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="mpshuffle-local-progress", daemon=True
        )
        self._thread.start()
        self.addresses = ["local://0"]

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    async def _send(self, dest: int, tag: Tag, frames: Frames) -> None:
        self._deliver(dest, tag, frames)

    def close(self) -> None:
        """Stop the progress thread; calls still pending end with a ``CommError``. Idempotent."""
        self._stop_progress(self._thread, timeout=5)
