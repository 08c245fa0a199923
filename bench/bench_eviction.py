"""Hit rates of the L1 eviction policy (``visenc.index.memory.MemoryCache``: LRU with a dynamic
insertion policy) against LRU and S3-FIFO on the workloads visenc serves, at real row sizes.

    python bench/bench_eviction.py [--rounds 300] [--json]

    python bench/bench_eviction.py --service [--before /tmp/visenc-before] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "service"), str(ROOT / "clients"), str(ROOT / "bench")]

from visenc.index.memory import MemoryCache
from visenc.metrics import Metrics

MB = 1 << 20
SIZES = [int(8.6 * MB), int(19.3 * MB), int(33.9 * MB)]
Trace = list[tuple[str, int]]


class LRU:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes, self.bytes, self.sizes = max_bytes, 0, OrderedDict[str, int]()

    def get(self, key: str) -> bool:
        if key in self.sizes:
            self.sizes.move_to_end(key)
            return True
        return False

    def put(self, key: str, nbytes: int) -> None:
        self.sizes[key] = nbytes
        self.bytes += nbytes
        while self.bytes > self.max_bytes:
            self.bytes -= self.sizes.popitem(last=False)[1]


class S3FIFO:
    """S3-FIFO (Yang et al., SOSP 2023), byte-weighted: a small FIFO (10%), a main FIFO with
    re-insertion of entries read since they went in, and a ghost FIFO of keys evicted from the small one."""

    def __init__(self, max_bytes: int, small: float = 0.1) -> None:
        self.max_bytes, self.small_max = max_bytes, small * max_bytes
        self.small, self.main, self.ghost = OrderedDict[str, int](), OrderedDict[str, int](), OrderedDict[str, int]()
        self.small_bytes = self.main_bytes = self.ghost_bytes = 0
        self.freq: dict[str, int] = {}

    def get(self, key: str) -> bool:
        if key in self.small or key in self.main:
            self.freq[key] = min(3, self.freq.get(key, 0) + 1)
            return True
        return False

    def put(self, key: str, nbytes: int) -> None:
        if key in self.ghost:
            self.ghost_bytes -= self.ghost.pop(key)
            self.main[key] = nbytes
            self.main_bytes += nbytes
        else:
            self.small[key] = nbytes
            self.small_bytes += nbytes
        self.freq[key] = 0
        while self.small_bytes + self.main_bytes > self.max_bytes:
            if self.small_bytes > self.small_max or not self.main:
                self._evict_small()
            else:
                self._evict_main()

    def _evict_small(self) -> None:
        key, nbytes = self.small.popitem(last=False)
        self.small_bytes -= nbytes
        if self.freq.get(key, 0) > 0:
            self.main[key] = nbytes
            self.main_bytes += nbytes
            self.freq[key] = 0
            return
        self.freq.pop(key, None)
        self.ghost[key] = nbytes
        self.ghost_bytes += nbytes
        while self.ghost_bytes > self.max_bytes - self.small_max:
            self.ghost_bytes -= self.ghost.popitem(last=False)[1]

    def _evict_main(self) -> None:
        while True:
            key, nbytes = self.main.popitem(last=False)
            if self.freq.get(key, 0) > 0:
                self.freq[key] -= 1
                self.main[key] = nbytes
                continue
            self.main_bytes -= nbytes
            self.freq.pop(key, None)
            return


class Visenc:
    """visenc's L1 on the trace: a look-up, then a store on a miss (entries stand in by their size)."""

    def __init__(self, max_bytes: int) -> None:
        self.cache = MemoryCache(max_bytes, Metrics())

    def get(self, key: str) -> bool:
        return self.cache.lookup([key])[0] is not None

    def put(self, key: str, nbytes: int) -> None:
        self.cache.store(key, SimpleNamespace(nbytes=nbytes))  # type: ignore[arg-type]


POLICIES: dict[str, Callable[[int], Any]] = {"LRU": LRU, "S3-FIFO": S3FIFO, "visenc (LRU + DIP)": Visenc}


def hit_rate(policy: Any, trace: Trace, skip: int) -> float:
    hits = 0
    for i, (key, nbytes) in enumerate(trace):
        hit = policy.get(key)
        if not hit:
            policy.put(key, nbytes)
        hits += hit and i >= skip
    return hits / max(1, len(trace) - skip)


def agent(sessions: int, history: int, turns: int, rounds: int, *, scan_every: int = 0, scan_bytes: int = 0) -> Trace:
    rng = random.Random(0)
    recent: list[list[str]] = [[] for _ in range(sessions)]
    left = [rng.randint(1, turns) for _ in range(sessions)]
    sizes: dict[str, int] = {}
    trace: Trace = []
    for r in range(rounds):
        for s in rng.sample(range(sessions), sessions):
            if left[s] == 0:
                recent[s], left[s] = [], turns
            key = f"shot{len(sizes)}"
            sizes[key] = rng.choice(SIZES)
            recent[s] = [*recent[s], key][-(history + 1) :]
            left[s] -= 1
            trace += [(k, sizes[k]) for k in recent[s]]
        scanned = 0
        while scan_every and r % scan_every == scan_every - 1 and scanned < scan_bytes:
            nbytes = rng.choice(SIZES)
            trace.append((f"scan{r}-{scanned}", nbytes))
            scanned += nbytes
    return trace


def cyclic(max_bytes: int, factor: float, passes: int) -> tuple[Trace, int]:
    rng = random.Random(0)
    items: Trace = []
    while sum(n for _, n in items) < factor * max_bytes:
        items.append((f"loop{len(items)}", rng.choice(SIZES)))
    return items * passes, len(items)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--json", action="store_true")
    p.add_argument("--service", action="store_true", help="through a real visenc serve and its callers")
    p.add_argument("--before", type=Path, help="(--service) also serve this source tree")
    p.add_argument("--slots", type=int, default=16, help="(--service) L1 size, in 720p screenshots")
    p.add_argument("--passes", type=int, default=5, help="(--service) cyclic passes")
    p.add_argument("--only", help="(--service) only the workloads whose label matches this regular expression")
    p.add_argument("--no-current", action="store_true", help="(--service) serve only the --before tree")
    args = p.parse_args()
    if args.service:
        import _eviction_service as service

        trees = {**({"before": args.before} if args.before else {}), **({} if args.no_current else {"visenc": ROOT})}
        table = service.main_service(trees, args.slots, args.passes, args.rounds // 10, args.only)
        if args.json:
            print(json.dumps(table))
        return 0
    rows: dict[str, dict[str, float]] = {}

    def run(label: str, trace: Trace, max_bytes: int, skip: int) -> None:
        rows[label] = {name: hit_rate(make(int(max_bytes)), trace, skip) for name, make in POLICIES.items()}

    for sessions, history in ((16, 8), (64, 4)):
        working_set = sessions * (history + 1) * sum(SIZES) / len(SIZES)
        trace = agent(sessions, history, 20, args.rounds)
        for scale in (0.5, 1.0, 2.0):
            run(
                f"agent {sessions}x{history + 1}, cache {scale}x working set",
                trace,
                scale * working_set,
                len(trace) // 4,
            )
        scanned = agent(sessions, history, 20, args.rounds, scan_every=40, scan_bytes=int(working_set))
        run(f"agent {sessions}x{history + 1} + scans, cache 1x", scanned, working_set, len(scanned) // 4)
    for factor in (1.5, 3.0):
        trace, first = cyclic(1 << 30, factor, 10)
        run(f"cyclic pass over {factor}x the cache", trace, 1 << 30, first)
    width = max(map(len, rows))
    print(f"{'hit rate':<{width}}  " + "  ".join(f"{name:>18}" for name in POLICIES))
    for label, rates in rows.items():
        print(f"{label:<{width}}  " + "  ".join(f"{rates[name]:>18.3f}" for name in POLICIES))
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
