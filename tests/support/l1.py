"""The in-process index of an app from ``tests.support.api.running_app``, by image hash: how many
callers each entry is pinned for, and its rank in the recency order (0: evicted first)."""

from __future__ import annotations

import httpx

from visenc.index.memory import Lease, MemoryCache
from visenc_client.format import Entry, entry_key


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


def cyclic_hits(cache: MemoryCache, entry: Entry, *, pinned: bool) -> float:
    """The hit rate of ten passes over 30 keys through ``cache`` (sized for 20 ``entry``), the first
    pass warm-up, as the service runs one: look up; on a miss store (pinned for the caller when
    ``pinned``); then read (releasing the pin)."""
    keys = [f"k{i}" for i in range(30)]
    hits = 0
    for rnd in range(10):
        for k in keys:
            hit = cache.lookup([k])[0] is not None
            hits += hit and rnd > 0
            lease = Lease.new()
            if hit:
                cache.pin(k, lease)
            else:
                cache.store(k, entry, leases=[lease] if pinned else [])
            cache.read(k, lease.id, last=True)
    return hits / (9 * len(keys))
