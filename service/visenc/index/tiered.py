"""The index the engine uses: the in-process LRU (L1), optionally in front of the shared Redis store (L2)."""

from __future__ import annotations

from collections.abc import Sequence

from visenc.index.memory import Lease, MemoryCache
from visenc.index.redis_store import RedisStore
from visenc_client.format import Entry


class Index:
    def __init__(self, local: MemoryCache, remote: RedisStore | None = None, *, batch_keys: int = 64) -> None:
        self.local = local
        self.remote = remote
        self.batch_keys = batch_keys

    def batch_by(self, entry_bytes: int, batch_bytes: int) -> None:
        self.batch_keys = max(1, batch_bytes // max(1, entry_bytes))

    def peek(self, key: str) -> Entry | None:
        return self.local.peek(key)

    async def get_many(self, keys: Sequence[str]) -> list[Entry | None]:
        found = self.local.lookup(keys)
        misses = [i for i, e in enumerate(found) if e is None]
        if self.remote is None:
            return found
        for lo in range(0, len(misses), self.batch_keys):
            batch = misses[lo : lo + self.batch_keys]
            for i, entry in zip(batch, await self.remote.get_many([keys[i] for i in batch])):
                if entry is not None:
                    # promote, unless L1 got an entry meanwhile (keep the one already shared)
                    current = self.local.peek(keys[i])
                    if current is None:
                        self.local.store(keys[i], entry)
                    found[i] = current or entry
        return found

    def store_local(self, key: str, entry: Entry, *, pins: int = 0, leases: Sequence[Lease] = ()) -> bool:
        return self.local.store(key, entry, pins=pins, leases=leases)

    def pin(self, key: str, lease: Lease | None = None) -> bool:
        """A caller was told ``key`` is ready: keep it in L1 until it reads it; ``False`` when L1 lacks it."""
        return self.local.pin(key, 1 if lease is None else lease)

    def read(self, key: str, lease: str | None, *, last: bool) -> None:
        self.local.read(key, lease, last=last)

    def unpin(self, key: str, lease: str | None = None) -> None:
        self.local.unpin(key, lease)

    def discard(self, key: str) -> None:
        self.local.discard(key)

    async def write_through(self, key: str, entry: Entry) -> None:
        """Write to the shared store, if there is one (atomic; counted, never raised, on failure)."""
        if self.remote is not None:
            await self.remote.put(key, entry)

    def absence(self, key: str) -> str:
        """Why no tier holds ``key``, as far as this replica can tell (a 404's message)."""
        gone = self.local.gone(key)
        if gone is None:
            if self.remote is None:
                return "never encoded here, nor evicted lately"
            return "not in the shared index: never encoded, or evicted from Redis"
        shared = "" if self.remote is None else ", and Redis no longer holds it"
        return f"{gone}{shared}; encode it again with its bytes"

    async def close(self) -> None:
        if self.remote is not None:
            await self.remote.conn.close()

    def health(self) -> dict[str, object]:
        memory = self.local.health()
        if self.remote is None:
            return memory
        return {"tier": "tiered", "ok": self.remote.conn.up, "memory": memory, "redis": self.remote.conn.health()}
