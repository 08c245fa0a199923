"""One device interface, two implementations: CUDA (``cuda.py``) and the host (``host.py``); the
simulated device (``models/sim.py``) is a third, with CUDA's asynchronous semantics."""

from __future__ import annotations

import functools

import torch

from visenc.devices.api import DONE, Device, Event, HostPool


@functools.cache
def _opened(name: str) -> Device:
    device = torch.device(name)
    if device.type == "cuda":
        from visenc.devices.cuda import CudaDevice

        return CudaDevice(device)
    from visenc.devices.host import HostDevice

    return HostDevice(device)


def for_device(device: torch.device | str) -> Device:
    """The interface to ``device`` (one per device, shared by every tower on it)."""
    return _opened(str(device))


__all__ = ["DONE", "Device", "Event", "HostPool", "for_device"]
