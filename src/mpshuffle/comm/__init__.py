"""Communicators: ranks, tagged point-to-point messages and a barrier.

Backends: ``tcp`` (:class:`mpshuffle.comm.tcp.TcpCommunicator`, default for a
distributed cluster; :mod:`distributed.comm`, so ``tcp://`` and ``tls://``, on
the communicator's own progress thread) and ``local`` (a single process).

``tcp`` is imported from its own module, not here: the engine imports this
package for :class:`Communicator`, and that must not import ``distributed``.
"""

from mpshuffle.comm.base import Communicator, Frames, Handler, Tag
from mpshuffle.comm.local import LocalCommunicator

__all__ = ["Communicator", "Frames", "Handler", "LocalCommunicator", "Tag"]
