"""The device interface: everything the service does with a device goes through a ``Device``."""

from __future__ import annotations

import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Protocol

import torch


class Event(Protocol):
    """A point in a device's queue: complete once the work queued before it is."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class Done:
    """The event of a device whose work is done when its call returns."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


DONE = Done()


class HostPool:
    """Host buffers reused by size: a buffer goes back once nothing refers to it (no queued copy either)."""

    def __init__(self, max_idle_bytes: int = 256 << 20) -> None:
        self.max_idle_bytes = max_idle_bytes
        self._idle: dict[int, list[torch.Tensor]] = {}
        self._idle_bytes = 0
        self._lock = threading.Lock()
        self.allocated = 0

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        nbytes = max(1, int(torch.Size(shape).numel()) * dtype.itemsize)
        size = 1 << (nbytes - 1).bit_length()
        with self._lock:
            free = self._idle.get(size)
            root = free.pop() if free else None
            if root is not None:
                self._idle_bytes -= size
        if root is None:
            root = self.allocate(size)
            self.allocated += 1
        view = root[:nbytes].view(dtype).view(tuple(shape))
        weakref.finalize(view, self._give, root)
        return view

    def allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def _give(self, root: torch.Tensor) -> None:
        with self._lock:
            if self._idle_bytes + root.numel() <= self.max_idle_bytes:
                self._idle.setdefault(root.numel(), []).append(root)
                self._idle_bytes += root.numel()


class Device(ABC):
    """Streams, events, host buffers, copies both ways, memory and out-of-memory of one device.

    Contract, the same for every implementation: work is queued on the device thread's stream (``stream``)
    and may run after the call returns; an event completes when the work queued before it does; a copy to
    the host (``copy_out``) returns once the rows are on the host; host buffers (``host_buffer``) come from
    a pool and go back once no queued copy reads them.
    """

    #: the device's memory is not the host's: inputs and rows cross a copy, and memory is planned as a GPU's
    separate_memory: bool = True
    #: ``compile=auto`` compiles the tower's blocks here
    compiles_by_default: bool = False
    #: fused varlen attention kernels may run here (``models/varlen.py`` tries them)
    fused_attention: bool = False
    #: the compiler the backend builds with: its variable, then the names looked up on PATH
    compiler: tuple[str, ...] = ("CXX", "g++")
    compiler_name = "C++ compiler"
    device: torch.device

    def __init__(self) -> None:
        #: host bytes the device thread copied to launch forwards (inputs not staged in a host buffer)
        self.host_bytes_copied = 0

    @abstractmethod
    def stream(self) -> AbstractContextManager[object]:
        """Entered around the device thread's work: it is queued on the device thread's stream."""

    @abstractmethod
    def record(self) -> Event:
        """An event after the work queued so far on the current stream (its time is read by ``seconds``)."""

    @abstractmethod
    def seconds(self, start: Event, end: Event) -> float:
        """Device time between two completed events of the device thread's stream."""

    @abstractmethod
    def host_buffer(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A host buffer the device copies from and to without a staging copy (pinned on CUDA)."""

    @abstractmethod
    def to_device(self, host: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Queue ``host``'s copy to the device in ``dtype``; never waits for the device."""

    @abstractmethod
    def copy_out(self, outputs: Sequence[torch.Tensor], after: Event) -> list[torch.Tensor]:
        """``outputs`` on the host, copied once ``after`` completes; returns when the copies are done."""

    @abstractmethod
    def memory_bytes(self, fraction: float) -> int:
        """``fraction`` of the device's memory (at most what is free)."""

    def free_cached(self) -> None:
        """Give cached device memory back (after an out-of-memory)."""
        return None

    @abstractmethod
    def synchronize(self) -> None:
        """Wait for all the device's work (start-up and warm-up only: never on the serving path)."""

    def torch_threads(self, cores: int) -> int:
        return cores

    def current(self) -> torch.device:
        """The device with its index, where it has one."""
        return self.device

    def compiler_problems(self) -> list[str]:
        """What compiling for this device needs beyond a C++ compiler and Python's headers (``models/compiled.py``)."""
        return []

    def is_out_of_memory(self, error: BaseException) -> bool:
        """A device or host allocation failure (CUDA OOM, a CPU allocator refusal, ``MemoryError``)."""
        if isinstance(error, torch.OutOfMemoryError | MemoryError):
            return True
        text = str(error)
        return isinstance(error, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)

    def stage(self, array: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``array`` written once into a host buffer in ``dtype`` (a preprocessing thread, off the device's)."""
        buffer = self.host_buffer(array.shape, dtype)
        buffer.copy_(array)
        return buffer

    def note_wait(self, reason: str, start: float, end: float) -> None:
        """The device thread waited from ``start`` to ``end`` (monotonic) for ``reason`` (a timeline's record)."""
        return None
