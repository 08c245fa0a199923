"""The in-process LRU (L1) in front of the shared Redis tier (L2).

* ``get_many``: L1 first (no I/O), then *one* Redis round trip for all of the
  L1 misses together; an L2 hit is promoted into L1, so the next lookup of the
  image on this replica costs no I/O.
* ``store_local``: L1 only (synchronous; ``peek`` sees it at once).
* ``write_remote``: one atomic Redis ``SET ... EX``; a failure is counted, never
  raised (the entry still lives in L1).
* ``health``: ``ok`` is false while Redis is skipped after a failure: the
  service still answers from L1 and by encoding (``/readyz`` says degraded).
"""

from __future__ import annotations

from collections.abc import Sequence

from visenc.index.base import Index
from visenc.index.format import Entry
from visenc.index.memory import MemoryIndex
from visenc.index.redis import RedisIndex


class TieredIndex(Index):
    tier = "tiered"

    def __init__(self, local: MemoryIndex, remote: RedisIndex) -> None:
        self.local = local
        self.remote = remote

    async def get_many(self, keys: Sequence[str]) -> list[Entry | None]:
        found = self.local.lookup(keys)
        misses = [i for i, e in enumerate(found) if e is None]
        if misses:
            for i, entry in zip(misses, await self.remote.get_many([keys[i] for i in misses])):
                if entry is not None:
                    # promote, unless L1 got an entry meanwhile (keep the one already shared)
                    current = self.local.peek(keys[i])
                    if current is None:
                        self.local.store(keys[i], entry)
                    found[i] = current or entry
        return found

    def peek(self, key: str) -> Entry | None:
        return self.local.peek(key)

    def store_local(self, key: str, entry: Entry) -> None:
        self.local.store(key, entry)

    def discard_local(self, key: str) -> None:
        self.local.discard_local(key)

    async def write_remote(self, key: str, entry: Entry) -> None:
        await self.remote.write_remote(key, entry)

    async def close(self) -> None:
        await self.remote.close()

    def health(self) -> dict[str, object]:
        return {"tier": self.tier, "ok": self.remote.up, "memory": self.local.health(),
                "redis": self.remote.health()}
