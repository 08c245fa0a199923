"""Affinity of ``visenc proxy``: which upstream saw which images, and each data: URL's image hash."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Upstreams:
    """Round robin over healthy upstreams, with cache affinity by image hash."""

    urls: list[str]
    affinity_size: int
    healthy: dict[str, bool] = field(default_factory=dict)
    _seen: OrderedDict[str, str] = field(default_factory=OrderedDict)
    _turn: itertools.count[int] = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        self.healthy = dict.fromkeys(self.urls, True)

    def choose(self, hashes: Sequence[str]) -> str | None:
        """The upstream for a request with images ``hashes`` (``None``: no healthy one)."""
        live = [u for u in self.urls if self.healthy[u]]
        if not live:
            return None
        votes: dict[str, int] = {}
        for h in hashes:
            u = self._seen.get(h)
            if u is not None and self.healthy.get(u):
                votes[u] = votes.get(u, 0) + 1
        if votes:
            return max(live, key=lambda u: votes.get(u, 0))
        return live[next(self._turn) % len(live)]

    def saw(self, upstream: str, hashes: Sequence[str]) -> None:
        for h in hashes:
            self._seen[h] = upstream
            self._seen.move_to_end(h)
        while len(self._seen) > self.affinity_size:
            self._seen.popitem(last=False)


class Memo:
    """data: URL -> its image's hash (LRU, bounded in characters), and the hashes visenc accepted from this proxy."""

    def __init__(self, max_chars: int, max_handed: int) -> None:
        self.max_chars = max_chars
        self.max_handed = max_handed
        self.chars = 0
        self._hashes: OrderedDict[str, str] = OrderedDict()
        self._handed: OrderedDict[str, None] = OrderedDict()

    def hash_of(self, url: str) -> str | None:
        h = self._hashes.get(url)  # a hit compares the whole string: exact, not a digest of it
        if h is not None:
            self._hashes.move_to_end(url)
        return h

    def remember(self, url: str, h: str) -> None:
        if len(url) > self.max_chars or url in self._hashes:
            return
        self._hashes[url] = h
        self.chars += len(url)
        while self.chars > self.max_chars:
            old, _ = self._hashes.popitem(last=False)
            self.chars -= len(old)

    def handed(self, h: str) -> bool:
        return h in self._handed

    def hand(self, hashes: Sequence[str]) -> None:
        for h in hashes:
            self._handed[h] = None
            self._handed.move_to_end(h)
        while len(self._handed) > self.max_handed:
            self._handed.popitem(last=False)
