"""In-process, byte-budgeted LRU: the L1 tier and the embedded default index.

Eviction policy: least recently *used* (a hit or a put refreshes an entry)
until the bytes held fit ``max_bytes``. An entry larger than the whole budget
is not stored. Bytes are those of the stored value (``Entry.nbytes``), so the
budget bounds real memory. Entries are immutable and shared by reference:
serving one hands out views of its buffer, never copies.

All operations are synchronous and O(1); it is only ever touched from the
event loop thread, so it needs no lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from visenc.metrics import Metrics
from visenc_client.format import Entry


class MemoryLRU:
    tier = "memory"

    def __init__(self, max_bytes: int, metrics: Metrics | None = None) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._metrics = metrics

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> Entry | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def lookup(self, keys: Sequence[str]) -> list[Entry | None]:
        found = [self.get(k) for k in keys]
        if self._metrics is not None:
            hits = sum(e is not None for e in found)
            self._metrics.cache_lookups.labels(self.tier, "hit").inc(hits)
            self._metrics.cache_lookups.labels(self.tier, "miss").inc(len(found) - hits)
        return found

    def store(self, key: str, entry: Entry) -> None:
        if entry.nbytes > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old.nbytes
        self._entries[key] = entry
        self.bytes += entry.nbytes
        evicted = 0
        while self.bytes > self.max_bytes:
            _, victim = self._entries.popitem(last=False)
            self.bytes -= victim.nbytes
            evicted += 1
        if self._metrics is not None and evicted:
            self._metrics.cache_evictions.labels(self.tier).inc(evicted)
        self._report()

    def discard(self, key: str) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old.nbytes
            self._report()

    def _report(self) -> None:
        if self._metrics is not None:
            self._metrics.cache_bytes.labels(self.tier).set(self.bytes)
            self._metrics.cache_entries.labels(self.tier).set(len(self._entries))

    def health(self) -> dict[str, object]:
        return {
            "tier": self.tier,
            "ok": True,
            "entries": len(self._entries),
            "bytes": self.bytes,
            "max_bytes": self.max_bytes,
        }
