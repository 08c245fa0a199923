"""Fault injection, for tests and failure drills only: off by default, never for production.

Settings ``fault_*`` (see ``visenc/config.py``) wrap the tower and the index in
the classes below; with every rate and delay at zero nothing is wrapped and the
service runs the real parts untouched. What each fault stands for:

``fault_forward_fail_rate``
    the forward raises ``InjectedFault`` (a device error): only that batch's
    images fail, the worker lives on.
``fault_forward_delay_s``
    every forward sleeps first (a slow device, or a stalled one when the delay
    is past ``stall_timeout_s``); it sleeps on the device thread, as a hung
    kernel would block it.
``fault_index_delay_s``
    every index round trip (``get_many``, ``write_remote``) is slowed (a slow
    Redis); the in-process ``peek`` / ``store_local`` stay synchronous.
``fault_index_corrupt_rate``
    an entry read by ``get_many`` comes back truncated (a damaged value); the
    encoder's integrity check must treat it as a miss and never serve it.

Random choices come from one ``random.Random(fault_seed)`` per wrapper, so a
drill is reproducible.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from PIL import Image

from visenc.config import Settings
from visenc.index.base import Index
from visenc.index.format import Entry
from visenc.models.base import Prepared, TokenLayout, VisionTower

log = logging.getLogger(__name__)


class InjectedFault(RuntimeError):
    """Raised by an injected forward failure."""


class FaultyTower(VisionTower):
    """A tower whose ``forward`` may fail or stall; everything else (and the fingerprint) is the inner one's."""

    def __init__(self, inner: VisionTower, *, fail_rate: float, delay_s: float, seed: int) -> None:
        self.inner = inner
        self.name = inner.name
        self.hidden_size = inner.hidden_size
        self.dtype = inner.dtype
        self.device = inner.device
        self.packable = inner.packable
        self.fail_rate = fail_rate
        self.delay_s = delay_s
        self._random = random.Random(seed)
        self._lock = threading.Lock()  # the device thread is one thread, but keep the RNG safe anyway

    def layout(self, width: int, height: int) -> TokenLayout:
        return self.inner.layout(width, height)

    def preprocess(self, image: Image.Image) -> Prepared:
        return self.inner.preprocess(image)

    def forward(self, batch: Sequence[Prepared]) -> list[torch.Tensor]:
        if self.delay_s:
            time.sleep(self.delay_s)  # device thread: a stalled device blocks it just like this
        with self._lock:
            fail = self._random.random() < self.fail_rate
        if fail:
            raise InjectedFault(f"injected forward failure ({len(batch)} images)")
        return self.inner.forward(batch)

    def fingerprint_fields(self) -> dict[str, Any]:
        return self.inner.fingerprint_fields()

    def input_tokens(self, layout: TokenLayout) -> int:
        return self.inner.input_tokens(layout)

    def activation_bytes_per_token(self) -> int:
        return self.inner.activation_bytes_per_token()

    @property
    def fingerprint(self) -> str:
        return self.inner.fingerprint

    def describe(self) -> dict[str, Any]:
        return self.inner.describe()


class FaultyIndex(Index):
    """An index whose round trips are slow and whose reads may come back damaged."""

    def __init__(self, inner: Index, *, delay_s: float, corrupt_rate: float, seed: int) -> None:
        self.inner = inner
        self.tier = inner.tier
        self.delay_s = delay_s
        self.corrupt_rate = corrupt_rate
        self._random = random.Random(seed)

    async def get_many(self, keys: Sequence[str]) -> list[Entry | None]:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        found = await self.inner.get_many(keys)
        return [self._damage(e) if e is not None and self._random.random() < self.corrupt_rate else e
                for e in found]

    @staticmethod
    def _damage(entry: Entry) -> Entry:
        # a copy, truncated by one row's worth of bytes: the stored original stays intact
        return dataclasses.replace(entry, blob=bytes(entry.blob[: max(0, len(entry.blob) - entry.row_bytes - 1)]))

    def peek(self, key: str) -> Entry | None:
        return self.inner.peek(key)

    def store_local(self, key: str, entry: Entry) -> None:
        self.inner.store_local(key, entry)

    def discard_local(self, key: str) -> None:
        self.inner.discard_local(key)

    async def write_remote(self, key: str, entry: Entry) -> None:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        await self.inner.write_remote(key, entry)

    async def close(self) -> None:
        await self.inner.close()

    def health(self) -> dict[str, object]:
        return self.inner.health()


def with_faults(settings: Settings, tower: VisionTower, index: Index) -> tuple[VisionTower, Index]:
    """The tower and index, wrapped only where a fault setting is on (a warning is logged then)."""
    if settings.fault_forward_fail_rate or settings.fault_forward_delay_s:
        log.warning("FAULT INJECTION ON (test only): forward fail_rate=%s delay_s=%s",
                    settings.fault_forward_fail_rate, settings.fault_forward_delay_s)
        tower = FaultyTower(tower, fail_rate=settings.fault_forward_fail_rate,
                            delay_s=settings.fault_forward_delay_s, seed=settings.fault_seed)
    if settings.fault_index_delay_s or settings.fault_index_corrupt_rate:
        log.warning("FAULT INJECTION ON (test only): index delay_s=%s corrupt_rate=%s",
                    settings.fault_index_delay_s, settings.fault_index_corrupt_rate)
        index = FaultyIndex(index, delay_s=settings.fault_index_delay_s,
                            corrupt_rate=settings.fault_index_corrupt_rate, seed=settings.fault_seed)
    return tower, index
