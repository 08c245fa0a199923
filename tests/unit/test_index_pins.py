"""Pins against the insertion policy, on the bare cache: a pin keeps an entry, never its rank."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.support.l1 import cyclic_hits

from visenc.index.memory import Lease, MemoryCache
from visenc.metrics import Metrics
from visenc_client.format import pack_entry


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def sized(rows: int = 4, seed: int = 0):
    arr = np.random.default_rng(seed).standard_normal((rows, 8)).astype(np.float32)
    return pack_entry(arr, dtype="float32", grid_thw=(1, 2, 2 * rows), fingerprint="fp", hash="a" * 64)


E = sized()


def test_a_lapsed_lease_leaves_the_entry_where_it_was():
    """Store and read a, b, c in a cache of 3; a is looked up again (a ready answer: pinned) and its
    caller never reads; the lease lapses; d comes. b, the least recently asked, goes; a stays."""
    clock = Clock()
    cache = MemoryCache(3 * E.nbytes, Metrics(), pin_lease_s=30, clock=clock)
    for k in "abc":
        lease = Lease.new()
        cache.store(k, E, leases=[lease])
        cache.read(k, lease.id, last=True)
    assert cache.lookup(["a"]) == [E]
    assert cache.pin("a", Lease.new())
    clock.now = 31
    cache.store("d", E)
    assert "b" not in cache and all(k in cache for k in "acd")
    assert cache.pins("a") == 0


def test_a_read_that_releases_its_pin_moves_nothing():
    """Under bimodal insertion a new entry goes in at the evicted-first end; reading it (its pin goes)
    leaves it there, so the next store evicts it and not an entry that was looked up again."""
    cache = MemoryCache(3 * E.nbytes, Metrics(), clock=Clock())
    for k in "ab":
        cache.store(k, E)
    cache.psel = -1  # bimodal insertion from now on (the next stores are not the one in BIMODAL_EVERY)
    lease = Lease.new()
    cache.store("new", E, leases=[lease])
    assert cache.rank("new") == 0 and cache.pins("new") == 1
    cache.store("c", E)  # full: c, inserted below the pinned entry, goes; the pinned one is skipped
    assert "new" in cache and "c" not in cache and cache.rank("new") == 0
    cache.read("new", lease.id, last=True)
    assert cache.pins("new") == 0 and cache.rank("new") == 0  # read: its place is still DIP's
    cache.psel = 0
    cache.store("d", E)  # in at the recently used end: the evicted-first entry goes
    assert "new" not in cache and all(k in cache for k in "abd")


def test_a_look_up_between_pin_and_read_moves_the_entry():
    cache = MemoryCache(3 * E.nbytes, Metrics(), clock=Clock())
    for k in "ab":
        cache.store(k, E)
    cache.psel = -1
    lease = Lease.new()
    cache.store("x", E, leases=[lease])
    assert cache.rank("x") == 0
    cache.lookup(["x"])  # another caller asked for it: a reference
    assert cache.rank("x") == 2
    cache.read("x", lease.id, last=True)
    assert cache.rank("x") == 2
    cache.psel = 0
    cache.store("c", E)
    assert "x" in cache and "a" not in cache


def test_a_lease_is_released_at_most_once_and_only_by_its_id():
    cache = MemoryCache(4 * E.nbytes, Metrics(), clock=Clock())
    mine, theirs = Lease.new(), Lease.new()
    cache.store("k", E, leases=[mine, theirs])
    assert cache.pins("k") == 2
    cache.read("k", mine.id, last=False)  # a partial read renews, releases nothing
    assert cache.pins("k") == 2
    cache.read("k", mine.id, last=True)
    cache.read("k", mine.id, last=True)  # a retry of the same read: already released, ignored
    cache.read("k", "0123456789abcdef", last=True)  # unknown: ignored
    cache.read("k", None, last=True)  # names no lease: only a pin that names none is released
    assert cache.pins("k") == 1
    cache.unpin("k", theirs.id)
    assert cache.pins("k") == 0 and cache.pinned_bytes == 0


def test_a_partial_read_renews_the_lease():
    clock = Clock()
    cache = MemoryCache(E.nbytes, Metrics(), pin_lease_s=10, clock=clock)
    lease = Lease.new()
    cache.store("a", E, leases=[lease])
    clock.now = 8
    cache.read("a", lease.id, last=False)
    clock.now = 15  # past the first lease, within the renewed one
    cache.store("b", E)
    assert "a" in cache and cache.pins("a") == 1
    clock.now = 19
    cache.store("c", E)
    assert "a" not in cache


def test_pins_that_name_no_lease_go_with_reads_that_name_none():
    cache = MemoryCache(4 * E.nbytes, Metrics(), clock=Clock())
    named = Lease.new()
    cache.store("k", E, pins=2, leases=[named])
    cache.read("k", None, last=True)
    cache.read("k", None, last=False)  # partial: renews, keeps
    assert cache.pins("k") == 2
    cache.read("k", None, last=True)
    assert cache.pins("k") == 1  # the named one is left for its caller
    cache.store("z", E)
    before = cache.rank("k")
    cache.read("k", None, last=True)  # no pin naming none left: a read nobody looked up is a look-up
    assert cache.pins("k") == 1 and cache.rank("k") == len(cache) - 1 != before


def test_pins_past_the_overflow_are_cut_oldest_first_and_counted():
    metrics = Metrics()
    cache = MemoryCache(2 * E.nbytes, metrics, overflow_bytes=E.nbytes, clock=Clock())
    for k in "abcd":
        cache.store(k, E, leases=[Lease.new()])
    assert cache.bytes <= cache.max_bytes + cache.overflow_bytes
    assert "a" not in cache and all(k in cache for k in "bcd")
    assert metrics.cache_pins_cut._value.get() == 1


def test_a_request_naming_one_image_twice_holds_one_pin():
    cache = MemoryCache(2 * E.nbytes, Metrics(), clock=Clock())
    cache.store("k", E)
    lease = Lease.new()
    cache.pin("k", lease)
    cache.pin("k", lease)
    assert cache.pins("k") == 1
    cache.read("k", lease.id, last=True)
    assert cache.pins("k") == 0


def dip_hits(pinned: bool) -> float:
    return cyclic_hits(MemoryCache(20 * E.nbytes, Metrics(), clock=Clock()), E, pinned=pinned)


def test_the_insertion_policy_survives_pins():
    """Pinned, the new entry displaces one resident the first time the cache is full (eviction skips
    it), one slot of twenty: within 0.05 of the pass stored without pins, and above 0.5."""
    assert dip_hits(pinned=True) > 0.5
    assert dip_hits(pinned=False) - dip_hits(pinned=True) < 0.05


OPS = st.lists(
    st.tuples(st.sampled_from(["store", "lookup", "pin", "read", "partial", "lapse"]), st.integers(0, 7)),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_pins_reads_and_lapses_never_reorder_and_memory_stays_bounded(ops):
    clock = Clock()
    cache = MemoryCache(4 * E.nbytes, Metrics(), overflow_bytes=2 * E.nbytes, pin_lease_s=5, clock=clock)
    leases: dict[str, list[str]] = {}
    for op, n in ops:
        key = f"k{n}"
        before = list(cache._order)
        reference = op in ("store", "lookup")
        if op == "store":
            lease = Lease.new()
            cache.store(key, E, leases=[lease])
            leases.setdefault(key, []).append(lease.id)
        elif op == "lookup":
            cache.lookup([key])
        elif op == "pin":
            lease = Lease.new()
            if cache.pin(key, lease):
                leases.setdefault(key, []).append(lease.id)
        elif op in ("read", "partial"):
            ids = leases.get(key) or ["unknown"]
            cache.read(key, ids[0], last=op == "read")
        else:
            clock.now += 6
            cache.store("filler", E)
            reference = True
        if not reference:
            assert [k for k in before if k in cache] == list(cache._order), op
        assert cache.bytes == sum(e.nbytes for e in cache._order.values())
        assert cache.pinned_bytes == sum(cache._order[k].nbytes for k in cache._pins)
        assert cache.bytes <= max(cache.max_bytes, cache.pinned_bytes)
        assert cache.pinned_bytes <= cache.max_bytes + cache.overflow_bytes
