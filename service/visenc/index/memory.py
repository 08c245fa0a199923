"""In-process, byte-budgeted cache: the L1 tier and the embedded default index.

**Eviction: LRU with a dynamic insertion policy** (DIP; Qureshi et al., "Adaptive Insertion
Policies for High Performance Caching", ISCA 2007). Entries leave from the least recently used
end until the bytes held fit ``max_bytes``. A new entry goes in at the most recently used end
(LRU), or, while the bimodal policy (BIP) wins, at the least recently used end, except one in
``BIMODAL_EVERY``. Two shadow directories of keys and sizes (no rows) run LRU and BIP on the same
look-ups, and a saturating counter (``psel``) follows whichever hit more lately. Agent workloads,
where recent screenshots come back, keep LRU's hit rate; a cyclic pass over more than the cache,
where LRU evicts every entry before its reuse, keeps most of the cache resident under BIP
(``bench/bench_eviction.py``: 0 and about 0.66 hits on a pass over 1.5x the cache).

**Pins.** An entry answered ``ready`` stays until its callers have read it (``unpin``, one per
pin) or ``pin_lease_s`` ends, whatever the budget: unpinned entries are evicted first, and the
cache holds more than ``max_bytes`` only while pinned entries alone do, up to ``PIN_LIMIT *
max_bytes``; past that the oldest pins are cut (``visenc_cache_pins_cut``). A released entry was
just read: it goes back in at the most recently used end (one whose lease lapsed, at the least).

An entry larger than the whole budget is not stored. Bytes are those of the stored value
(``Entry.nbytes``). Entries are immutable and shared by reference: serving one hands out views of
its buffer, never copies. Only the event loop thread touches it: no lock.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from visenc.metrics import Metrics
from visenc_client.format import Entry

#: under BIP, one new entry in this many still goes in at the recently used end
BIMODAL_EVERY = 32
#: the policy counter saturates at plus or minus this many look-ups that one shadow hit and the other missed
PSEL_MAX = 64
#: pinned entries may hold up to this many times the budget (then the oldest pins are cut)
PIN_LIMIT = 2


class Shadow:
    """Keys and sizes of a cache of ``max_bytes`` under LRU or bimodal insertion (no rows)."""

    def __init__(self, max_bytes: int, *, bimodal: bool) -> None:
        self.max_bytes = max_bytes
        self.bimodal = bimodal
        self.bytes = 0
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self._inserted = 0

    def __contains__(self, key: str) -> bool:
        return key in self._sizes

    def access(self, key: str, nbytes: int) -> bool:
        """A look-up of ``key`` (``nbytes`` when stored): whether it hit; a miss stores it."""
        if key in self._sizes:
            self._sizes.move_to_end(key)
            return True
        if nbytes <= self.max_bytes:
            self._sizes[key] = nbytes
            self.bytes += nbytes
            self._inserted += 1
            if self.bimodal and self._inserted % BIMODAL_EVERY:
                self._sizes.move_to_end(key, last=False)
            while self.bytes > self.max_bytes:
                self.bytes -= self._sizes.popitem(last=False)[1]
        return False


@dataclass(slots=True)
class _Pin:
    count: int
    until: float


class MemoryCache:
    tier = "memory"

    def __init__(
        self,
        max_bytes: int,
        metrics: Metrics,
        *,
        pin_lease_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_bytes = max_bytes
        self.pin_lease_s = pin_lease_s
        self.bytes = 0
        self.pinned_bytes = 0
        self._entries: OrderedDict[str, Entry] = OrderedDict()  # evictable, least recently used first
        self._pinned: dict[str, Entry] = {}
        self._pins: OrderedDict[str, _Pin] = OrderedDict()  # by lease end
        self._lru = Shadow(max_bytes, bimodal=False)
        self._bip = Shadow(max_bytes, bimodal=True)
        self._sizes: dict[str, int] = {}  # what the shadows store for a key (the size it was stored with)
        self.psel = 0
        self._inserted = 0
        self._metrics = metrics
        self._clock = clock

    def __len__(self) -> int:
        return len(self._entries) + len(self._pinned)

    def __contains__(self, key: str) -> bool:
        return key in self._entries or key in self._pinned

    @property
    def bimodal(self) -> bool:
        """Whether new entries go in at the least recently used end (BIP won lately)."""
        return self.psel < 0

    def get(self, key: str) -> Entry | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            return entry
        return self._pinned.get(key)

    def lookup(self, keys: Sequence[str]) -> list[Entry | None]:
        """``get`` for each key, counted as look-ups (the shadows learn from them)."""
        found = [self.get(k) for k in keys]
        for key in keys:
            self._duel(key)
        hits = sum(e is not None for e in found)
        self._metrics.cache_lookups.labels(self.tier, "hit").inc(hits)
        self._metrics.cache_lookups.labels(self.tier, "miss").inc(len(found) - hits)
        return found

    def _duel(self, key: str) -> None:
        nbytes = self._sizes.get(key)
        if nbytes is None:
            return  # never stored: both shadows miss it alike
        by_lru, by_bip = self._lru.access(key, nbytes), self._bip.access(key, nbytes)
        if by_lru != by_bip:
            self.psel = max(-PSEL_MAX, min(PSEL_MAX, self.psel + (1 if by_lru else -1)))

    def store(self, key: str, entry: Entry, *, pins: int = 0) -> None:
        """Hold ``entry`` under ``key`` (in place of any older one); ``pins``: callers that will read it."""
        if entry.nbytes > self.max_bytes:
            return
        if key not in self._sizes:
            self._lru.access(key, entry.nbytes)
            self._bip.access(key, entry.nbytes)
            if len(self._sizes) > 8 * max(64, len(self)):  # forget sizes the shadows no longer hold
                self._sizes = {k: n for k, n in self._sizes.items() if k in self._lru or k in self._bip}
        self._sizes[key] = entry.nbytes
        self._drop(key)
        self._entries[key] = entry
        self.bytes += entry.nbytes
        self._inserted += 1
        if self.bimodal and self._inserted % BIMODAL_EVERY:
            self._entries.move_to_end(key, last=False)
        if pins:
            self.pin(key, pins)
        self._evict()

    def pin(self, key: str, count: int = 1) -> None:
        """``count`` more callers will read ``key``: keep it until they ``unpin`` it or the lease ends."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._pinned[key] = entry
            self.pinned_bytes += entry.nbytes
        elif key not in self._pinned:
            return
        pin = self._pins.pop(key, None) or _Pin(0, 0.0)
        pin.count += count
        pin.until = self._clock() + self.pin_lease_s
        self._pins[key] = pin
        self._evict()

    def unpin(self, key: str) -> None:
        """One caller has read ``key``."""
        pin = self._pins.get(key)
        if pin is not None:
            pin.count -= 1
            if pin.count <= 0:
                self._unpin(key)
                self._evict()

    def _unpin(self, key: str, *, read: bool = True) -> None:
        """Back among the evictable entries: most recently used when just read, least when its lease lapsed."""
        del self._pins[key]
        entry = self._pinned.pop(key)
        self.pinned_bytes -= entry.nbytes
        self._entries[key] = entry
        if not read:
            self._entries.move_to_end(key, last=False)

    def _drop(self, key: str) -> None:
        if key in self._pins:
            self._unpin(key)
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old.nbytes

    def _evict(self) -> None:
        now, cut = self._clock(), 0
        while self._pins:  # leases end in the order they were given
            key, pin = next(iter(self._pins.items()))
            if pin.until > now and self.pinned_bytes <= PIN_LIMIT * self.max_bytes:
                break
            cut += pin.until > now
            self._unpin(key, read=False)
        evicted = 0
        while self.bytes > self.max_bytes and self._entries:
            self.bytes -= self._entries.popitem(last=False)[1].nbytes
            evicted += 1
        if evicted:
            self._metrics.cache_evictions.labels(self.tier).inc(evicted)
        if cut:
            self._metrics.cache_pins_cut.inc(cut)
        self._report()

    def discard(self, key: str) -> None:
        self._drop(key)
        self._report()

    def _report(self) -> None:
        self._metrics.cache_bytes.labels(self.tier).set(self.bytes)
        self._metrics.cache_entries.labels(self.tier).set(len(self))
        self._metrics.cache_pinned_bytes.set(self.pinned_bytes)

    def health(self) -> dict[str, object]:
        return {
            "tier": self.tier,
            "ok": True,
            "entries": len(self),
            "bytes": self.bytes,
            "max_bytes": self.max_bytes,
            "pinned_bytes": self.pinned_bytes,
            "insertion": "bimodal" if self.bimodal else "lru",
        }
