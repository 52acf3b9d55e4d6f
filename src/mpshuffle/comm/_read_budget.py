"""What an accepted connection may make a rank read (and allocate) before it is known.

:mod:`distributed.comm` reads a message by its sizes: an 8-byte prefix gives
the length of the message's header part, which is read into a buffer of that
length; the header lists the lengths of the message's remaining frames, each
read into a buffer of its length. Every buffer is allocated from what the peer
announced, before a byte of it arrives. On an accepted connection that has not
yet presented a valid hello, the peer is unknown: distributed's handshake and
the hello together take a few hundred bytes, but a stranger announcing 512 MiB
made a rank allocate (and, as it sent, fill) 512 MiB.

:class:`ReadBudget` sits on such a stream until the hello is accepted. Each
read the stream is asked for is charged against a budget of
:data:`HELLO_BYTES`, and a read past it is refused before the stream reads
anything. The announced sizes are checked as soon as they are known, before
:mod:`distributed.comm` allocates for them: the header part's length when the
8-byte prefix arrives, and the remaining frames' lengths when the header part
arrives (parsed with distributed's own ``unpack_frames``). A refusal raises
:class:`OversizedError`, which closes the connection; the communicator logs
it as a refused connection.
"""

from __future__ import annotations

import struct
from typing import Any

from mpshuffle.errors import CommError

__all__ = ["HELLO_BYTES", "OversizedError", "ReadBudget"]

#: Bytes a connection may send before its hello is accepted (distributed's
#: handshake and the hello take a few hundred).
HELLO_BYTES = 64 * 1024

# distributed.comm's length prefix: one unsigned 64-bit integer.
_PREFIX = struct.Struct("Q")


class OversizedError(CommError):
    """A connection not yet known announced or sent more than :data:`HELLO_BYTES` bytes."""


class ReadBudget:
    """Bound the reads of an accepted stream until :meth:`remove` (see the module docstring).

    Parameters
    ----------
    stream
        A :class:`tornado.iostream.IOStream` (or ``SSLIOStream``): its
        ``read_bytes`` and ``read_into`` are replaced on the instance, until
        :meth:`remove`.
    nbytes
        The budget, in bytes.

    Attributes
    ----------
    left
        Bytes the stream may still read.
    """

    left: int
    _reserved: int
    _header: int | None

    def __init__(self, stream: Any, nbytes: int = HELLO_BYTES) -> None:
        self.left = nbytes
        self._nbytes = nbytes
        self._reserved = 0  # announced (and charged), not read yet
        self._header = None  # the announced length of a header part not read yet
        self._read_bytes = stream.read_bytes
        self._read_into = stream.read_into
        stream.read_bytes = self.read_bytes
        stream.read_into = self.read_into

    @staticmethod
    def remove(stream: Any) -> None:
        """Give ``stream`` its own reads back (once the hello is accepted). Idempotent."""
        for name in ("read_bytes", "read_into"):
            vars(stream).pop(name, None)

    def _charge(self, n: int, what: str) -> None:
        if n > self.left:
            raise OversizedError(
                f"{what} of {n} bytes before a valid hello; a connection not yet known may "
                f"send at most {self._nbytes} bytes"
            )
        self.left -= n

    def _take(self, n: int) -> None:
        """Charge a read of ``n`` bytes, what was announced for it first."""
        announced = min(n, self._reserved)
        self._charge(n - announced, "a read")
        self._reserved -= announced

    def _announce(self, n: int) -> None:
        self._charge(n, "a message")
        self._reserved += n

    async def read_bytes(self, num_bytes: int, partial: bool = False) -> bytes:
        """The stream's ``read_bytes``, within the budget; a length prefix is checked at once."""
        self._take(num_bytes)
        data = await self._read_bytes(num_bytes, partial)
        if num_bytes == _PREFIX.size and len(data) == _PREFIX.size:
            (announced,) = _PREFIX.unpack(data)
            self._announce(announced)
            self._header = announced
        return data

    async def read_into(self, buf: Any, partial: bool = False) -> int:
        """The stream's ``read_into``, within the budget; a message's header part is checked at once."""
        nbytes = memoryview(buf).nbytes
        header, self._header = self._header, None
        self._take(nbytes)
        n = int(await self._read_into(buf, partial))
        if header is not None and nbytes == header and n == header:
            self._announce(sum(_missing_lengths(memoryview(buf))))
        return n


def _missing_lengths(header: memoryview) -> list[int]:
    """The lengths of the frames a message's header part announces but does not hold."""
    from distributed.protocol.utils import unpack_frames

    try:
        _, missing = unpack_frames(header, partial=True)
    except (struct.error, ValueError) as e:
        raise OversizedError(f"a message whose header does not parse ({e})") from None
    return [int(n) for n in missing]
