"""Memory types, budgets and the postbox that holds received chunks.

Every buffer a shuffler holds is accounted in a :class:`BufferResource`.
"""

from mpshuffle.memory.resource import BufferResource, MemoryType, Reservation
from mpshuffle.memory.postbox import Postbox

__all__ = ["BufferResource", "MemoryType", "Postbox", "Reservation"]
