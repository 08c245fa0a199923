"""A simulated device, to time the engine's loop without one: ``--model sim:`` or ``sim:KEY=VALUE,...``."""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np
import torch
from PIL import Image

from visenc.devices import Device, Event, HostPool
from visenc.models.base import Prepared, TokenLayout, VisionTower

PREFIX = "sim:"


@dataclass(frozen=True)
class SimSpec:
    launch_ms: float = 1.0
    token_us: float = 100.0
    patch: int = 16
    max_side: int = 512
    hidden: int = 64
    #: 1: the forward returns only once its device work is done (a forward with a host sync inside)
    sync: int = 0
    #: the device's memory, planned as a GPU's (``engine/budget.py``); past it a forward runs out of memory
    memory_mb: int = 1024
    #: the launch's host cost of each byte it copies (an input not staged in a host buffer): ~10 GB/s memcpy
    copy_ns_per_byte: float = 0.1
    #: the copy out's device time a byte (the copy engine, beside the forwards): ~25 GB/s
    out_ns_per_byte: float = 0.04
    timeline: str | None = field(default=None, compare=False)

    @classmethod
    def parse(cls, spec: str) -> SimSpec:
        types = {f.name: f.type for f in fields(cls)}
        values: dict[str, Any] = {}
        for pair in filter(None, spec.removeprefix(PREFIX).split(",")):
            key, _, value = pair.partition("=")
            if key not in types:
                raise ValueError(f"unknown sim key {key!r}; keys are {sorted(types)}")
            kind = types[key]
            values[key] = value if "str" in str(kind) else (float(value) if "float" in str(kind) else int(value))
        return cls(**values)


@dataclass(frozen=True, slots=True)
class Span:
    launched: float
    queued: float
    start: float
    end: float
    images: int
    tokens: int


@dataclass(frozen=True, slots=True)
class Wait:
    """The device thread waited (``reason``), from ``start`` to ``end``."""

    wait: str
    start: float
    end: float


class SimEvent:
    """A point in the simulated stream: complete at ``at``, once the work queued before it (``seq``) ends."""

    def __init__(self, device: SimDevice, seq: int, at: float) -> None:
        self._device, self.seq, self.at = device, seq, at

    def synchronize(self) -> None:
        self._device.wait_for(self.seq)

    def query(self) -> bool:
        return self._device.done(self.seq)


class SimDevice(Device):
    """The simulated stream: work runs in queue order, each item after the one before it ends; CUDA's semantics."""

    def __init__(self, spec: SimSpec) -> None:
        super().__init__()
        self.spec = spec
        self.pool = HostPool()
        self._work: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._completing = threading.Lock()
        self._pending: collections.deque[tuple[int, Span, Callable[[], None]]] = collections.deque()
        self._ends: dict[int, float] = {}
        self._queued_seq = 0
        self._free_at = 0.0
        self.spans: list[Span] = []
        self.waits: list[Wait] = []
        #: (the forward's end, when its rows were on the host), one a copy out
        self.copies: list[tuple[float, float]] = []
        self._timeline = open(spec.timeline, "a", buffering=1) if spec.timeline else None
        threading.Thread(target=self._run, name="visenc-sim-device", daemon=True).start()

    def queue(self, launched: float, seconds: float, images: int, tokens: int, fill: Callable[[], None]) -> None:
        """Device work of ``seconds``, launched at ``launched``, starting once the work before it ends."""
        with self._lock:
            now = time.monotonic()
            start = max(now, self._free_at)
            self._free_at = start + seconds
            self._queued_seq += 1
            self._ends[self._queued_seq] = self._free_at
            self._pending.append((self._queued_seq, Span(launched, now, start, self._free_at, images, tokens), fill))
        self._work.put(self._queued_seq)

    def stream(self) -> AbstractContextManager[object]:
        return contextlib.nullcontext()

    def record(self) -> SimEvent:
        with self._lock:
            return SimEvent(self, self._queued_seq, max(time.monotonic(), self._free_at))

    def seconds(self, start: Event, end: Event) -> float:
        assert isinstance(start, SimEvent) and isinstance(end, SimEvent)
        return end.at - start.at

    def host_buffer(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        buffer = self.pool.take(shape, dtype)
        buffer.visenc_pinned = True  # type: ignore[attr-defined]
        return buffer

    def to_device(self, host: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if getattr(host, "visenc_pinned", False) and host.dtype == dtype:
            return host  # the device reads the host buffer (kept alive by the forward until it ends)
        self.host_bytes_copied += host.nbytes  # a pageable input: copied to a buffer by the launching thread
        return host.to(dtype, copy=True)

    def copy_out(self, outputs: Sequence[torch.Tensor], after: Event) -> list[torch.Tensor]:
        after.synchronize()  # the copy stream waits for the forward's event
        time.sleep(sum(o.nbytes for o in outputs) * self.spec.out_ns_per_byte / 1e9)  # the copy engine
        hosts = [self.host_buffer(o.shape, o.dtype).copy_(o) for o in outputs]
        assert isinstance(after, SimEvent)
        self.copies.append((after.at, time.monotonic()))
        return hosts

    def memory_bytes(self, fraction: float) -> int:
        return int(fraction * self.spec.memory_mb * 2**20)

    def synchronize(self) -> None:
        self.record().synchronize()

    def note_wait(self, reason: str, start: float, end: float) -> None:
        wait = Wait(reason, start, end)
        self.waits.append(wait)
        if self._timeline is not None:
            self._timeline.write(json.dumps(asdict(wait)) + "\n")

    def done(self, seq: int) -> bool:
        with self._lock:
            end = self._ends.get(seq)
        return end is None or end <= time.monotonic()

    def wait_for(self, seq: int) -> None:
        with self._lock:
            end = self._ends.get(seq, 0.0)
        delay = end - time.monotonic()
        if delay > 0:
            time.sleep(delay)  # the device works: the GIL is free
        self._complete(seq)

    def _complete(self, seq: int) -> None:
        with self._completing:
            while self._pending and self._pending[0][0] <= seq:
                done, span, fill = self._pending.popleft()
                fill()
                self.spans.append(span)
                if self._timeline is not None:
                    self._timeline.write(json.dumps(asdict(span)) + "\n")
                with self._lock:
                    del self._ends[done]

    def _run(self) -> None:
        while True:
            self.wait_for(self._work.get())


def stats(spans: Sequence[Span]) -> dict[str, float]:
    """Busy share of the device, and what its idle time went to (``late``: host behind; ``launch``: the launch)."""
    if not spans:
        return {"forwards": 0, "busy_share": 0.0, "late_share": 0.0, "launch_share": 0.0, "images_per_forward": 0.0}
    spans = sorted(spans, key=lambda s: s.start)
    wall = spans[-1].end - spans[0].start
    busy = sum(s.end - s.start for s in spans)
    late = launch = 0.0
    for before, after in itertools.pairwise(spans):
        idle = after.start - before.end
        if idle > 0:
            host_late = min(idle, max(0.0, after.launched - before.end))
            late, launch = late + host_late, launch + idle - host_late
    return {
        "forwards": len(spans),
        "busy_share": busy / wall if wall > 0 else 1.0,
        "late_share": late / wall if wall > 0 else 0.0,
        "launch_share": launch / wall if wall > 0 else 0.0,
        "images_per_forward": sum(s.images for s in spans) / len(spans),
    }


class SimTower(VisionTower):
    """Rows: token ``i`` of an image is its ``i``-th patch's mean grey level (0-1) in every column."""

    packable = True

    def __init__(self, spec: SimSpec, *, name: str = "sim") -> None:
        self.spec, self.name = spec, name
        self.model = torch.nn.Module()
        self.hidden_size = spec.hidden
        self.dtype = torch.float32
        self.device = torch.device("cpu")
        self.sim = SimDevice(spec)

    @property
    def runtime(self) -> SimDevice:
        return self.sim

    def layout(self, width: int, height: int) -> TokenLayout:
        scale = min(1.0, self.spec.max_side / max(width, height))
        grid = (
            1,
            max(1, math.ceil(height * scale / self.spec.patch)),
            max(1, math.ceil(width * scale / self.spec.patch)),
        )
        return TokenLayout(grid[1] * grid[2], grid, grid)

    def preprocess(self, image: Image.Image) -> Prepared:
        lay = self.layout(*image.size)
        _, h, w = lay.grid_thw
        grey = np.asarray(image.convert("L").resize((w, h), Image.Resampling.BOX), dtype=np.float32) / 255.0
        return Prepared(grey.reshape(-1), lay)

    def forward(self, batch: Sequence[Prepared]) -> list[torch.Tensor]:
        launched = time.monotonic()
        if self.forward_bytes([p.layout for p in batch]) > self.sim.memory_bytes(1.0):
            raise torch.OutOfMemoryError(f"simulated device: a forward of {len(batch)} images does not fit")
        copied = self.sim.host_bytes_copied
        values = [self.to_device(torch.as_tensor(p.pixels)) for p in batch]
        host_s = self.spec.launch_ms / 1000 + (self.sim.host_bytes_copied - copied) * self.spec.copy_ns_per_byte / 1e9
        spin_until = time.perf_counter() + host_s
        while time.perf_counter() < spin_until:  # the launch and its host copies: Python, the GIL held
            pass
        outputs = [torch.empty(p.layout.num_tokens, self.hidden_size) for p in batch]

        def fill() -> None:
            for out, v in zip(outputs, values):
                out.copy_(v[:, None].expand_as(out))

        tokens = sum(p.layout.num_tokens for p in batch)
        self.sim.queue(launched, tokens * self.spec.token_us / 1e6, len(batch), tokens, fill)
        if self.spec.sync:
            self.sim.synchronize()
        return outputs

    def input_tokens(self, layout: TokenLayout) -> int:
        return layout.num_tokens

    def input_bytes_per_token(self) -> int:
        return 3 * self.spec.patch**2 * 4  # staged as a real tower's float patch: the prefetch bound's unit

    def fingerprint_fields(self) -> dict[str, Any]:
        return {"sim": {k: v for k, v in asdict(self.spec).items() if k != "timeline"}}


def load(spec: str) -> SimTower:
    parsed = SimSpec.parse(spec)
    pairs = [f"{k}={v}" for k, v in asdict(parsed).items() if k != "timeline"]
    return SimTower(parsed, name=PREFIX + ",".join(pairs))
