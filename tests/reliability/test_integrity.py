"""No cache poisoning, hash-only never creates, and no corrupt entry is ever served.

Corruption is injected through the ``Index`` interface (the tier the encoder reads from), so the
same checks hold for any tier behind it: the in-process LRU here, Redis behind the same interface.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from harness.images import png_bytes
from harness.waits import metric, until
from tests.support.api import encode_json, fetch_rows, reference, running_app, sha
from tests.support.faults import faulty_index

from visenc_client.format import Entry, entry_key, pack_entry


def key_of(encoder, data: bytes, namespace: str = "default") -> str:
    return entry_key(namespace, encoder.fingerprint, sha(data))


async def test_wrong_hash_creates_no_entry_under_either_hash(service):
    encoder = service.app.state.engine
    claimed, sent = png_bytes(800, 28, 28), png_bytes(801, 28, 28)
    r = await encode_json(service, [{"hash": sha(claimed), "data": sent}])
    assert r.status_code == 200 and r.json()["items"][0]["reason"] == "hash_mismatch"
    assert encoder.index.peek(key_of(encoder, claimed)) is None
    assert encoder.index.peek(key_of(encoder, sent)) is None
    assert encoder.inflight.jobs == {}
    # the bad item fails alone: the good one of the same request is encoded under its own hash
    r = await encode_json(service, [{"data": sent}, {"hash": sha(claimed), "data": sent}])
    assert [it["status"] for it in r.json()["items"]] == ["ready", "error"]
    assert encoder.index.peek(key_of(encoder, sent)) is not None
    assert encoder.index.peek(key_of(encoder, claimed)) is None


async def test_hash_only_can_read_but_never_create(service):
    encoder = service.app.state.engine
    data = png_bytes(802, 28, 28)
    for wait in (True, False):
        r = await encode_json(service, [{"hash": sha(data)}], wait=wait)
        assert r.json()["items"][0]["status"] == "missing"
    assert encoder.inflight.jobs == {} and encoder.scheduler.depth == 0
    assert (await service.get(f"/v1/embeddings/{sha(data)}")).status_code == 404
    m = (await service.get("/metrics")).text
    assert metric(m, "visenc_encoded_images_total") == 0


def truncated(e: Entry) -> Entry:
    return dataclasses.replace(e, blob=bytes(e.blob[:-4]))


def bad_magic(e: Entry) -> Entry:
    blob = bytearray(e.blob)
    blob[0:4] = b"XXXX"
    return dataclasses.replace(e, blob=blob)


def other_image(e: Entry) -> Entry:
    """A well-formed value stored under the wrong key (its header names another image)."""
    rows = np.frombuffer(e.rows_view(), dtype="<f4").reshape(e.rows, e.hidden) + 1
    return pack_entry(rows, dtype=e.dtype, grid_thw=e.grid_thw, fingerprint=e.fingerprint, hash="f" * 64)


def other_model(e: Entry) -> Entry:
    rows = np.frombuffer(e.rows_view(), dtype="<f4").reshape(e.rows, e.hidden)
    return pack_entry(rows, dtype=e.dtype, grid_thw=e.grid_thw, fingerprint="0" * 32, hash=e.hash)


def header_lies(e: Entry) -> Entry:
    """The Entry object claims more rows than its stored value holds."""
    return dataclasses.replace(e, rows=e.rows + 1)


def wrong_width(e: Entry) -> Entry:
    rows = np.zeros((e.rows, e.hidden * 2), dtype="<f4")
    return pack_entry(rows, dtype=e.dtype, grid_thw=e.grid_thw, fingerprint=e.fingerprint, hash=e.hash)


@pytest.mark.parametrize("damage", [truncated, bad_magic, other_image, other_model, header_lies, wrong_width])
async def test_corrupt_entry_is_a_miss_reencoded_never_served(tiny_tower, damage):
    async with running_app(tiny_tower) as client:
        encoder = client.app.state.engine
        data = png_bytes(810, 56, 28)
        await encode_json(client, [{"data": data}])
        key = key_of(encoder, data)
        good = encoder.index.peek(key)
        # a fetch never serves it (404), and the damaged value is dropped from the tier
        encoder.index.store_local(key, damage(good))
        assert (await client.get(f"/v1/embeddings/{sha(data)}")).status_code == 404
        assert encoder.index.peek(key) is None
        # a hash-only lookup says "missing" (upload the bytes)
        encoder.index.store_local(key, damage(good))
        r = await encode_json(client, [{"hash": sha(data)}])
        assert r.json()["items"][0]["status"] == "missing"
        # with the bytes it is encoded again, and the right rows are served afterwards
        encoder.index.store_local(key, damage(good))
        r = await encode_json(client, [{"data": data}])
        assert r.json()["items"][0]["status"] == "ready"
        np.testing.assert_allclose(await fetch_rows(client, sha(data)), reference(tiny_tower, data), atol=1e-5, rtol=0)
        m = (await client.get("/metrics")).text
        assert metric(m, "visenc_corrupt_entries_total") == 3
        assert metric(m, "visenc_encoded_images_total") == 2  # the first encode and the re-encode


async def test_index_returning_damaged_values_never_serves_them(tiny_tower):
    """A tier that hands back truncated values (fault injector) is answered with misses, not garbage."""
    async with running_app(tiny_tower, index=faulty_index(corrupt_rate=1.0)) as client:
        data = png_bytes(820, 28, 28)
        assert (await encode_json(client, [{"data": data}])).json()["items"][0]["status"] == "ready"
        r = await encode_json(client, [{"hash": sha(data)}])
        assert r.json()["items"][0]["status"] == "missing"
        assert (await client.get(f"/v1/embeddings/{sha(data)}")).status_code == 404
        m = (await client.get("/metrics")).text
        assert metric(m, "visenc_corrupt_entries_total") == 1


async def test_corrupt_redis_value_is_a_miss_then_repaired(tiny_tower, redis_url):
    """Through the real tiered index: a damaged Redis value (L1 empty, as on another replica) is
    never served; hash-only says ``missing``, the bytes re-encode it, the write repairs Redis."""
    import redis.asyncio as aioredis

    from visenc_client.format import unpack_entry

    async with running_app(tiny_tower, redis_url=redis_url, namespace="integrity") as client:
        encoder = client.app.state.engine
        data = png_bytes(830, 28, 28)
        assert (await encode_json(client, [{"data": data}])).json()["items"][0]["status"] == "ready"
        key = key_of(encoder, data, "integrity")
        raw = aioredis.from_url(redis_url)
        try:
            await until(lambda: raw.exists(key), what="the write-through to Redis, behind the answer")
            good = await raw.get(key)
            await raw.set(key, good[:-10])  # truncated
            encoder.index.discard(key)
            r = await encode_json(client, [{"hash": sha(data)}])
            assert r.json()["items"][0]["status"] == "missing"
            assert (await client.get(f"/v1/embeddings/{sha(data)}")).status_code == 404
            r = await encode_json(client, [{"data": data}])
            assert r.json()["items"][0]["status"] == "ready"
            np.testing.assert_allclose(
                await fetch_rows(client, sha(data)), reference(tiny_tower, data), atol=1e-5, rtol=0
            )

            async def rewritten() -> bool:
                value = await raw.get(key)
                return value is not None and len(value) == len(good)

            await until(rewritten, what="the entry written through again, whole")
            value = await raw.get(key)
            unpack_entry(value, fingerprint=encoder.fingerprint, hash=sha(data))  # repaired, valid
        finally:
            await raw.delete(key)
            await raw.aclose()
