"""Memory types, budgets, packed buffers, the postbox that holds received chunks, and spill files.

:class:`PackedData` is the serialized form of a piece of a frame that every
other layer moves around; the frame adapters of :mod:`mpshuffle.table` write
and read it, this package only holds, counts and spills it (it never imports
:mod:`mpshuffle.table`). Every buffer a shuffler holds is accounted in a
:class:`BufferResource` and lives in one tier of the one store
(:mod:`mpshuffle.memory.store`: device -> host -> disk, one policy for the host
and the device runs); its disk tier is the run's :class:`SpillDirectory`.
"""

from mpshuffle.memory.packed import PackedData
from mpshuffle.memory.postbox import Chunk, Postbox
from mpshuffle.memory.resource import BufferResource, MemoryType, Reservation
from mpshuffle.memory.spill import SpillDirectory

__all__ = ["BufferResource", "Chunk", "MemoryType", "PackedData", "Postbox", "Reservation", "SpillDirectory"]
