"""Replicas sharing one Redis: the real app in-process (engine, tiny tower, Redis tier), real redis-server."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import redis.asyncio as aioredis
from harness.images import jpeg_bytes, png_bytes
from harness.waits import free_port, metric, until
from tests.support.api import encode_json, reference, running_app
from tests.support.faults import FaultyTower

from visenc.index.redis_claims import claim_key, queued_key
from visenc_client import AsyncRedisRows, Handle, image_hash
from visenc_client.format import entry_key

FAST = {"claim_poll_ms": 5.0}


@pytest.fixture
async def raw(redis_url):
    client = aioredis.Redis.from_url(redis_url)
    await client.flushdb()
    yield client
    await client.aclose()


async def metrics_of(client) -> str:
    return (await client.get("/metrics")).text


async def test_an_image_encoded_on_one_replica_is_a_hit_on_another(raw, redis_url, tiny_tower):
    images = [png_bytes(300, 96, 64), jpeg_bytes(301, 120, 90)]
    async with (
        running_app(tiny_tower, redis_url=redis_url, **FAST) as a,
        running_app(tiny_tower, redis_url=redis_url, **FAST) as b,
    ):
        r = await encode_json(a, [{"data": d} for d in images])
        assert [it["status"] for it in r.json()["items"]] == ["ready", "ready"]
        await until(lambda: not a.app.state.engine.outputs.pending_writes)  # the write-through follows the answer
        # hash-only on the other replica: found in Redis, no bytes needed, no forward
        r = await encode_json(b, [{"hash": image_hash(d)} for d in images])
        assert [it["status"] for it in r.json()["items"]] == ["ready", "ready"]
        for d in images:
            got = await b.get(f"/v1/embeddings/{image_hash(d)}")
            rows = np.frombuffer(got.content, "<f4").reshape(-1, tiny_tower.hidden_size)
            np.testing.assert_allclose(rows, reference(tiny_tower, d), atol=1e-5, rtol=0)
        mb = await metrics_of(b)
        assert metric(mb, "visenc_encoded_images_total") == 0
        assert metric(mb, "visenc_cache_lookups_total", tier="redis", result="hit") == 2
        assert metric(await metrics_of(a), "visenc_index_bytes_total", tier="redis", op="write") > 0
        # what is in Redis is the stored format, under the documented key, with no claim left behind
        fp = (await a.get("/v1/model")).json()["fingerprint"]
        key = entry_key("default", fp, image_hash(images[0]))
        assert (await raw.get(key))[:4] == b"VENC"
        assert await raw.exists(claim_key(key)) == 0


async def test_direct_getrange_reads_equal_the_http_fetch(raw, redis_url, tiny_tower):
    data = png_bytes(310, 200, 140)
    async with running_app(tiny_tower, redis_url=redis_url) as a:
        r = await encode_json(a, [{"data": data}])
        handle = Handle.from_wire(r.json()["items"][0])
        fp = (await a.get("/v1/model")).json()["fingerprint"]
        await until(lambda: not a.app.state.engine.outputs.pending_writes)  # the write-through follows the answer
        n = handle.num_tokens
        async with AsyncRedisRows.from_url(redis_url, fingerprint=fp) as rows:
            for start, end in [(None, None), (0, 1), (3, n - 2), (n - 1, n), (5, 5), (0, n)]:
                params = {k: v for k, v in (("start", start), ("end", end)) if v is not None}
                http = (await a.get(f"/v1/embeddings/{handle.hash}", params=params)).content
                assert await rows.fetch_bytes(handle, start, end) == http  # one round trip (shape known)
                assert await rows.fetch_bytes(handle.hash, start, end) == http  # header first
            info = await rows.info(handle.hash)
            assert (info.rows, info.hidden, info.dtype) == (n, handle.hidden_size, handle.dtype)
            np.testing.assert_array_equal(
                await rows.fetch(handle, 2, 7),
                np.frombuffer((await a.get(f"/v1/embeddings/{handle.hash}?start=2&end=7")).content, "<f4").reshape(
                    5, -1
                ),
            )
            from visenc_client import BadRequestError, NotFoundError

            with pytest.raises(BadRequestError):
                await rows.fetch_bytes(handle.hash, 0, n + 1)
            with pytest.raises(NotFoundError):
                await rows.fetch_bytes("0" * 64)


async def test_concurrent_replicas_encode_a_new_image_once(raw, redis_url, tiny_tower):
    images = [png_bytes(320 + i, 64 + 16 * i, 64) for i in range(4)]
    async with (
        running_app(tiny_tower, redis_url=redis_url, **FAST) as a,
        running_app(tiny_tower, redis_url=redis_url, **FAST) as b,
    ):
        ra, rb = await asyncio.gather(
            encode_json(a, [{"data": d} for d in images]), encode_json(b, [{"data": d} for d in reversed(images)])
        )
        assert all(it["status"] == "ready" for it in ra.json()["items"] + rb.json()["items"])
        ma, mb = await metrics_of(a), await metrics_of(b)
        assert metric(ma, "visenc_encoded_images_total") + metric(mb, "visenc_encoded_images_total") == 4
        for d in images:
            ea, eb = (
                (await a.get(f"/v1/embeddings/{image_hash(d)}")).content,
                (await b.get(f"/v1/embeddings/{image_hash(d)}")).content,
            )
            assert ea == eb


async def test_a_claim_whose_owner_died_is_taken_over(raw, redis_url, tiny_tower):
    data = png_bytes(330, 64, 64)
    async with running_app(tiny_tower, redis_url=redis_url, **FAST) as a:
        fp = (await a.get("/v1/model")).json()["fingerprint"]
        key = entry_key("default", fp, image_hash(data))
        await raw.set(claim_key(key), "a-replica-that-died", px=60_000)  # never renewed
        asking = asyncio.create_task(encode_json(a, [{"data": data}]))

        async def held() -> bool:
            return metric(await metrics_of(a), "visenc_claims_total", outcome="held") == 1

        await until(held, what="the encode finding the claim held")
        await raw.pexpire(claim_key(key), 1)  # the dead owner's claim lapses
        r = await asking
        assert r.json()["items"][0]["status"] == "ready"
        m = await metrics_of(a)
        assert metric(m, "visenc_claims_total", outcome="held") == 1
        assert metric(m, "visenc_claims_total", outcome="takeover") == 1
        assert metric(m, "visenc_encoded_images_total") == 1


async def busy_replica_with_a_queued_image(raw, a, first: bytes, queued: bytes) -> tuple[str, str]:
    """``first`` on a's device (its slow forward), the device's next input staged (and claimed)
    behind it, and ``queued`` waiting behind both; the entry keys of ``first`` and ``queued``."""
    fp = (await a.get("/v1/model")).json()["fingerprint"]
    k_first, k_next, k_queued = (entry_key("default", fp, image_hash(d)) for d in (first, NEXT, queued))
    r = await encode_json(a, [{"data": first}, {"data": NEXT}, {"data": queued}], wait=False)
    assert [it["status"] for it in r.json()["items"]] == ["pending"] * 3
    await until(lambda: raw.exists(claim_key(k_first)))  # its encode started: claimed now
    await until(lambda: raw.exists(claim_key(k_next)))  # the device's next input is always prepared
    # the queued image holds no claim, only a "queued" mark
    assert await raw.exists(claim_key(k_queued)) == 0 and await raw.exists(queued_key(k_queued)) == 1
    return k_first, k_queued


#: the image staged behind the busy replica's first (whatever the prefetch bound, the device's next
#: input is prepared while it runs)
NEXT = png_bytes(339, 64, 96)
#: replica a: claims of 600 ms (renewed every 200 ms), and no staging past the device's next image
BUSY = {"claim_ttl_ms": 600, "prefetch_tokens": 1, **FAST}
#: replica a's first forward: well past the claim ttl, with room for a loaded test host
SLOW_S = 2.5


async def test_claims_are_taken_at_encode_start_and_renewed_while_it_runs(raw, redis_url, tiny_tower):
    """An image queued at a busy replica is encoded by a free one at once, not after the busy
    one's forward; the busy one then finds its entry at its own encode start (no second forward)."""
    first, queued = png_bytes(333, 64, 64), png_bytes(334, 96, 64)
    slow = FaultyTower(tiny_tower, delay_s=SLOW_S, delay_first=1)
    async with running_app(slow, redis_url=redis_url, **BUSY) as a, running_app(tiny_tower, redis_url=redis_url) as b:
        k_first, _ = await busy_replica_with_a_queued_image(raw, a, first, queued)
        token = await raw.get(claim_key(k_first))
        r = await encode_json(b, [{"data": queued}])
        assert r.json()["items"][0]["status"] == "ready"
        assert slow.forwards == 1 and await raw.exists(k_first) == 0  # a's first forward still runs
        assert metric(await metrics_of(b), "visenc_claims_total", outcome="owned") == 1
        await asyncio.sleep(0.8)  # past claim_ttl_ms: the running encode's claim is renewed, not lapsed
        assert await raw.get(claim_key(k_first)) == token and await raw.exists(k_first) == 0
        rows = await a.get(f"/v1/embeddings/{image_hash(queued)}")  # a finds b's entry at encode start
        assert rows.content == (await b.get(f"/v1/embeddings/{image_hash(queued)}")).content

        async def released() -> bool:
            return await raw.exists(claim_key(k_first)) == 0

        await until(released, what="a's claim released")  # only once its entry is written (two round trips)
        assert await raw.exists(k_first) == 1
        assert (await a.get(f"/v1/embeddings/{image_hash(NEXT)}")).status_code == 200  # waits for its encode
        ma = await metrics_of(a)
        assert metric(ma, "visenc_encoded_images_total") == 2  # first and NEXT: not the queued one
        assert metric(ma, "visenc_claims_total", outcome="ready") == 1


async def test_a_fetch_elsewhere_waits_for_an_image_queued_at_a_busy_replica(raw, redis_url, tiny_tower):
    """A pending handle fetched from another replica while its image is still queued (not started)
    at a busy replica waits past claim_ttl_ms (the queued mark is renewed), then gets the rows."""
    first, queued = png_bytes(335, 64, 64), png_bytes(336, 96, 64)
    slow = FaultyTower(tiny_tower, delay_s=SLOW_S, delay_first=1)
    async with running_app(slow, redis_url=redis_url, **BUSY) as a, running_app(tiny_tower, redis_url=redis_url) as b:
        await busy_replica_with_a_queued_image(raw, a, first, queued)
        got = await b.get(f"/v1/embeddings/{image_hash(queued)}")
        assert got.status_code == 200
        rows = np.frombuffer(got.content, "<f4").reshape(-1, tiny_tower.hidden_size)
        np.testing.assert_allclose(rows, reference(tiny_tower, queued), atol=1e-5, rtol=0)
        mb = await metrics_of(b)
        assert metric(mb, "visenc_encoded_images_total") == 0
        assert metric(mb, "visenc_claims_total", outcome="fetch_wait") == 1


async def test_a_claim_held_too_long_is_not_waited_for_forever(raw, redis_url, tiny_tower):
    data = png_bytes(331, 64, 64)
    async with running_app(tiny_tower, redis_url=redis_url, claim_wait_s=0.3, **FAST) as a:
        fp = (await a.get("/v1/model")).json()["fingerprint"]
        await raw.set(claim_key(entry_key("default", fp, image_hash(data))), "a-stuck-replica", px=60_000)
        r = await encode_json(a, [{"data": data}])
        assert r.json()["items"][0]["status"] == "ready"
        assert metric(await metrics_of(a), "visenc_claims_total", outcome="timeout") == 1


async def test_a_watched_image_nobody_waits_for_is_dropped(raw, redis_url, tiny_tower):
    data = png_bytes(332, 64, 64)
    async with running_app(tiny_tower, redis_url=redis_url, request_timeout_s=0.2, **FAST) as a:
        fp = (await a.get("/v1/model")).json()["fingerprint"]
        await raw.set(claim_key(entry_key("default", fp, image_hash(data))), "a-slow-replica", px=60_000)
        r = await encode_json(a, [{"data": data}])
        assert r.status_code == 504
        encoder = a.app.state.engine
        await until(lambda: not encoder.inflight.jobs, what="no image in flight")
        assert encoder.inflight.jobs == {} and encoder.coordination.watching == 0
        assert metric(await metrics_of(a), "visenc_encoded_images_total") == 0


async def test_an_image_taken_over_after_the_device_was_given_up_is_answered_503(raw, redis_url, tiny_tower):
    """An image waited for at another replica whose claim goes away (the other replica died) is
    encoded here, unless this replica's device was given up meanwhile: then its waiter is answered
    503 at once (retry elsewhere), not left to its request deadline with the image stuck ready."""
    waited, failing = png_bytes(337, 64, 64), png_bytes(338, 64, 64)
    tower = FaultyTower(tiny_tower, fail_first=1_000_000)
    async with running_app(tower, redis_url=redis_url, worker_restart_attempts=1, request_timeout_s=30, **FAST) as a:
        engine = a.app.state.engine
        fp = (await a.get("/v1/model")).json()["fingerprint"]
        claim = claim_key(entry_key("default", fp, image_hash(waited)))
        await raw.set(claim, "another-replica", px=60_000)
        waiting = asyncio.create_task(encode_json(a, [{"data": waited}]))
        await until(lambda: engine.coordination.watching == 1, what="the image waited for at the other replica")
        assert (await encode_json(a, [{"data": failing}])).status_code == 503
        await until(lambda: a.app.state.fatal is not None, what="the device given up")
        await raw.delete(claim)  # the other replica went away: this one would take the image over
        r = await asyncio.wait_for(waiting, 10)
        assert r.status_code == 503, r.text
        assert "the device cannot be used" in r.json()["error"]["message"]
        await until(lambda: not engine.inflight.jobs, what="nothing in flight")
        assert engine.scheduler.depth == 0 and engine.scheduler.staged_tokens == 0


async def test_without_redis_the_service_answers_and_reports_degraded(tiny_tower):
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    async with running_app(tiny_tower, redis_url=url, redis_timeout_s=0.2) as a:
        r = await encode_json(a, [{"data": png_bytes(340, 64, 64)}])
        assert r.json()["items"][0]["status"] == "ready"
        ready = await a.get("/readyz")
        assert ready.status_code == 200 and ready.json()["status"] == "degraded"
        assert ready.json()["index"]["redis"]["ok"] is False
        m = await metrics_of(a)
        assert metric(m, "visenc_index_up", tier="redis") == 0
        assert metric(m, "visenc_redis_errors_total", op="get") >= 1
