"""The in-process index of an app from ``tests.support.api.running_app``, by image hash: how many
callers each entry is pinned for, and its rank in the recency order (0: evicted first)."""

from __future__ import annotations

import httpx

from visenc.index.memory import MemoryCache
from visenc_client.format import entry_key


class L1:
    def __init__(self, client: httpx.AsyncClient, *, bimodal: bool = True) -> None:
        engine = client.app.state.engine  # type: ignore[attr-defined]
        self.cache: MemoryCache = engine.index.local
        self.fingerprint = engine.fingerprint
        if bimodal:  # a new entry goes in at the evicted-first end: a read that moved it would show
            self.cache.psel = -1

    def key(self, h: str) -> str:
        return entry_key("default", self.fingerprint, h)

    def pins(self, h: str) -> int:
        return self.cache.pins(self.key(h))

    def rank(self, h: str) -> int | None:
        return self.cache.rank(self.key(h))

    @property
    def top(self) -> int:
        """The most recently used rank (where a look-up moves an entry)."""
        return len(self.cache) - 1
