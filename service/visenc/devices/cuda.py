"""The CUDA device: a stream for forwards, one for copies out, timing events, pinned host buffers."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from visenc.devices.api import Device, Event


class CudaDevice(Device):
    separate_memory = True
    compiles_by_default = True
    fused_attention = True
    compiler = ("CC", "gcc", "clang")  # Triton builds its launcher with a C compiler
    compiler_name = "C compiler"

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self._forward: Any = None
        self._copy: Any = None

    def _streams(self) -> tuple[Any, Any]:
        if self._forward is None:
            self._forward, self._copy = torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)
        return self._forward, self._copy

    def stream(self) -> AbstractContextManager[object]:
        return torch.cuda.stream(self._streams()[0])

    def record(self) -> Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # the current stream: the device thread's, inside ``stream()``
        return event

    def seconds(self, start: Event, end: Event) -> float:
        return float(start.elapsed_time(end)) / 1000  # type: ignore[attr-defined]

    def host_buffer(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        # torch's caching host allocator is the pool: a block is reused once the copies recorded on it are done
        return torch.empty(tuple(shape), dtype=dtype, pin_memory=True)

    def to_device(self, host: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if not host.is_pinned():
            self.host_bytes_copied += host.nbytes
            host = host.pin_memory()
        return host.to(self.device, dtype, non_blocking=True)

    def copy_out(self, outputs: Sequence[torch.Tensor], after: Event) -> list[torch.Tensor]:
        copy = self._streams()[1]
        with torch.cuda.stream(copy):
            copy.wait_event(after)
            hosts = []
            for out in outputs:
                out.record_stream(copy)  # the allocator keeps it until this stream's copy is done
                host = self.host_buffer(out.shape, out.dtype)
                host.copy_(out, non_blocking=True)
                hosts.append(host)
        copy.synchronize()  # the copy stream only: the forward stream runs on
        return hosts

    def memory_bytes(self, fraction: float) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        return int(min(fraction * total, free))

    def free_cached(self) -> None:
        torch.cuda.empty_cache()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def torch_threads(self, cores: int) -> int:
        return 1

    def compiler_problems(self) -> list[str]:
        try:
            from triton.backends.nvidia.driver import libcuda_dirs

            libcuda_dirs()  # asserts that libcuda.so.1 is found (ldconfig, LD_LIBRARY_PATH, TRITON_LIBCUDA_PATH)
        except Exception as error:
            line = " ".join(x.strip() for x in str(error).splitlines() if x.strip())[:300] or type(error).__name__
            return [f"what Triton needs to build its launcher ({type(error).__name__}: {line})"]
        return []

    def current(self) -> torch.device:
        """``cuda`` with its index (the current device where none is named)."""
        return self.device if self.device.index is not None else torch.device("cuda", torch.cuda.current_device())
