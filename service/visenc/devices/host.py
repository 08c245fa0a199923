"""The host as the device: work is done when its call returns, rows are already on the host."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager

import torch

from visenc.devices.api import DONE, Device, Event
from visenc.engine.host import usable_memory_bytes


class Stamp:
    """A synchronous device's event: complete when made, at the time it was made."""

    __slots__ = ("at",)

    def __init__(self) -> None:
        self.at = time.monotonic()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class HostDevice(Device):
    separate_memory = False

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def stream(self) -> AbstractContextManager[object]:
        return contextlib.nullcontext()

    def record(self) -> Event:
        return Stamp()

    def seconds(self, start: Event, end: Event) -> float:
        return max(0.0, getattr(end, "at", 0.0) - getattr(start, "at", 0.0))

    def host_buffer(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        # the C heap is the pool (``heap.hold_freed``, inside the memory budget): no idle buffers kept outside it
        return torch.empty(tuple(shape), dtype=dtype)

    def stage(self, array: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The device reads host memory: ``array`` itself, or its one cast to ``dtype``."""
        return array if array.dtype == dtype else array.to(dtype)

    def to_device(self, host: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if host.dtype != dtype:
            self.host_bytes_copied += host.nbytes
        return host.to(self.device, dtype, non_blocking=True)  # no wait on a device that is not the host

    def copy_out(self, outputs: Sequence[torch.Tensor], after: Event) -> list[torch.Tensor]:
        after.synchronize()
        return [o.contiguous() for o in outputs]

    def memory_bytes(self, fraction: float) -> int:
        return int(fraction * usable_memory_bytes())

    def synchronize(self) -> None:
        return None


__all__ = ["DONE", "HostDevice"]
