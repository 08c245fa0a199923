"""The index the engine uses: the in-process LRU (L1), optionally in front of
the shared Redis store (L2). One class, one interface, whatever is configured.

* ``peek``: L1 only, synchronous, no I/O.
* ``get_many``: L1 first, then *one* Redis round trip for all of the L1 misses
  together; an L2 hit is promoted into L1, so the next lookup of the image on
  this replica costs no I/O.
* ``store_local``: L1 only (synchronous; ``peek`` sees it at once), pinned for the callers that
  will read it; ``pin`` / ``unpin``: an entry answered ready is kept until read (``memory.py``).
* ``write_through``: one atomic Redis ``SET ... EX`` when there is a shared
  store; a failure is counted, never raised (the entry still lives in L1).
* ``health``: ``ok`` is false while Redis is skipped after a failure: the
  service still answers from L1 and by encoding (``/readyz`` says degraded).

Entries are not checked here: the engine checks every entry it reads against
its header and key (``engine/intake.py``) and ``discard``s a corrupt one.
"""

from __future__ import annotations

from collections.abc import Sequence

from visenc.index.memory import MemoryCache
from visenc.index.redis_store import RedisStore
from visenc_client.format import Entry


class Index:
    def __init__(self, local: MemoryCache, remote: RedisStore | None = None) -> None:
        self.local = local
        self.remote = remote

    def peek(self, key: str) -> Entry | None:
        return self.local.get(key)

    async def get_many(self, keys: Sequence[str]) -> list[Entry | None]:
        found = self.local.lookup(keys)
        misses = [i for i, e in enumerate(found) if e is None]
        if misses and self.remote is not None:
            for i, entry in zip(misses, await self.remote.get_many([keys[i] for i in misses])):
                if entry is not None:
                    # promote, unless L1 got an entry meanwhile (keep the one already shared)
                    current = self.local.get(keys[i])
                    if current is None:
                        self.local.store(keys[i], entry)
                    found[i] = current or entry
        return found

    def store_local(self, key: str, entry: Entry, *, pins: int = 0) -> None:
        self.local.store(key, entry, pins=pins)

    def pin(self, key: str) -> None:
        """A caller was told ``key`` is ready: keep it in L1 until it reads it (or the lease ends)."""
        self.local.pin(key)

    def unpin(self, key: str) -> None:
        """A caller has read ``key``'s rows."""
        self.local.unpin(key)

    def discard(self, key: str) -> None:
        """Drop a key from L1 (an entry that failed its integrity check)."""
        self.local.discard(key)

    async def write_through(self, key: str, entry: Entry) -> None:
        """Write to the shared store, if there is one (atomic; counted, never raised, on failure)."""
        if self.remote is not None:
            await self.remote.put(key, entry)

    async def close(self) -> None:
        if self.remote is not None:
            await self.remote.conn.close()

    def health(self) -> dict[str, object]:
        memory = self.local.health()
        if self.remote is None:
            return memory
        return {"tier": "tiered", "ok": self.remote.conn.up, "memory": memory, "redis": self.remote.conn.health()}
