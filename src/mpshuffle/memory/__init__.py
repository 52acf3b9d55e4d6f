"""Memory types, budgets, the postbox that holds received chunks, and spill files.

Every buffer a shuffler holds is accounted in a :class:`BufferResource`;
received chunks over the host budget are spilled to a :class:`SpillDirectory`.
"""

from mpshuffle.memory.postbox import Postbox
from mpshuffle.memory.resource import BufferResource, MemoryType, Reservation
from mpshuffle.memory.spill import SpillDirectory

__all__ = ["BufferResource", "MemoryType", "Postbox", "Reservation", "SpillDirectory"]
