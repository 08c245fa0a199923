"""Stored value format and the in-process LRU."""

from __future__ import annotations

import numpy as np
import pytest
from tests.support.l1 import cyclic_hits

from visenc.index.memory import MemoryCache
from visenc.metrics import Metrics
from visenc_client.format import DATA_OFFSET, CorruptEntry, entry_key, pack_entry, unpack_entry


def entry(rows: int = 4, hidden: int = 8, h: str = "a" * 64, seed: int = 0):
    arr = np.random.default_rng(seed).standard_normal((rows, hidden)).astype(np.float32)
    return arr, pack_entry(arr, dtype="float32", grid_thw=(1, 4, 4), fingerprint="fp", hash=h)


def test_round_trip_and_row_ranges_are_views():
    arr, e = entry()
    back = unpack_entry(bytes(e.blob), fingerprint="fp", hash="a" * 64)
    assert (back.rows, back.hidden, back.dtype, back.grid_thw) == (4, 8, "float32", (1, 4, 4))
    np.testing.assert_array_equal(back.array(), arr)
    view = back.rows_view(1, 3)
    assert view.obj is back.blob  # a view into the stored value, not a copy
    np.testing.assert_array_equal(np.frombuffer(view, "<f4").reshape(2, 8), arr[1:3])
    # rows start at a fixed offset: a chunk's slice is one byte range
    assert bytes(e.blob[DATA_OFFSET : DATA_OFFSET + 32]) == arr[0].tobytes()


@pytest.mark.parametrize(
    "mutate",
    [
        lambda b: b[:-1],  # truncated
        lambda b: b + b"\0",  # too long
        lambda b: b"XXXX" + b[4:],  # bad magic
        lambda b: b[:4] + b"\x09" + b[5:],  # unknown version
        lambda b: b[:8] + b"\xff\xff\x00\x00" + b[12:],  # header overruns
        lambda b: b[:12] + b"\xc1" * 20 + b[32:],  # garbage header
        lambda b: b"",
    ],
)
def test_corrupt_values_are_rejected(mutate):
    _, e = entry()
    with pytest.raises(CorruptEntry):
        unpack_entry(mutate(bytes(e.blob)))


def test_key_mismatch_is_corrupt():
    _, e = entry()
    with pytest.raises(CorruptEntry):
        unpack_entry(bytes(e.blob), fingerprint="other")
    with pytest.raises(CorruptEntry):
        unpack_entry(bytes(e.blob), hash="b" * 64)


def test_keys_carry_namespace_fingerprint_and_hash():
    assert entry_key("ns", "fp", "h" * 64) == "visenc:ns:fp:" + "h" * 64
    assert entry_key("a", "fp", "h") != entry_key("b", "fp", "h") != entry_key("a", "fq", "h")


async def test_lru_byte_budget_and_recency():
    _, e = entry()
    size = e.nbytes
    metrics = Metrics()
    idx = MemoryCache(3 * size, metrics)
    for k in "abc":
        idx.store(k, e)
    assert idx.bytes == 3 * size
    assert idx.get("a") is e  # refresh a: b is now the oldest
    idx.store("d", e)
    assert "b" not in idx and all(k in idx for k in "acd")
    assert idx.bytes == 3 * size
    assert idx.lookup(["a", "zz"]) == [e, None]
    assert metrics.cache_evictions.labels("memory")._value.get() == 1
    # an entry larger than the whole budget is not stored (and evicts nothing)
    _, big = entry(rows=64)
    small = MemoryCache(size, metrics)
    small.store("x", e)
    small.store("big", big)
    assert "big" not in small and "x" in small


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def sized(n: int):
    """An entry of ``n`` rows of 8 float32 (32n bytes of rows past the header)."""
    return entry(rows=n)[1]


def test_a_cyclic_pass_over_more_than_the_cache_keeps_most_of_it_resident():
    """LRU evicts every entry of a loop over 1.5x the cache before its reuse; the shadow directories
    see bimodal insertion do better and the cache switches to it."""
    e = sized(4)
    cache = MemoryCache(20 * e.nbytes, Metrics())
    hits = cyclic_hits(cache, e, pinned=False)
    assert cache.bimodal
    assert hits > 0.5


def test_recent_entries_coming_back_keep_lru():
    """An agent's screenshots: each turn resends the last four and adds one. LRU holds them all."""
    e = sized(4)
    cache = MemoryCache(10 * e.nbytes, Metrics())
    hits = looks = 0
    for turn in range(200):
        for k in [f"s{i}" for i in range(max(0, turn - 4), turn + 1)]:
            looks += 1
            if cache.lookup([k])[0] is not None:
                hits += 1
            else:
                cache.store(k, e)
    assert not cache.bimodal
    assert hits / looks > 0.75


def test_a_pinned_entry_stays_past_the_budget_until_read():
    e = sized(4)
    metrics = Metrics()
    cache = MemoryCache(3 * e.nbytes, metrics, pin_lease_s=30, clock=Clock())
    for k in "abcd":
        cache.store(k, e, pins=1)
    assert all(k in cache for k in "abcd") and cache.bytes == 4 * e.nbytes  # over the budget, pinned
    assert metrics.cache_pinned_bytes._value.get() == 4 * e.nbytes
    cache.unpin("b")  # read: evictable again
    cache.unpin("c")
    cache.store("e", e)
    assert "b" not in cache and "c" not in cache and all(k in cache for k in "ade")
    assert cache.bytes == 3 * e.nbytes


def test_a_pin_counts_its_callers_and_ends_with_its_lease():
    clock = Clock()
    e = sized(4)
    cache = MemoryCache(e.nbytes, Metrics(), pin_lease_s=10, clock=clock)
    cache.store("a", e, pins=2)
    cache.unpin("a")
    cache.store("b", e)
    assert "a" in cache  # one caller has not read it yet
    clock.now = 11
    cache.store("c", e)
    assert "a" not in cache  # the lease ended


def test_pins_past_twice_the_budget_are_cut_oldest_first_and_counted():
    e = sized(4)
    metrics = Metrics()
    cache = MemoryCache(2 * e.nbytes, metrics, clock=Clock())
    for k in "abcde":
        cache.store(k, e, pins=1)
    assert "a" not in cache and all(k in cache for k in "bcde")
    assert cache.pinned_bytes <= 2 * cache.max_bytes
    assert metrics.cache_pins_cut._value.get() == 1


def test_pinning_an_entry_already_held():
    e = sized(4)
    cache = MemoryCache(2 * e.nbytes, Metrics(), clock=Clock())
    cache.store("a", e)
    cache.pin("a")
    cache.store("b", e)
    cache.store("c", e)
    assert "a" in cache and "b" not in cache
    cache.pin("zz")  # nothing held under it: nothing to keep
    assert "zz" not in cache


def test_what_it_let_go_is_remembered_boundedly_and_forgotten_once_stored_again(monkeypatch):
    import visenc.index.memory as memory
    from visenc.index.tiered import Index

    monkeypatch.setattr(memory, "GONE_KEPT", 2)
    _, e = entry()
    cache = MemoryCache(e.nbytes, Metrics())
    index, shared = Index(cache), Index(cache, remote=object())  # type: ignore[arg-type]
    assert index.absence("k0") == "never encoded here, nor evicted lately"
    assert "never encoded, or evicted from Redis" in shared.absence("k0")
    for k in ("k0", "k1", "k2", "k3"):
        cache.store(k, e)  # room for one: each store evicts the one before
    assert cache.gone("k3") is None and cache.gone("k0") is None  # held; and past the record's bound
    assert cache.gone("k1") == cache.gone("k2") == "evicted: the memory index was full"
    assert index.absence("k2").endswith("; encode it again with its bytes")
    assert "Redis no longer holds it" in shared.absence("k2")
    cache.store("k2", e)
    assert cache.gone("k2") is None and cache.gone("k3") is not None
    _, big = entry(rows=64)
    assert not cache.store("k9", big) and "larger" in (cache.gone("k9") or "")
