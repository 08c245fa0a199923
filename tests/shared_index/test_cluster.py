"""The shared index on a local three-node Redis Cluster (``--redis-mode cluster``)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from harness.images import png_bytes
from harness.processes import redis_cluster
from harness.waits import metric, until
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from tests.support.api import encode_json, reference, running_app

from visenc.index.redis_claims import claim_key
from visenc_client import AsyncRedisRows, Handle, RedisRows, image_hash
from visenc_client.format import entry_key


@pytest.fixture(scope="module")
def cluster_url(tmp_path_factory):
    with redis_cluster(tmp_path_factory.mktemp("cluster")) as ports:
        yield f"redis://127.0.0.1:{ports[0]}"


async def test_encode_and_fetch_round_trips_on_a_cluster(cluster_url, tiny_tower):
    images = [png_bytes(500 + i, 64 + 8 * i, 64) for i in range(8)]
    settings = {"redis_url": cluster_url, "redis_mode": "cluster", "claim_poll_ms": 5.0}
    async with running_app(tiny_tower, **settings) as a, running_app(tiny_tower, **settings) as b:
        fp = (await a.get("/v1/model")).json()["fingerprint"]
        keys = [entry_key("default", fp, image_hash(d)) for d in images]
        assert len({key_slot(k.encode()) % 3 for k in keys}) > 1  # the entries spread over the nodes

        # the same new images at both replicas at once: claims (a Lua script over entry + claim key,
        # same slot) make it one forward per image
        ra, rb = await asyncio.gather(
            encode_json(a, [{"data": d} for d in images]), encode_json(b, [{"data": d} for d in images[::-1]])
        )
        assert all(it["status"] == "ready" for it in ra.json()["items"] + rb.json()["items"])
        ma, mb = (await a.get("/metrics")).text, (await b.get("/metrics")).text
        assert metric(ma, "visenc_encoded_images_total") + metric(mb, "visenc_encoded_images_total") == 8
        assert metric(ma, "visenc_redis_errors_total", op="claim") == 0

        for replica in (a, b):  # the write-through follows the answer
            await until(lambda replica=replica: not replica.app.state.engine.outputs.pending_writes)
        # a third replica: one multi-slot lookup (MGET per slot, all nodes at once) finds them all
        async with running_app(tiny_tower, **settings) as c:
            r = await encode_json(c, [{"hash": image_hash(d)} for d in images])
            assert [it["status"] for it in r.json()["items"]] == ["ready"] * 8
            mc = (await c.get("/metrics")).text
            assert metric(mc, "visenc_cache_lookups_total", tier="redis", result="hit") == 8
            assert metric(mc, "visenc_encoded_images_total") == 0
            for d in images[:3]:
                got = (await c.get(f"/v1/embeddings/{image_hash(d)}")).content
                np.testing.assert_allclose(
                    np.frombuffer(got, "<f4").reshape(-1, tiny_tower.hidden_size),
                    reference(tiny_tower, d),
                    atol=1e-5,
                    rtol=0,
                )
            assert (await c.get("/readyz")).json()["status"] == "ready"

        # no claim is left behind; direct reads go to the node that owns each key
        rc = RedisCluster.from_url(cluster_url)
        assert sum([await rc.exists(claim_key(k)) for k in keys]) == 0
        await rc.aclose()
        handle = Handle.from_wire(ra.json()["items"][0])
        http = (await a.get(f"/v1/embeddings/{handle.hash}?start=1&end=3")).content
        async with AsyncRedisRows.from_url(cluster_url, fingerprint=fp, cluster=True) as rows:
            assert await rows.fetch_bytes(handle, 1, 3) == http
        with RedisRows.from_url(cluster_url, fingerprint=fp, cluster=True) as sync_rows:
            assert sync_rows.fetch_bytes(handle.hash, 1, 3) == http
