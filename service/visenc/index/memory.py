"""In-process, byte-budgeted cache: the L1 tier and the embedded default index."""

from __future__ import annotations

import secrets
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
#: pinned entries may hold up to this many times the budget when no ``overflow_bytes`` is given
PIN_LIMIT = 2
#: how many keys of entries it let go (evicted, or too large to hold) it remembers, for a 404's message
GONE_KEPT = 65536


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


@dataclass(frozen=True, slots=True)
class Lease:
    """Who a pin is held for: ``id`` per caller's request; ``named``: the caller hands the id back when it reads."""

    id: str
    named: bool = True

    @classmethod
    def new(cls, *, named: bool = True) -> Lease:
        return cls(secrets.token_hex(8), named)


class MemoryCache:
    tier = "memory"

    def __init__(
        self,
        max_bytes: int,
        metrics: Metrics,
        *,
        overflow_bytes: int | None = None,
        pin_lease_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_bytes = max_bytes
        self.overflow_bytes = (PIN_LIMIT - 1) * max_bytes if overflow_bytes is None else overflow_bytes
        self.pin_lease_s = pin_lease_s
        self.bytes = 0
        self.pinned_bytes = 0
        self._order: OrderedDict[str, Entry] = OrderedDict()
        self._pins: dict[str, dict[str, Lease]] = {}
        self._until: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._lru = Shadow(max_bytes, bimodal=False)
        self._bip = Shadow(max_bytes, bimodal=True)
        self._sizes: dict[str, int] = {}
        self.psel = 0
        self._inserted = 0
        self._metrics = metrics
        self._clock = clock
        self._gone: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: str) -> bool:
        return key in self._order

    @property
    def bimodal(self) -> bool:
        """Whether new entries go in at the least recently used end (BIP won lately)."""
        return self.psel < 0

    def pins(self, key: str) -> int:
        return len(self._pins.get(key, ()))

    def rank(self, key: str) -> int | None:
        """``key``'s place in the recency order (0: evicted first), or ``None`` when not held. O(n)."""
        for i, k in enumerate(self._order):
            if k == key:
                return i
        return None

    def peek(self, key: str) -> Entry | None:
        return self._order.get(key)

    def get(self, key: str) -> Entry | None:
        """The entry under ``key``, moved to the most recently used end (the shadows do not learn)."""
        entry = self._order.get(key)
        if entry is not None:
            self._order.move_to_end(key)
        return entry

    def lookup(self, keys: Sequence[str]) -> list[Entry | None]:
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

    def store(self, key: str, entry: Entry, *, pins: int = 0, leases: Sequence[Lease] = ()) -> bool:
        """Hold ``entry`` under ``key`` (in place of any older one, whose pins it keeps), pinned for its readers."""
        if entry.nbytes > self.max_bytes:
            self._let_go(key, f"larger ({entry.nbytes} bytes) than the memory index ({self.max_bytes} bytes)")
            return False
        self._gone.pop(key, None)
        if key not in self._sizes:
            self._lru.access(key, entry.nbytes)
            self._bip.access(key, entry.nbytes)
            if len(self._sizes) > 8 * max(64, len(self)):  # forget sizes the shadows no longer hold
                self._sizes = {k: n for k, n in self._sizes.items() if k in self._lru or k in self._bip}
        self._sizes[key] = entry.nbytes
        old = self._order.pop(key, None)
        if old is not None:
            self.bytes -= old.nbytes
            self.pinned_bytes -= old.nbytes if key in self._pins else 0
        self._order[key] = entry
        self.bytes += entry.nbytes
        self.pinned_bytes += entry.nbytes if key in self._pins else 0
        self._inserted += 1
        if self.bimodal and self._inserted % BIMODAL_EVERY:
            self._order.move_to_end(key, last=False)
        for lease in [*leases, *(Lease.new(named=False) for _ in range(pins))]:
            self._pin(key, lease)
        self._evict()
        return True

    def pin(self, key: str, count: int | Lease = 1) -> bool:
        """Keep ``key`` for a caller that will read it: under ``count`` when it is a ``Lease``, else unnamed pins."""
        if key not in self._order:
            return False
        for lease in [count] if isinstance(count, Lease) else [Lease.new(named=False) for _ in range(count)]:
            self._pin(key, lease)
        self._evict()
        return True

    def _pin(self, key: str, lease: Lease) -> None:
        pins = self._pins.get(key)
        if pins is None:
            pins = self._pins[key] = {}
            self.pinned_bytes += self._order[key].nbytes
        pins[lease.id] = lease
        self._until[(key, lease.id)] = self._clock() + self.pin_lease_s
        self._until.move_to_end((key, lease.id))

    def read(self, key: str, lease: str | None, *, last: bool) -> None:
        pins = self._pins.get(key, {})
        if not lease:
            lease = next((i for i, p in pins.items() if not p.named), None) if lease is None else None
            if lease is None:
                if self.get(key) is not None:  # a reference, not a look-up: it read, it did not ask
                    self._duel(key)
                return
        if lease not in pins:
            return
        if last:
            self._unpin(key, lease)
            self._evict()
        else:
            self._until[(key, lease)] = self._clock() + self.pin_lease_s
            self._until.move_to_end((key, lease))

    def unpin(self, key: str, lease: str | None = None) -> None:
        """Unpin ``key`` once: ``lease``'s pin, or the oldest that names no lease. Moves nothing."""
        pins = self._pins.get(key, {})
        if lease is None:
            lease = next((i for i, p in pins.items() if not p.named), None)
        if lease in pins:
            self._unpin(key, lease)
            self._evict()

    def _unpin(self, key: str, lease: str) -> None:
        pins = self._pins[key]
        del pins[lease]
        del self._until[(key, lease)]
        if not pins:
            del self._pins[key]
            self.pinned_bytes -= self._order[key].nbytes

    def _evict(self) -> None:
        now, cut = self._clock(), 0
        while self._until:
            (key, lease), until = next(iter(self._until.items()))
            if until > now:
                break
            self._unpin(key, lease)
        while self.pinned_bytes > self.max_bytes + self.overflow_bytes:
            (key, lease), _ = next(iter(self._until.items()))
            self._unpin(key, lease)
            cut += 1
        evicted = 0
        if self.bytes > self.max_bytes:
            victims = []
            excess = self.bytes - self.max_bytes
            for key, entry in self._order.items():
                if excess <= 0:
                    break
                if key not in self._pins:
                    victims.append(key)
                    excess -= entry.nbytes
            for key in victims:
                self.bytes -= self._order.pop(key).nbytes
                self._let_go(key, "evicted: the memory index was full")
            evicted = len(victims)
        if evicted:
            self._metrics.cache_evictions.labels(self.tier).inc(evicted)
        if cut:
            self._metrics.cache_pins_cut.inc(cut)
        self._report()

    def _let_go(self, key: str, why: str) -> None:
        self._gone[key] = why
        self._gone.move_to_end(key)
        if len(self._gone) > GONE_KEPT:
            self._gone.popitem(last=False)

    def gone(self, key: str) -> str | None:
        """Why an entry it held (or was given) under ``key`` is no longer here; ``None``: not among the last
        ``GONE_KEPT`` it let go."""
        return None if key in self._order else self._gone.get(key)

    def discard(self, key: str) -> None:
        for lease in list(self._pins.get(key, ())):
            self._unpin(key, lease)
        old = self._order.pop(key, None)
        if old is not None:
            self.bytes -= old.nbytes
        self._report()

    def _report(self) -> None:
        self._metrics.cache_bytes.labels(self.tier).set(self.bytes)
        self._metrics.cache_entries.labels(self.tier).set(len(self))
        self._metrics.cache_pinned_bytes.set(self.pinned_bytes)

    def health(self) -> dict[str, object]:
        """What it holds now, lapsed leases unpinned first."""
        self._evict()
        return {
            "tier": self.tier,
            "ok": True,
            "entries": len(self),
            "bytes": self.bytes,
            "max_bytes": self.max_bytes,
            "pinned_bytes": self.pinned_bytes,
            "overflow_bytes": self.overflow_bytes,
            "insertion": "bimodal" if self.bimodal else "lru",
        }
