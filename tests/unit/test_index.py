"""Stored value format and the in-process LRU."""

from __future__ import annotations

import numpy as np
import pytest

from visenc.index.memory import MemoryLRU
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
    idx = MemoryLRU(3 * size, metrics)
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
    small = MemoryLRU(size, metrics)
    small.store("x", e)
    small.store("big", big)
    assert "big" not in small and "x" in small
