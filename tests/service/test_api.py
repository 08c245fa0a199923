"""The real app in-process (engine, index, tiny Qwen2-VL tower) through its HTTP API."""

from __future__ import annotations

import asyncio
import base64
import struct

import msgpack
import numpy as np
import pytest
import torch
from harness.images import png_bytes
from harness.waits import metric, until
from tests.support.api import (
    MSGPACK,
    encode_in_one_batch,
    encode_json,
    fetch_rows,
    held_device,
    reference,
    running_app,
    sha,
)


async def test_encode_then_fetch_equals_single_image_forward(service, tiny_tower):
    data = png_bytes(0, 96, 64)
    r = await encode_json(service, [{"data": data}])
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == tiny_tower.fingerprint
    (item,) = body["items"]
    assert item["status"] == "ready" and item["hash"] == sha(data)
    assert item["num_tokens"] == tiny_tower.layout(96, 64).num_tokens
    assert item["hidden_size"] == tiny_tower.hidden_size and item["dtype"] == "float32"
    rows = await fetch_rows(service, item["hash"])
    np.testing.assert_allclose(rows, reference(tiny_tower, data), rtol=0, atol=1e-5)
    part = await fetch_rows(service, item["hash"], 1, 3)
    np.testing.assert_array_equal(part, rows[1:3])


async def test_batched_mixed_resolutions_equal_single_image_forwards(service, tiny_tower, monkeypatch):
    """One request, several resolutions (and a repeat): every embedding equals its own single forward."""
    sizes = [(64, 64), (120, 80), (64, 64), (200, 56), (84, 140), (120, 80)]
    datas = [png_bytes(i + 10, w, h) for i, (w, h) in enumerate(sizes)]
    r = await encode_in_one_batch(service, [{"data": d} for d in datas], monkeypatch)
    assert r.status_code == 200, r.text
    assert [it["status"] for it in r.json()["items"]] == ["ready"] * len(datas)
    for d in datas:
        # fp32; packed attention is per image, so only summation order differs
        np.testing.assert_allclose(await fetch_rows(service, sha(d)), reference(tiny_tower, d), rtol=0, atol=1e-5)
    m = (await service.get("/metrics")).text
    assert metric(m, "visenc_encoded_images_total") == len(datas)
    assert metric(m, "visenc_forwards_total") < len(datas), "images were not batched"


async def test_hash_first_protocol(service):
    data = png_bytes(1, 64, 64)
    h = sha(data)
    r = await encode_json(service, [{"hash": h}])
    assert r.json()["items"][0]["status"] == "missing"
    assert (await service.get(f"/v1/embeddings/{h}")).status_code == 404
    r = await encode_json(service, [{"hash": h, "data": data}])
    assert r.json()["items"][0]["status"] == "ready"
    r = await encode_json(service, [{"hash": h}])
    assert r.json()["items"][0]["status"] == "ready"


async def test_hash_mismatch_rejected_and_nothing_stored(service):
    good, other = png_bytes(2, 64, 64), png_bytes(3, 64, 64)
    r = await encode_json(service, [{"hash": sha(good), "data": other}])
    assert r.status_code == 200
    item = r.json()["items"][0]
    assert item["status"] == "error" and item["reason"] == "hash_mismatch" and sha(other) in item["error"]
    r = await encode_json(service, [{"hash": sha(good)}])
    assert r.json()["items"][0]["status"] == "missing"
    assert (await service.get("/readyz")).status_code == 200


async def test_msgpack_wire(service, tiny_tower):
    data = png_bytes(4, 70, 90)
    r = await service.post("/v1/encode", content=msgpack.packb({"items": [{"data": data}]}), headers=MSGPACK)
    assert r.status_code == 200 and r.headers["content-type"] == "application/msgpack"
    (item,) = msgpack.unpackb(r.content)["items"]
    assert item["status"] == "ready" and item["hash"] == sha(data)
    n = item["num_tokens"]
    ranges = [
        {"hash": item["hash"], "start": 0, "end": 2},
        {"hash": item["hash"], "start": 2, "end": n},
        {"hash": "0" * 64},
    ]
    r = await service.post("/v1/embeddings/fetch", content=msgpack.packb({"ranges": ranges}), headers=MSGPACK)
    assert r.status_code == 200
    (hlen,) = struct.unpack_from("<I", r.content)
    meta = msgpack.unpackb(r.content[4 : 4 + hlen])["items"]
    payload = r.content[4 + hlen :]
    whole = reference(tiny_tower, data)
    for m, (s, e) in zip(meta[:2], [(0, 2), (2, n)]):
        got = np.frombuffer(payload[m["offset"] : m["offset"] + m["nbytes"]], "<f4").reshape(m["shape"])
        np.testing.assert_allclose(got, whole[s:e], atol=1e-5, rtol=0)
    assert meta[2]["status"] == 404


async def test_wait_false_returns_pending_handles_with_layout(service, tiny_tower):
    datas = [png_bytes(5 + i, 160, 120) for i in range(3)]
    r = await encode_json(service, [{"data": d} for d in datas], wait=False)
    items = r.json()["items"]
    assert all(it["status"] in ("pending", "ready") for it in items)
    assert any(it["status"] == "pending" for it in items)
    for it in items:
        assert it["num_tokens"] == tiny_tower.layout(160, 120).num_tokens
        assert it["grid_thw"] == list(tiny_tower.layout(160, 120).grid_thw)
    # fetch waits for the pending image and gets the right rows
    last = await fetch_rows(service, items[-1]["hash"])
    np.testing.assert_allclose(last, reference(tiny_tower, datas[-1]), atol=1e-5, rtol=0)


async def test_single_flight_concurrent_requests_one_forward(service):
    data = png_bytes(20, 128, 96)
    results = await asyncio.gather(*(encode_json(service, [{"data": data}]) for _ in range(8)))
    assert all(r.status_code == 200 and r.json()["items"][0]["status"] == "ready" for r in results)
    m = (await service.get("/metrics")).text
    assert metric(m, "visenc_encoded_images_total") == 1
    assert metric(m, "visenc_singleflight_joins_total") >= 1


async def test_namespaces_are_isolated(service):
    data = png_bytes(21, 64, 64)
    r = await encode_json(service, [{"data": data}], headers={"x-visenc-namespace": "tenant-a"})
    assert r.json()["items"][0]["status"] == "ready"
    r = await encode_json(service, [{"hash": sha(data)}], headers={"x-visenc-namespace": "tenant-b"})
    assert r.json()["items"][0]["status"] == "missing"
    r = await service.get(f"/v1/embeddings/{sha(data)}", headers={"x-visenc-namespace": "tenant-b"})
    assert r.status_code == 404


@pytest.mark.parametrize(
    ("body", "headers", "status"),
    [
        (b"\xc1\xff", MSGPACK, 400),  # malformed msgpack
        (b"{not json", {"content-type": "application/json"}, 422),
        (b"{}", {"content-type": "text/plain"}, 415),
        (b'{"items": []}', {"content-type": "application/json"}, 422),
        (b'{"items": [{"data": "not base64!"}]}', {"content-type": "application/json"}, 422),
    ],
)
async def test_bad_input_gets_4xx_and_service_stays_healthy(service, body, headers, status):
    r = await service.post("/v1/encode", content=body, headers=headers)
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"]
    assert (await service.get("/readyz")).status_code == 200


@pytest.mark.parametrize(
    ("item", "reason"),
    [
        ({"hash": "xyz"}, "invalid_hash"),
        ({"hash": "A" * 64}, "invalid_hash"),
        ({"data": b"hello"}, "invalid_image"),  # not an image
        ({"data": b""}, "invalid_image"),
        ({"data": png_bytes(23, 64, 64)[:200]}, "invalid_image"),  # truncated: found only when decoded
        ({"data": png_bytes(24, 64, 64), "hash": "0" * 64}, "hash_mismatch"),
    ],
)
async def test_a_bad_item_gets_its_own_error_and_the_others_proceed(service, item, reason):
    good = png_bytes(25, 64, 64)
    r = await encode_json(service, [{"data": good}, item, {"hash": sha(good)}])
    assert r.status_code == 200, r.text
    first, bad, again = r.json()["items"]
    assert first["status"] == "ready" and again["status"] == "ready"
    assert bad["status"] == "error" and bad["reason"] == reason and bad["error"]
    assert (await service.get("/readyz")).status_code == 200


async def test_bad_ranges_and_hashes(service):
    data = png_bytes(22, 64, 64)
    h = (await encode_json(service, [{"data": data}])).json()["items"][0]["hash"]
    assert (await service.get(f"/v1/embeddings/{h}", params={"start": 3, "end": 2})).status_code == 400
    assert (await service.get(f"/v1/embeddings/{h}", params={"end": 10**6})).status_code == 400
    assert (await service.get(f"/v1/embeddings/{h}", params={"start": -1})).status_code == 422
    assert (await service.get("/v1/embeddings/NOTAHASH")).status_code == 400
    empty = await service.get(f"/v1/embeddings/{h}", params={"start": 2, "end": 2})
    assert empty.status_code == 200 and empty.content == b""


async def test_cancelled_waiters_drop_queued_work(tiny_tower, monkeypatch):
    """A waiting request that goes away leaves no job, future or in-flight entry behind."""
    async with running_app(tiny_tower) as client:
        encoder = client.app.state.engine  # type: ignore[attr-defined]
        async with held_device(encoder, monkeypatch) as gate:
            tasks = [asyncio.create_task(encode_json(client, [{"data": png_bytes(40 + i, 64, 64)}])) for i in range(4)]
            await until(lambda: len(encoder.inflight.jobs) == 4, what="4 images admitted")
            assert len(encoder.inflight.jobs) == 4
            for t in tasks[:2]:
                t.cancel()
            await asyncio.gather(*tasks[:2], return_exceptions=True)
            gate.set()
            done = await asyncio.gather(*tasks[2:])
        assert all(r.json()["items"][0]["status"] == "ready" for r in done)
        await until(lambda: not encoder.inflight.jobs and encoder.scheduler.idle, what="the engine idle")
        assert encoder.inflight.jobs == {} and encoder.scheduler.idle and encoder.scheduler.staged_tokens == 0
        m = (await client.get("/metrics")).text
        assert metric(m, "visenc_encoded_images_total") == 2


async def test_metrics_model_and_health(service, tiny_tower):
    await encode_json(service, [{"data": png_bytes(50, 64, 64)}])
    m = (await service.get("/metrics")).text
    for name in [
        "visenc_encoded_images_total",
        "visenc_cache_lookups_total",
        "visenc_batch_size_images",
        "visenc_queue_depth",
        "visenc_requests_total",
        "visenc_model_info",
    ]:
        assert name in m, name
    assert 'visenc_cache_lookups_total{result="miss",tier="memory"}' in m
    assert (await service.get("/healthz")).status_code == 200
    info = (await service.get("/v1/model")).json()
    assert info["fingerprint"] == tiny_tower.fingerprint and info["hidden_size"] == tiny_tower.hidden_size


def test_bf16_rows_round_trip():
    from visenc.engine.outputs import raw_rows as _raw_rows
    from visenc_client.format import pack_entry, unpack_entry

    t = torch.randn(5, 8).to(torch.bfloat16)
    e = unpack_entry(
        bytes(pack_entry(_raw_rows(t), dtype="bfloat16", grid_thw=(1, 2, 2), fingerprint="f", hash="h").blob)
    )
    back = torch.frombuffer(bytearray(e.rows_view()), dtype=torch.bfloat16).reshape(5, 8)
    assert torch.equal(back, t)


async def test_include_rows_returns_the_embedding_inline(service, tiny_tower):
    datas = [png_bytes(60, 96, 64), png_bytes(61, 120, 80)]
    r = await service.post(
        "/v1/encode", json={"items": [{"data": base64.b64encode(d).decode()} for d in datas], "include_rows": True}
    )
    assert r.status_code == 200, r.text
    for item, data in zip(r.json()["items"], datas):
        rows = np.frombuffer(base64.b64decode(item["rows"]), "<f4").reshape(item["num_tokens"], -1)
        np.testing.assert_array_equal(rows, await fetch_rows(service, item["hash"]))
        np.testing.assert_allclose(rows, reference(tiny_tower, data), atol=1e-5, rtol=0)
    # msgpack carries them as raw bin; a hash-only miss has none
    body = {"items": [{"hash": sha(datas[0])}, {"hash": "0" * 64}], "include_rows": True}
    r = await service.post("/v1/encode", content=msgpack.packb(body), headers=MSGPACK)
    hit, miss = msgpack.unpackb(r.content)["items"]
    assert isinstance(hit["rows"], bytes) and len(hit["rows"]) == hit["num_tokens"] * hit["hidden_size"] * 4
    assert miss["status"] == "missing" and miss.get("rows") is None
