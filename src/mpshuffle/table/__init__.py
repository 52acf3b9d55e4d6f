"""Frame adapters: hash partitioning, and packing frames into :class:`PackedData`.

``get_adapter(frame)`` picks the adapter for a frame (pandas and pyarrow are
built in; add others with ``register_adapter``). The hash is documented in
:mod:`mpshuffle.table.hashing`.
"""

from __future__ import annotations

from mpshuffle.memory.packed import PackedData
from mpshuffle.table.arrow import ArrowAdapter
from mpshuffle.table.base import FrameAdapter, get_adapter, register_adapter
from mpshuffle.table.hashing import owned_partitions, partition_ids, partition_owner
from mpshuffle.table.pandas import PandasAdapter

# Built-ins first: adapters registered later take precedence.
register_adapter(ArrowAdapter())
register_adapter(PandasAdapter())

__all__ = [
    "ArrowAdapter",
    "FrameAdapter",
    "PackedData",
    "PandasAdapter",
    "get_adapter",
    "owned_partitions",
    "partition_ids",
    "partition_owner",
    "register_adapter",
]
