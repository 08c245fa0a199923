"""Two real ``visenc serve`` processes sharing one real redis-server."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
from harness.images import jpeg_bytes, png_bytes
from harness.processes import redis_process, serve_process
from harness.waits import metric

from visenc_client import AsyncClient, Client, RedisRows, Video, image_hash, video_hash


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    logs = tmp_path_factory.mktemp("replicas")
    with redis_process() as (url, _):
        args = ("--redis-url", url, "--claim-poll-ms", "5", "--max-wait-ms", "2")
        with serve_process(*args, log=logs / "a.log") as a, serve_process(*args, log=logs / "b.log") as b:
            yield url, a, b


def encoded(url: str) -> float:
    return metric(httpx.get(f"{url}/metrics").text, "visenc_encoded_images_total")


def test_two_replicas_asked_for_the_same_new_images_run_one_forward_each_image(replicas):
    _, a, b = replicas
    before = encoded(a) + encoded(b)
    rounds = [[png_bytes(400 + 10 * r + i, 64 + 24 * i, 64 + 8 * r) for i in range(4)] for r in range(3)]

    async def fire(images: list[bytes]) -> list:
        async with AsyncClient(a) as ca, AsyncClient(b) as cb:
            # the same new images at both replicas at once, whole and one by one, in different orders
            return await asyncio.gather(
                ca.encode(images, hash_first=False),
                cb.encode(images[::-1], hash_first=False),
                *(c.encode([im], hash_first=False) for im in images for c in (ca, cb)),
            )

    for images in rounds:
        results = asyncio.run(fire(images))
        assert all(h.status == "ready" for hs in results for h in hs)
    distinct = sum(len(r) for r in rounds)
    assert encoded(a) + encoded(b) - before == distinct
    # every image reads back identically from either replica
    with Client(a) as ca, Client(b) as cb:
        for images in rounds:
            for im in images:
                (h,) = cb.encode([im])
                np.testing.assert_array_equal(ca.fetch(h), cb.fetch(h))


def test_direct_redis_reads_equal_http_fetch_from_either_replica(replicas):
    url, a, b = replicas
    images = [png_bytes(450, 160, 96), jpeg_bytes(451, 90, 200)]
    with Client(a) as ca, Client(b) as cb:
        fingerprint = ca.model()["fingerprint"]
        handles = ca.encode(images)
        with RedisRows.from_url(url, fingerprint=fingerprint) as rows:
            for h in handles:
                n = h.num_tokens
                for start, end in [(None, None), (0, 4), (n // 2, n), (1, n - 1)]:
                    params = {k: v for k, v in (("start", start), ("end", end)) if v is not None}
                    for server in (a, b):
                        http = httpx.get(f"{server}/v1/embeddings/{h.hash}", params=params).content
                        assert rows.fetch_bytes(h, start, end) == http
                        assert rows.fetch_bytes(h.hash, start, end) == http
                np.testing.assert_array_equal(rows.fetch(h, 0, 4), cb.fetch(h, 0, 4))


def test_fetch_on_another_replica_waits_for_the_encode_in_flight(replicas, tiny_tower):
    """A pending handle from replica A can be fetched from replica B: B waits on A's claim."""
    from tests.support.api import reference

    _, a, b = replicas
    images = [png_bytes(470 + i, 448, 336) for i in range(6)]
    before_b = encoded(b)
    with Client(a) as ca, Client(b) as cb:
        handles = ca.encode(images, wait=False, hash_first=False)
        assert any(h.status == "pending" for h in handles)
        rows = cb.fetch(handles[-1])  # still being encoded on A
        np.testing.assert_allclose(rows, reference(tiny_tower, images[-1]), atol=1e-5, rtol=0)
        (h,) = cb.encode([images[-2]], hash_first=True)  # hash-only on B: joins or hits, never missing
        assert h.status == "ready" and h.num_tokens == handles[-2].num_tokens
    assert encoded(b) == before_b, "replica B encoded an image replica A was encoding"
    assert metric(httpx.get(f"{b}/metrics").text, "visenc_claims_total", outcome="fetch_wait") >= 1


def test_a_video_at_two_replicas_encodes_each_tube_once(replicas):
    """The same new clip, and a clip overlapping it, at both replicas at once: each distinct tube
    runs one forward across the two; either replica then serves every video by its hash alone
    (its manifest and tubes from Redis), with equal rows."""
    _, a, b = replicas
    stream = [png_bytes(600 + i, 120, 90) for i in range(10)]
    clips = [stream[:8], stream[2:10]]  # 4 tubes each, 3 shared: 5 distinct
    before = encoded(a) + encoded(b)

    async def fire() -> list:
        async with AsyncClient(a) as ca, AsyncClient(b) as cb:
            return await asyncio.gather(
                *(c.encode([Video(clip)], hash_first=False) for clip in clips for c in (ca, cb))
            )

    assert all(h.status == "ready" for hs in asyncio.run(fire()) for h in hs)
    assert encoded(a) + encoded(b) - before == 5
    with Client(a) as ca, Client(b) as cb:
        for clip in clips:
            (ha,), (hb,) = ca.lookup([video_hash([image_hash(f) for f in clip])]), cb.encode([Video(clip)])
            assert ha.status == hb.status == "ready" and ha.hash == hb.hash
            np.testing.assert_array_equal(ca.fetch(ha), cb.fetch(hb))
    assert encoded(a) + encoded(b) - before == 5
