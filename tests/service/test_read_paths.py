"""Every read releases, and only readers pin: one test per read path, through the real app.

Each image is answered ready (or pending) under a pin; after the read the pin count is 0 and the entry
keeps the rank it had: new entries go in at the evicted-first end (bimodal insertion is forced), so a
read that moved its entry (a reference counted twice) would show as a rank change. The controls: the
entry is pinned before the read, and a look-up by hash does move it. The callers themselves (the
client library, shared memory, the proxy, 16 at once, two replicas): ``test_read_callers.py``."""

from __future__ import annotations

import asyncio
import base64
import hashlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgpack
import pytest
import zmq
import zmq.asyncio
from harness.images import png_bytes
from harness.waits import until
from tests.support.api import MSGPACK, running_app
from tests.support.l1 import L1

from visenc_client import AsyncClient, ImagePlacement
from visenc_client.format import LEASE_HEADER, image_hash, video_hash

ID = {LEASE_HEADER: "id"}
NONE = {LEASE_HEADER: "none"}


@pytest.fixture
async def app(tiny_tower, tmp_path) -> AsyncIterator[tuple[httpx.AsyncClient, L1]]:
    async with running_app(tiny_tower, shm_dir=str(tmp_path)) as client:
        l1 = L1(client)
        for seed in (1, 2):  # entries around the ones read, so that a moved entry shows
            await encode(client, [{"data": png_bytes(seed, 64, 48)}], headers=NONE)
        yield client, l1


async def encode(client, items: list[dict], *, wait: bool = True, headers=None, **extra: Any) -> list[dict]:
    body = msgpack.packb({"items": items, "wait": wait, **extra})
    r = await client.post("/v1/encode", content=body, headers={**MSGPACK, **(headers or {})})
    assert r.status_code == 200, r.text
    return list(msgpack.unpackb(r.content)["items"])


async def ready(client, l1: L1, seed: int, headers=ID) -> dict:
    """A new image encoded and answered ready under a pin."""
    (h,) = await encode(client, [{"data": png_bytes(seed, 80, 60)}], headers=headers)
    assert h["status"] == "ready" and l1.pins(h["hash"]) == 1
    return h


async def test_a_fetch_by_get_renews_then_releases_its_lease(app):
    client, l1 = app
    h = await ready(client, l1, 10)
    rank, lease = l1.rank(h["hash"]), h["lease"]
    assert lease and rank == 0
    r = await client.get(f"/v1/embeddings/{h['hash']}", params={"start": 0, "end": 1, "lease": lease})
    assert r.status_code == 200 and l1.pins(h["hash"]) == 1  # a partial read renews
    r = await client.get(f"/v1/embeddings/{h['hash']}", params={"lease": lease})
    assert r.status_code == 200 and l1.pins(h["hash"]) == 0 and l1.rank(h["hash"]) == rank
    r = await client.get(f"/v1/embeddings/{h['hash']}", params={"lease": lease})  # a retry: spent, ignored
    assert r.status_code == 200 and l1.rank(h["hash"]) == rank


async def test_a_caller_without_leases_is_released_by_its_read_to_the_last_row(app):
    client, l1 = app
    h = await ready(client, l1, 11, headers={})
    assert "lease" not in h or h["lease"] is None
    rank = l1.rank(h["hash"])
    r = await client.get(f"/v1/embeddings/{h['hash']}")
    assert r.status_code == 200 and l1.pins(h["hash"]) == 0 and l1.rank(h["hash"]) == rank
    # the control: with no pin left, a read is a look-up of its own, and moves the entry
    await client.get(f"/v1/embeddings/{h['hash']}")
    assert l1.rank(h["hash"]) == l1.top


async def test_chunk_reads_release_at_the_last_row(app):
    client, l1 = app
    h = await ready(client, l1, 12)
    rank, rows = l1.rank(h["hash"]), h["num_tokens"]
    for start, end in ((0, rows // 2), (rows // 2, rows)):
        assert l1.pins(h["hash"]) == 1
        body = {"ranges": [{"hash": h["hash"], "start": start, "end": end, "lease": h["lease"]}]}
        r = await client.post("/v1/embeddings/fetch", content=msgpack.packb(body), headers=MSGPACK)
        assert r.status_code == 200
    assert l1.pins(h["hash"]) == 0 and l1.rank(h["hash"]) == rank


async def test_the_client_library_hands_its_lease_back(app):
    client, l1 = app
    transport = httpx.ASGITransport(app=client.app)  # type: ignore[attr-defined]
    async with AsyncClient("http://visenc", transport=transport) as visenc:
        (h,) = await visenc.encode([png_bytes(13, 80, 60)])
        assert h.lease and l1.pins(h.hash) == 1
        rank = l1.rank(h.hash)
        half = h.num_tokens // 2
        placements = [ImagePlacement.of(h, 0)]
        await visenc.fetch_chunk(placements, 0, half)
        assert l1.pins(h.hash) == 1
        await visenc.fetch_chunk(placements, half, h.num_tokens)
        assert l1.pins(h.hash) == 0 and l1.rank(h.hash) == rank


async def test_rows_inline_leave_no_pin(app):
    """An upload with its rows inline, then the connector's look-up by hash with rows: each answer
    reads its own rows. The look-up is a reference (the entry moves once); reading moves nothing more."""
    client, l1 = app
    (h,) = await encode(client, [{"data": png_bytes(14, 80, 60)}], include_rows=True)
    assert h["status"] == "ready" and h["rows"] and h.get("lease") is None
    assert l1.pins(h["hash"]) == 0 and l1.rank(h["hash"]) == 0
    for headers in (ID, {}):  # the connector (the client library) and a caller from before leases
        await encode(client, [{"data": png_bytes(1, 64, 48)}], headers=NONE)  # a neighbour looked up last
        assert l1.rank(h["hash"]) < l1.top
        (looked,) = await encode(client, [{"hash": h["hash"]}], include_rows=True, headers=headers)
        assert looked["status"] == "ready" and looked["rows"] == h["rows"] and looked.get("lease") is None
        assert l1.pins(h["hash"]) == 0 and l1.rank(h["hash"]) == l1.top


async def test_a_shared_memory_export_releases_and_a_refused_one_does_not(app):
    client, l1 = app
    h = await ready(client, l1, 15)
    rank = l1.rank(h["hash"])
    pool = client.app.state.shm  # type: ignore[attr-defined]
    budget, pool.max_bytes = pool.max_bytes, 1  # full: the range is answered 429 in its place
    body = {"ranges": [{"hash": h["hash"], "start": 0, "end": 1, "lease": h["lease"]}]}
    r = await client.post("/v1/embeddings/shm", content=msgpack.packb(body), headers=MSGPACK)
    assert msgpack.unpackb(r.content)["items"][0]["status"] == 429
    assert l1.pins(h["hash"]) == 1  # refused: the client reads over HTTP, under the same pin
    pool.max_bytes = budget
    r = await client.post("/v1/embeddings/shm", content=msgpack.packb(body), headers=MSGPACK)
    assert "segment" in msgpack.unpackb(r.content)["items"][0]
    assert l1.pins(h["hash"]) == 0 and l1.rank(h["hash"]) == rank  # exported, partial range or not


async def test_a_pending_answer_pins_when_stored_and_the_read_releases(app):
    client, l1 = app
    (h,) = await encode(client, [{"data": png_bytes(16, 80, 60)}], wait=False, headers=ID)
    assert h["status"] in ("pending", "ready") and h["lease"]
    await until(lambda: l1.rank(h["hash"]) is not None, 30, "the entry stored")
    assert l1.pins(h["hash"]) == 1
    rank = l1.rank(h["hash"])
    await client.get(f"/v1/embeddings/{h['hash']}", params={"lease": h["lease"]})
    assert l1.pins(h["hash"]) == 0 and l1.rank(h["hash"]) == rank


async def test_the_proxys_hand_over_and_look_up_pin_nothing(app):
    client, l1 = app
    data = png_bytes(17, 80, 60)
    (h,) = await encode(client, [{"hash": image_hash(data), "data": data}], wait=False, headers=NONE)
    await until(lambda: l1.rank(h["hash"]) is not None, 30, "the entry stored")
    (looked,) = await encode(client, [{"hash": h["hash"]}], wait=False, headers=NONE)
    assert looked["status"] == "ready" and looked.get("lease") is None
    assert l1.pins(h["hash"]) == 0
    assert l1.rank(h["hash"]) == l1.top  # the control: a look-up by hash is a reference


async def test_a_request_naming_one_image_twice_holds_one_pin(app):
    client, l1 = app
    data = png_bytes(18, 80, 60)
    first, second = await encode(client, [{"data": data}, {"data": data}], headers=ID)
    assert first["lease"] == second["lease"] and l1.pins(first["hash"]) == 1
    await client.get(f"/v1/embeddings/{first['hash']}", params={"lease": first["lease"]})
    assert l1.pins(first["hash"]) == 0


async def test_a_videos_read_releases_its_tubes(app):
    client, l1 = app
    frames = [png_bytes(1100 + i, 120, 90) for i in range(4)]
    (h,) = await encode(client, [{"frames": frames}], headers=ID)
    assert h["status"] == "ready" and h["lease"] and len(h["tubes"]) == 2
    assert [l1.pins(t) for t in h["tubes"]] == [1, 1]
    ranks = [l1.rank(t) for t in h["tubes"]]
    assert h["hash"] == video_hash([hashlib.sha256(f).hexdigest() for f in frames])
    r = await client.get(f"/v1/embeddings/{h['hash']}", params={"lease": h["lease"]})
    assert r.status_code == 200
    assert [l1.pins(t) for t in h["tubes"]] == [0, 0] and [l1.rank(t) for t in h["tubes"]] == ranks
    (again,) = await encode(client, [{"hash": h["hash"]}], headers=ID)  # asked by its hash alone
    assert again["status"] == "ready" and again["lease"] and [l1.pins(t) for t in h["tubes"]] == [1, 1]
    ranks = [l1.rank(t) for t in h["tubes"]]
    r = await client.get(f"/v1/embeddings/{h['hash']}", params={"lease": again["lease"]})
    assert [l1.pins(t) for t in h["tubes"]] == [0, 0] and [l1.rank(t) for t in h["tubes"]] == ranks


async def test_the_sglang_push_releases_what_it_read(app):
    """A part of two images: one known (its hash-first look-up pins nothing; the look-up moves it), one
    new (encoded for the part, pinned, pushed, released where DIP put it)."""
    client, l1 = app
    known, new = png_bytes(19, 80, 60), png_bytes(20, 80, 60)
    await ready(client, l1, 19, headers={})  # known: the part's hash-first look-up finds it
    await client.get(f"/v1/embeddings/{image_hash(known)}")
    assert l1.pins(image_hash(known)) == 0
    context = zmq.asyncio.Context()
    try:
        pull = context.socket(zmq.PULL)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        reg = {"req_id": "p", "receive_count": 1, "receive_url": f"127.0.0.1:{port}"}
        await client.post("/scheduler_receive_url", json=reg)
        items = [
            {"url": "data:image/png;base64," + base64.b64encode(d).decode(), "content_hash": f"sha256:{image_hash(d)}"}
            for d in (known, new)
        ]
        body = {"req_id": "p", "num_parts": 1, "part_idx": 0, "mm_items": items, "modality": "IMAGE"}
        r = await client.post("/encode", json=body)
        assert r.status_code == 200
        _, rows = await asyncio.wait_for(pull.recv_multipart(), 30)
        assert len(rows) > 0
    finally:
        context.destroy(linger=0)
    assert l1.pins(image_hash(known)) == 0 and l1.pins(image_hash(new)) == 0
    assert l1.rank(image_hash(new)) == 0  # where bimodal insertion put it: the push moved nothing
    assert l1.rank(image_hash(known)) == l1.top  # the control: the part's look-ups by hash moved it
