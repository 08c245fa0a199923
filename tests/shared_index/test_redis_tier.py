"""The Redis tier and the tiered index against a real redis-server (no HTTP)."""

from __future__ import annotations

import numpy as np
import pytest
import redis.asyncio as aioredis
from harness.waits import free_port, listening, metric, wait_until

from visenc.config import Settings
from visenc.index.memory import MemoryCache
from visenc.index.redis_claims import ClaimState, RedisClaims, claim_key, queued_key
from visenc.index.redis_conn import RedisConnection, redacted_location
from visenc.index.redis_store import RedisStore
from visenc.index.tiered import Index
from visenc.metrics import Metrics
from visenc_client.format import DATA_OFFSET, entry_key, pack_entry

FP = "f" * 32


def make(h: str, rows: int = 6, hidden: int = 16, seed: int = 0):
    arr = np.random.default_rng(seed).standard_normal((rows, hidden)).astype(np.float32)
    return pack_entry(arr, dtype="float32", grid_thw=(1, 2, 3), fingerprint=FP, hash=h)


def text(m: Metrics) -> str:
    from prometheus_client import generate_latest

    return generate_latest(m.registry).decode()


@pytest.fixture
async def raw(redis_url):
    client = aioredis.Redis.from_url(redis_url)
    await client.flushdb()
    yield client
    await client.aclose()


async def commands(raw) -> dict[str, int]:
    """Calls per command since the last CONFIG RESETSTAT, without the INFO that measures them and a new
    connection's handshake (HELLO, CLIENT SETINFO, PING)."""
    stats = await raw.info("commandstats")
    skip = ("info", "hello", "ping", "client|setinfo", "config|resetstat")
    return {name: v["calls"] for k, v in stats.items() if (name := k.removeprefix("cmdstat_")) not in skip}


def index_for(url: str, metrics: Metrics, **overrides) -> RedisStore:
    return RedisStore(
        RedisConnection.from_settings(Settings(redis_url=url, **overrides), metrics),
        ttl_s=Settings(redis_url=url, **overrides).cache_ttl_s,
    )


async def test_write_is_one_value_in_the_stored_format_with_ttl(raw, redis_url):
    m = Metrics()
    idx = index_for(redis_url, m, cache_ttl_s=1234)
    key = entry_key("ns", FP, "a" * 64)
    e = make("a" * 64)
    await idx.put(key, e)
    assert await raw.get(key) == bytes(e.blob)  # exactly the stored format: header, rows at DATA_OFFSET
    assert 1200 <= await raw.ttl(key) <= 1234
    (back,) = await idx.get_many([key])
    np.testing.assert_array_equal(back.array(), e.array())
    t = text(m)
    assert metric(t, "visenc_index_bytes_total", tier="redis", op="write") == e.nbytes
    assert metric(t, "visenc_index_bytes_total", tier="redis", op="read") == e.nbytes
    assert metric(t, "visenc_cache_lookups_total", tier="redis", result="hit") == 1
    await idx.conn.close()


async def test_corrupt_truncated_or_mismatched_values_are_misses(raw, redis_url):
    m = Metrics()
    idx = index_for(redis_url, m)
    good = make("b" * 64)
    keys = [entry_key("ns", FP, c * 64) for c in "bcdef"]
    await raw.set(keys[0], bytes(good.blob)[:-4])  # truncated
    await raw.set(keys[1], b"garbage" * 100)  # not our format
    await raw.set(keys[2], bytes(good.blob))  # a valid value under another image's key
    other_fp = pack_entry(good.array(), dtype="float32", grid_thw=(1, 2, 3), fingerprint="0" * 32, hash="e" * 64)
    await raw.set(keys[3], bytes(other_fp.blob))  # another model's value under this key
    assert await idx.get_many(keys) == [None] * 5
    t = text(m)
    assert metric(t, "visenc_cache_lookups_total", tier="redis", result="corrupt") == 4
    assert metric(t, "visenc_cache_lookups_total", tier="redis", result="miss") == 1
    await idx.conn.close()


async def test_tiered_lookup_is_one_round_trip_and_promotes(raw, redis_url):
    m = Metrics()
    tiered = Index(MemoryCache(1 << 20, m), index_for(redis_url, m))
    entries = {entry_key("ns", FP, f"{i:064x}"): make(f"{i:064x}", seed=i) for i in range(5)}
    for k, e in entries.items():
        await raw.set(k, bytes(e.blob))
    keys = [*entries, entry_key("ns", FP, "9" * 64)]
    await raw.config_resetstat()
    found = await tiered.get_many(keys)
    assert await commands(raw) == {"mget": 1}  # one round trip for six keys
    assert [f is not None for f in found] == [True] * 5 + [False]
    for k, f in zip(keys, found):
        if f is not None:
            assert bytes(f.blob) == bytes(entries[k].blob)
            assert tiered.peek(k) is f  # promoted into L1
    await raw.config_resetstat()
    assert all(e is not None for e in await tiered.get_many(keys[:5]))
    assert await commands(raw) == {}  # L1 hits: no Redis command at all
    t = text(m)
    assert metric(t, "visenc_cache_lookups_total", tier="memory", result="hit") == 5
    assert metric(t, "visenc_cache_lookups_total", tier="redis", result="hit") == 5
    await tiered.close()


async def test_unreachable_redis_answers_misses_counts_and_recovers(tmp_path):
    from harness.processes import redis_process

    port = free_port()
    m = Metrics()
    idx = index_for(f"redis://:s3cret@127.0.0.1:{port}/0", m, redis_timeout_s=0.5, redis_retry_s=0.2)
    assert "s3cret" not in idx.conn.location and "s3cret" not in str(idx.conn.health())
    key = entry_key("ns", FP, "a" * 64)
    assert await idx.get_many([key]) == [None]  # nothing listens: a miss, not an exception
    await idx.put(key, make("a" * 64))  # dropped, counted
    assert not idx.conn.up and idx.conn.health()["ok"] is False
    t = text(m)
    assert metric(t, "visenc_redis_errors_total", op="get") == 1
    with redis_process(port, "--requirepass", "s3cret"):
        import asyncio

        await asyncio.sleep(0.25)  # past redis_retry_s: tried again
        await idx.put(key, make("a" * 64))
        assert idx.conn.up
        (back,) = await idx.get_many([key])
        assert back is not None and back.rows == 6
        assert idx.conn.health()["ok"] is True
        await idx.conn.close()


async def test_claim_script_semantics(raw, redis_url):
    store = index_for(redis_url, Metrics())
    idx = RedisClaims(store)
    k1, k2 = entry_key("ns", FP, "1" * 64), entry_key("ns", FP, "2" * 64)
    S = ClaimState
    assert await idx.states([k1, k2], "look", "me", 5000) == [S.FREE, S.FREE]  # reads only
    assert await raw.exists(claim_key(k1), queued_key(k1)) == 0
    # queued: marked (no claim), visible to a look from anyone, and no obstacle to a claim
    assert await idx.states([k1], "queue", "me", 5000) == [S.QUEUED]
    assert await raw.exists(claim_key(k1)) == 0 and await raw.pttl(queued_key(k1)) > 0
    assert await idx.states([k1], "look", "you", 5000) == [S.QUEUED]
    assert await idx.states([k1, k2], "claim", "me", 5000) == [S.OURS, S.OURS]  # an encode starts
    assert await idx.states([k1], "claim", "me", 5000) == [S.OURS]  # already ours
    for mode in ("claim", "queue", "look"):  # another's claim is never taken, nor marked over
        assert await idx.states([k1, k2], mode, "you", 5000) == [S.HELD, S.HELD]
    assert await raw.get(claim_key(k1)) == b"me" and await raw.exists(queued_key(k2)) == 0
    await idx.renew_claims([k1], "you", 60_000)  # not theirs: unchanged
    assert await raw.pttl(claim_key(k1)) <= 5000
    await idx.renew_claims([k1], "me", 60_000)
    assert await raw.pttl(claim_key(k1)) > 5000
    await idx.mark_queued([k2], "you", 60_000)
    assert await raw.pttl(queued_key(k2)) > 5000
    e = make("1" * 64)
    await store.put(k1, e)
    for mode in ("claim", "queue", "look"):  # the entry, read in the same script
        (got,) = await idx.states([k1], mode, "you", 5000)
        assert bytes(got.blob) == bytes(e.blob)
    await idx.unclaim([k1, k2], "you")  # not theirs: kept
    assert await raw.exists(claim_key(k2)) == 1
    await idx.unclaim([k2], "me")
    assert await raw.exists(claim_key(k2)) == 0
    assert await idx.states([k2], "look", "you", 5000) == [S.QUEUED]  # the mark outlives the claim
    assert await idx.states([k2], "claim", "you", 5000) == [S.OURS]
    await raw.set(k2, b"VENC-but-truncated")  # a corrupt value is no entry: encode and overwrite
    assert await idx.states([k2], "claim", "you", 5000) == [S.OURS]
    # the claim and queued keys live in their entry's cluster slot (hash tag = the entry key)
    from redis.crc import key_slot

    assert key_slot(claim_key(k1).encode()) == key_slot(k1.encode()) == key_slot(queued_key(k1).encode())
    # the script runs by SHA1 from Redis' script cache; an emptied cache is refilled once
    await raw.config_resetstat()
    await idx.states([k1, k2], "claim", "you", 5000)
    sent = await commands(raw)
    assert sent.get("evalsha") == 2 and "eval" not in sent
    await raw.script_flush()
    await raw.config_resetstat()
    assert await idx.states([k2], "claim", "you", 5000) == [S.OURS]
    sent = await commands(raw)
    assert sent.get("script|load") == 1 and "eval" not in sent  # NOSCRIPT, load once, send again
    await idx.conn.close()


def test_redacted_location():
    assert redacted_location("rediss://user:pw@host.example:6380/2") == "rediss://host.example:6380/2"
    assert redacted_location("redis://localhost") == "redis://localhost:6379"
    assert DATA_OFFSET == 256


def test_shipped_redis_conf_is_a_valid_cache_config(tmp_path):
    import subprocess

    import redis as syncredis
    from harness.paths import ROOT

    port = free_port()
    conf = str(ROOT / "deploy" / "redis" / "redis.conf")
    # the file as shipped; only the address and working folder are changed for the test
    proc = subprocess.Popen(
        ["redis-server", conf, "--bind", "127.0.0.1", "--port", str(port), "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        r = syncredis.Redis(port=port)
        wait_until(lambda: proc.poll() is not None or listening(port), 5, "redis-server with the shipped config")
        assert proc.poll() is None, "redis-server refused the shipped config"
        cfg = r.config_get("*")
        assert cfg["maxmemory-policy"] == "allkeys-lru" and int(cfg["maxmemory"]) > 0
        assert cfg["save"] == "" and cfg["appendonly"] == "no"
        r.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def test_a_script_error_is_a_bug_answered_500_not_an_outage(raw, redis_url):
    """A Lua script that fails (here on a key of the wrong type) is logged, counted and raised as a
    500: Redis stays up, nothing is silently skipped. An out-of-memory reply stays an outage."""
    from redis.exceptions import OutOfMemoryError

    from visenc.errors import VisencError

    m = Metrics()
    conn = RedisConnection.from_settings(Settings(redis_url=redis_url), m)
    await raw.set("a-string", "x")
    with pytest.raises(VisencError) as raised:
        await conn.run("claim", lambda: conn.client.eval("return redis.call('INCR', KEYS[1])", 1, "a-string"))
    assert raised.value.status_code == 500 and "claim" in str(raised.value)
    assert conn.up and metric(text(m), "visenc_redis_script_errors_total", op="claim") == 1

    async def oom() -> None:
        raise OutOfMemoryError("OOM command not allowed when used memory > 'maxmemory'.")

    assert await conn.run("set", oom) is None  # dropped and counted, as for any outage
    assert metric(text(m), "visenc_redis_errors_total", op="set") == 1
    assert metric(text(m), "visenc_redis_script_errors_total", op="set") == 0
    await conn.close()
