"""Communicators: ranks, tagged point-to-point messages and a barrier.

Backends: ``tcp`` (default; :mod:`distributed.comm`, so ``tcp://`` and
``tls://``, on the communicator's own progress thread) and ``local`` (a
single process).
"""

from mpshuffle.comm.base import Communicator, Frames, Handler, Tag
from mpshuffle.comm.local import LocalCommunicator
from mpshuffle.comm.tcp import TcpCommunicator

__all__ = ["Communicator", "Frames", "Handler", "LocalCommunicator", "Tag", "TcpCommunicator"]
