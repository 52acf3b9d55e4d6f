"""The device engine: device tables moved GPU to GPU over NCCL.

Modules
-------
state
    :class:`DeviceState` (this rank's GPU, budget, NCCL transport and
    exchange turns), :func:`setup_device`, :func:`is_device_meta`.
buffers
    The run's buffers in their memory tiers (device, host, disk).
run
    :class:`DeviceRun`, one rank's share of one device run.
"""

from mpshuffle.shuffler.device.run import DeviceRun
from mpshuffle.shuffler.device.state import DEVICE_TAG, DeviceState, is_device_meta, setup_device

__all__ = ["DEVICE_TAG", "DeviceRun", "DeviceState", "is_device_meta", "setup_device"]
