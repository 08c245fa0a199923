"""The interface every embedding index implements (in-process LRU, Redis, tiers)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from visenc.index.format import Entry


class Index(ABC):
    #: label used in metrics (``tier``)
    tier: str

    @abstractmethod
    async def get_many(self, keys: Sequence[str]) -> list[Entry | None]:
        """Look up several keys in one round trip; ``None`` for a miss.

        Never raises for a backend outage: an unreachable tier answers misses
        (and counts the error), so the service keeps encoding."""

    @abstractmethod
    def peek(self, key: str) -> Entry | None:
        """Synchronous lookup of the in-process tier only (no I/O)."""

    @abstractmethod
    def store_local(self, key: str, entry: Entry) -> None:
        """Synchronous store into the in-process tier (visible to ``peek`` at once)."""

    def discard_local(self, key: str) -> None:  # noqa: B027 - tiers without local state keep nothing
        """Drop a key from the in-process tier (an entry that failed its integrity check)."""

    async def write_remote(self, key: str, entry: Entry) -> None:  # noqa: B027 - no remote tier
        """Write through to the shared tiers (no-op without one); failures are counted, not raised."""

    async def put(self, key: str, entry: Entry) -> None:
        """Store an entry in every tier; each write is atomic (a reader sees all of it or none)."""
        self.store_local(key, entry)
        await self.write_remote(key, entry)

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""

    def health(self) -> dict[str, object]:
        return {"tier": self.tier, "ok": True}
