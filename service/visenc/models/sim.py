"""A simulated device, to time the engine's loop without one: ``--model sim:`` or ``sim:KEY=VALUE,...``."""

from __future__ import annotations

import collections
import itertools
import json
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np
import torch
from PIL import Image

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


class SimEvent:
    def __init__(self, device: SimDevice, seq: int) -> None:
        self._device, self._seq = device, seq

    def synchronize(self) -> None:
        self._device.wait_for(self._seq)

    def query(self) -> bool:
        return self._device.done(self._seq)


class SimDevice:
    """The simulated stream: work runs in queue order, each item after the one before it ends."""

    def __init__(self, timeline: str | None = None) -> None:
        self._work: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._completing = threading.Lock()
        self._pending: collections.deque[tuple[int, Span, Callable[[], None]]] = collections.deque()
        self._ends: dict[int, float] = {}
        self._queued_seq = 0
        self._free_at = 0.0
        self.spans: list[Span] = []
        self._timeline = open(timeline, "a", buffering=1) if timeline else None
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

    def event(self) -> SimEvent:
        with self._lock:
            return SimEvent(self, self._queued_seq)

    def synchronize(self) -> None:
        self.event().synchronize()

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
        self.sim = SimDevice(spec.timeline)

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
        spin_until = time.perf_counter() + self.spec.launch_ms / 1000
        while time.perf_counter() < spin_until:  # the launch: Python, the GIL held
            pass
        outputs = [torch.empty(p.layout.num_tokens, self.hidden_size) for p in batch]
        values = [torch.from_numpy(np.asarray(p.pixels, dtype=np.float32)) for p in batch]

        def fill() -> None:
            for out, v in zip(outputs, values):
                out.copy_(v[:, None].expand_as(out))

        tokens = sum(p.layout.num_tokens for p in batch)
        self.sim.queue(launched, tokens * self.spec.token_us / 1e6, len(batch), tokens, fill)
        event = self.sim.event()
        if self.spec.sync:
            event.synchronize()
        for out in outputs:  # for a caller that knows no ``record_event`` (``bench/_sim_serve.py``)
            setattr(out, "sim_event", event)  # noqa: B010
        return outputs

    def record_event(self) -> SimEvent:
        return self.sim.event()

    def warm_up(self) -> None:
        super().warm_up()
        self.sim.synchronize()

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
