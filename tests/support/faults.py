"""Fault injection for tests: wrappers of the real engine parts (nothing of it ships in the service)."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from PIL import Image

from visenc.index.tiered import Index
from visenc.models.base import Prepared, TokenLayout, VisionTower
from visenc_client.format import Entry


class InjectedFault(RuntimeError):
    """Raised by an injected forward failure."""


class FaultyTower(VisionTower):
    """A tower whose ``forward`` may fail or stall; everything else (and the fingerprint) is the inner one's."""

    def __init__(
        self,
        inner: VisionTower,
        *,
        fail_rate: float = 0.0,
        fail_first: int = 0,
        delay_s: float = 0.0,
        delay_first: int | None = None,
        output_delay_s: float = 0.0,
        oom_above_tokens: int | None = None,
        warm_up_delay_s: float = 0.0,
        warm_up_gate: threading.Event | None = None,
        seed: int = 0,
    ) -> None:
        self.inner = inner
        self.name = inner.name
        self.hidden_size = inner.hidden_size
        self.dtype = inner.dtype
        self.device = inner.device
        self.packable = inner.packable
        self.image_loader = inner.image_loader
        self.fail_rate = fail_rate
        self.fail_first = fail_first
        self.delay_s = delay_s
        self.delay_first = delay_first
        self.output_delay_s = output_delay_s
        #: a forward of more input tokens than this raises an out-of-memory error (as a full device would)
        self.oom_above_tokens = oom_above_tokens
        #: the warm-up holds dynamo's compile lock this long, or until the gate opens, then builds the
        #: inner tower's graphs (a long compile); ``warming`` is set once it holds the lock
        self.warm_up_delay_s = warm_up_delay_s
        self.warm_up_gate = warm_up_gate
        self.warming = threading.Event()
        self.forwards = 0
        self.batch_sizes: list[int] = []
        self._random = random.Random(seed)
        self._lock = threading.Lock()

    def layout(self, width: int, height: int) -> TokenLayout:
        return self.inner.layout(width, height)

    def preprocess(self, image: Image.Image) -> Prepared:
        return self.inner.preprocess(image)

    def forward(self, batch: Sequence[Prepared]) -> list[torch.Tensor]:
        with self._lock:
            self.forwards += 1
            self.batch_sizes.append(len(batch))
            n = self.forwards
            fail = n <= self.fail_first or self._random.random() < self.fail_rate
        tokens = sum(self.inner.input_tokens(p.layout) for p in batch)
        if self.oom_above_tokens is not None and tokens > self.oom_above_tokens:
            raise torch.OutOfMemoryError(f"injected: {tokens} tokens do not fit (limit {self.oom_above_tokens})")
        if self.delay_s and (self.delay_first is None or n <= self.delay_first):
            time.sleep(self.delay_s)  # device thread: a stalled device blocks it just like this
        if fail:
            raise InjectedFault(f"injected forward failure ({len(batch)} images)")
        out = self.inner.forward(batch)
        if self.output_delay_s:  # outputs that are slow to copy out (read on the output thread)
            return [_SlowToCopy.wrap(t, self.output_delay_s) for t in out]
        return out

    def warm_up(self) -> None:
        if not self.warm_up_delay_s and self.warm_up_gate is None:
            self.inner.warm_up()
            return
        from torch._dynamo.convert_frame import compile_lock

        with compile_lock:
            self.warming.set()
            if self.warm_up_gate is not None:
                self.warm_up_gate.wait()
            else:
                time.sleep(self.warm_up_delay_s)
            self.inner.warm_up()  # the compile's end: its graphs are built

    # compiling is the inner tower's: its blocks, its status
    def compile(self) -> int:
        return self.inner.compile()

    @property  # type: ignore[override]
    def compiled_blocks(self) -> int:
        return self.inner.compiled_blocks

    @property  # type: ignore[override]
    def compilation(self) -> Any:
        return self.inner.compilation

    def compiled_ready(self, graphs: int) -> None:
        self.inner.compiled_ready(graphs)

    def run_eagerly(self, status: Any) -> None:
        self.inner.run_eagerly(status)

    def fingerprint_fields(self) -> dict[str, Any]:
        return self.inner.fingerprint_fields()

    def input_tokens(self, layout: TokenLayout) -> int:
        return self.inner.input_tokens(layout)

    def input_bytes_per_token(self) -> int:
        return self.inner.input_bytes_per_token()

    def activation_bytes_per_token(self) -> int:
        return self.inner.activation_bytes_per_token()

    def forward_bytes(self, layouts: Sequence[TokenLayout]) -> int:
        return self.inner.forward_bytes(layouts)

    @property
    def fingerprint(self) -> str:
        return self.inner.fingerprint

    def describe(self) -> dict[str, Any]:
        return self.inner.describe()


class _SlowToCopy(torch.Tensor):
    """A tensor whose ``contiguous()`` (the outputs stage's host copy on CPU) takes ``delay_s``."""

    delay_s: float

    @staticmethod
    def wrap(t: torch.Tensor, delay_s: float) -> torch.Tensor:
        out = t.as_subclass(_SlowToCopy)
        out.delay_s = delay_s
        return out

    def contiguous(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        time.sleep(self.delay_s)
        return super().contiguous(*args, **kwargs).as_subclass(torch.Tensor)


class FaultyIndex(Index):
    """The real index, with slow round trips and (a share of) reads truncated on the way out."""

    def __init__(self, inner: Index, *, delay_s: float = 0.0, corrupt_rate: float = 0.0, seed: int = 0) -> None:
        super().__init__(inner.local, inner.remote)
        self.delay_s = delay_s
        self.corrupt_rate = corrupt_rate
        self._random = random.Random(seed)

    async def get_many(self, keys: Sequence[str]) -> list[Entry | None]:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        found = await super().get_many(keys)
        return [self._damage(e) if e is not None and self._random.random() < self.corrupt_rate else e for e in found]

    @staticmethod
    def _damage(entry: Entry) -> Entry:
        # a copy, truncated by one row's worth of bytes: the stored original stays intact
        return dataclasses.replace(entry, blob=bytes(entry.blob[: max(0, len(entry.blob) - entry.row_bytes - 1)]))

    async def write_through(self, key: str, entry: Entry) -> None:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        await super().write_through(key, entry)


def faulty_index(**faults: Any):
    """An ``index`` builder for ``create_app``: the real index and claims, the index wrapped."""
    from visenc.bootstrap import build_index

    def build(settings, metrics):
        index, claims = build_index(settings, metrics)
        return FaultyIndex(index, **faults), claims

    return build
