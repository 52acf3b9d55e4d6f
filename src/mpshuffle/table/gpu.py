"""Registering the GPU frame adapters (device tables, and cudf frames where cudf is installed).

Kept apart from :mod:`mpshuffle.table.device` and :mod:`mpshuffle.table.cudf`
so that neither imports the other's registration: the cudf adapter is built
on the device adapter, and this module sits above both.
"""

from __future__ import annotations

from mpshuffle.table.base import register_adapter
from mpshuffle.table.cudf import CudfAdapter
from mpshuffle.table.device import DeviceAdapter

__all__ = ["register_device_adapter"]


def register_device_adapter() -> bool:
    """Register :class:`DeviceAdapter` if CuPy imports; return whether it did.

    Also registers :class:`~mpshuffle.table.cudf.CudfAdapter` when cudf
    imports. Not called on ``import mpshuffle``, so that import never touches CUDA.
    """
    try:
        import cupy  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken CUDA install raises more than ImportError
        return False
    register_adapter(DeviceAdapter())
    try:
        import cudf  # noqa: F401
    except Exception:  # noqa: BLE001 - as above
        return True
    register_adapter(CudfAdapter())
    return True
