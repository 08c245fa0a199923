"""Tenants on the served engine: a class per request (header or field), quotas that refuse only the offender
with Retry-After, a global limit that sheds the tenant holding the most, and a client that goes away freeing
its tenant's share at once."""

from __future__ import annotations

import asyncio

from harness.images import png_bytes
from harness.waits import metric, until
from tests.support.api import b64, encode_json, held_device, running_app, sha

A, B = {"x-visenc-namespace": "a"}, {"x-visenc-namespace": "b"}


def queued(encoder, tenant: str) -> list:
    return [j for j in encoder.scheduler.backlog() if j.account is not None and j.account.tenant == tenant]


async def test_priority_by_header_or_field_and_bad_values_are_4xx(tiny_tower, monkeypatch):
    async with running_app(tiny_tower) as client:
        encoder = client.app.state.engine
        async with held_device(encoder, monkeypatch):
            imgs = [png_bytes(700 + i, 28, 28) for i in range(3)]
            await encode_json(client, [{"data": imgs[0]}], wait=False, headers={"x-visenc-priority": "batch"})
            r = await client.post("/v1/encode", json={"items": [{"data": b64(imgs[1])}], "wait": False,
                                                      "priority": "batch"})  # fmt: skip
            assert r.status_code == 200, r.text
            await encode_json(client, [{"data": imgs[2]}], wait=False)
            classes = sorted(j.priority for j in encoder.scheduler.backlog())
            assert classes == ["batch", "batch", "interactive"]
            r = await encode_json(client, [{"data": imgs[0]}], wait=False, headers={"x-visenc-priority": "urgent"})
            assert r.status_code == 400 and "X-Visenc-Priority must be one of interactive, batch" in r.text
            r = await client.post("/v1/encode", json={"items": [{"data": b64(imgs[0])}], "priority": "urgent"})
            assert r.status_code == 422 and "priority" in r.text
            doc = (await client.get("/openapi.json")).json()
            params = {p["name"]: p for p in doc["paths"]["/v1/encode"]["post"]["parameters"]}
            assert params["X-Visenc-Priority"]["schema"]["enum"] == ["interactive", "batch"]
            # an interactive request joining a batch image makes it interactive
            await encode_json(client, [{"data": imgs[0]}], wait=False)
            assert sorted(j.priority for j in encoder.scheduler.backlog()) == ["batch", "interactive", "interactive"]


async def test_a_tenant_over_its_quota_gets_429_and_the_other_is_unaffected(tiny_tower, monkeypatch):
    async with running_app(tiny_tower, tenant=["a max_images=2"], tenant_max_queued_tokens=10**6) as client:
        encoder = client.app.state.engine
        async with held_device(encoder, monkeypatch) as gate:
            a = [png_bytes(710 + i, 28, 28) for i in range(4)]
            b = [png_bytes(720 + i, 28, 28) for i in range(4)]
            r = await encode_json(client, [{"data": x} for x in a[:2]], wait=False, headers=A)
            assert r.status_code == 200
            r = await encode_json(client, [{"data": a[2]}], wait=False, headers=A)
            assert r.status_code == 429 and r.headers["retry-after"].isdigit()
            assert "max_images=2" in r.json()["error"]["message"]
            r = await encode_json(client, [{"data": x} for x in b], wait=False, headers=B)
            assert r.status_code == 200 and len(queued(encoder, "b")) == 4
            gate.set()
            await until(lambda: not encoder.inflight.jobs)
        # nothing admitted was lost: every admitted image was encoded, once
        for x in [*a[:2], *b]:
            r = await encode_json(client, [{"hash": sha(x)}], headers=A if x in a else B)
            assert r.json()["items"][0]["status"] == "ready"
        m = (await client.get("/metrics")).text
        assert metric(m, "visenc_encoded_images_total") == 6
        assert metric(m, "visenc_refusals_total", tenant="a", reason="tenant_images") == 1
        assert metric(m, "visenc_refusals_total", tenant="b", reason="tenant_images") == 0


async def test_a_full_queue_sheds_the_tenant_holding_the_most(tiny_tower, monkeypatch):
    async with running_app(tiny_tower, max_queue_images=4) as client:
        encoder = client.app.state.engine
        async with held_device(encoder, monkeypatch):
            a = [png_bytes(730 + i, 28, 28) for i in range(5)]
            r = await encode_json(client, [{"data": x} for x in a[:4]], wait=False, headers=A)
            assert r.status_code == 200
            r = await encode_json(client, [{"data": a[4]}], wait=False, headers=A)
            assert r.status_code == 429 and "tenant 'a' holds 4" in r.text
            r = await encode_json(client, [{"data": png_bytes(740, 28, 28)}], wait=False, headers=B)
            assert r.status_code == 200  # the newest request is b's: b is not the one shed


async def test_a_client_going_away_frees_its_tenants_share_and_quota_at_once(tiny_tower, monkeypatch):
    async with running_app(tiny_tower, tenant=["a max_images=3"]) as client:
        encoder = client.app.state.engine
        async with held_device(encoder, monkeypatch):
            a = [png_bytes(750 + i, 28, 28) for i in range(3)]
            task = asyncio.create_task(encode_json(client, [{"data": x} for x in a], headers=A))
            account = encoder.tenants.account("a")
            await until(lambda: account.images == 3)
            assert (
                await encode_json(client, [{"data": png_bytes(760, 28, 28)}], wait=False, headers=A)
            ).status_code == 429
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            # the device is still held: nothing ran, yet the tenant holds nothing and its work left the queue
            assert (account.images, account.queued, account.tokens) == (0, 0, 0)
            assert queued(encoder, "a") == []
            r = await encode_json(client, [{"data": png_bytes(760, 28, 28)}], wait=False, headers=A)
            assert r.status_code == 200


async def test_the_client_and_the_vllm_connector_can_set_the_class(tiny_tower, monkeypatch):
    import httpx
    import pytest

    from visenc_client import AsyncClient
    from visenc_client._vllm_config import ConnectorOptions

    async with running_app(tiny_tower) as client:
        encoder = client.app.state.engine
        async with held_device(encoder, monkeypatch):
            transport = httpx.ASGITransport(app=client.app)
            async with AsyncClient("http://visenc", transport=transport, priority="batch") as batch:
                await batch.encode([png_bytes(770, 28, 28)], wait=False)
            assert [j.priority for j in encoder.scheduler.backlog()] == ["batch"]

    class Extra:
        def __init__(self, **options):
            self.options = options

        def get_from_extra_config(self, key, default):
            return self.options.get(key, default)

    assert ConnectorOptions.read(Extra()).priority == "interactive"
    assert ConnectorOptions.read(Extra(priority="batch")).priority == "batch"
    with pytest.raises(ValueError, match="priority must be 'interactive' or 'batch'"):
        ConnectorOptions.read(Extra(priority="urgent"))


async def test_a_request_over_the_quota_of_an_idle_tenant_runs_whole_across_its_waves(tiny_tower, monkeypatch):
    # taken in waves of 1, 2, 4 uploads: the second wave must not be refused for the first wave's images
    async with running_app(tiny_tower, tenant=["a max_images=2"]) as client:
        encoder = client.app.state.engine
        async with held_device(encoder, monkeypatch) as gate:
            a = [png_bytes(780 + i, 28, 28) for i in range(5)]
            r = await encode_json(client, [{"data": x} for x in a[:4]], wait=False, headers=A)
            assert r.status_code == 200, r.text
            assert [it["status"] for it in r.json()["items"]] == ["pending"] * 4
            r = await encode_json(client, [{"data": a[4]}], wait=False, headers=A)
            assert r.status_code == 429 and "has 4 images in flight" in r.text
            gate.set()
            await until(lambda: not encoder.inflight.jobs)


async def test_requests_admitted_while_their_place_is_asked_count_against_the_quota(tiny_tower, monkeypatch, redis_url):
    # with a shared index, an admitted request asks Redis where to encode before its jobs exist: a request
    # admitted meanwhile must see it
    async with running_app(tiny_tower, tenant=["a max_images=2"], redis_url=redis_url) as client:
        encoder = client.app.state.engine
        async with held_device(encoder, monkeypatch) as gate:
            imgs = [png_bytes(790 + i, 56, 56) for i in range(8)]
            rs = await asyncio.gather(*(encode_json(client, [{"data": x}], wait=False, headers=A) for x in imgs))
            assert sorted(r.status_code for r in rs) == [200, 200, *[429] * 6]
            assert encoder.tenants.account("a").images == 2
            gate.set()
            await until(lambda: not encoder.inflight.jobs)
        assert encoder.tenants.account("a").images == 0
