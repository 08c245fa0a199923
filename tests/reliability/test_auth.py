"""API keys, tenant isolation, and secrets that never reach a log."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
from harness.images import png_bytes
from harness.processes import redis_process, serve_subprocess
from harness.waits import metric
from tests.support.api import encode_json, running_app, sha

from visenc.api import auth
from visenc.api.auth import ApiKeyError, load_api_keys, tenant_of
from visenc.bootstrap import create_app
from visenc.config import Settings
from visenc_client import Client, NotFoundError

KEY_A, KEY_B = "sk-tenant-a-0123456789abcdef", "sk-tenant-b-fedcba9876543210"
KEYS = f"{KEY_A}:tenant-a,{KEY_B}:tenant-b"
A = {"authorization": f"Bearer {KEY_A}"}
B = {"authorization": f"Bearer {KEY_B}"}


@pytest.fixture
async def authed(tiny_tower):
    async with running_app(tiny_tower, api_keys=KEYS) as client:
        yield client


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"authorization": "Bearer sk-nope-0123456789abcdef"},
        {"authorization": f"Basic {KEY_A}"},
        {"authorization": "Bearer "},
        {"authorization": KEY_A},
    ],
)
async def test_v1_needs_a_valid_key(authed, headers):
    for method, path in [
        ("POST", "/v1/encode"),
        ("GET", f"/v1/embeddings/{'0' * 64}"),
        ("POST", "/v1/embeddings/fetch"),
        ("GET", "/v1/model"),
    ]:
        r = await authed.request(method, path, json={"items": [{"hash": "0" * 64}]}, headers=headers)
        assert r.status_code == 401, (path, r.text)
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert r.json()["error"]["kind"] == "unauthorized"


async def test_probes_and_metrics_stay_open(authed):
    for path in ["/healthz", "/readyz", "/metrics", "/openapi.json"]:
        assert (await authed.get(path)).status_code == 200, path
    doc = (await authed.get("/openapi.json")).json()
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert doc["paths"]["/v1/encode"]["post"]["security"] == [{"bearer": []}]
    assert "401" in doc["paths"]["/v1/encode"]["post"]["responses"]


async def test_tenants_cannot_see_each_others_images(authed):
    data, never = png_bytes(900, 28, 28), png_bytes(901, 28, 28)
    r = await encode_json(authed, [{"data": data}], headers=A)
    assert r.json()["items"][0]["status"] == "ready"
    # B asking for A's image gets exactly what it gets for an image nobody ever sent
    for headers in (B, {**B, "x-visenc-namespace": "tenant-a"}):  # the header cannot pick a tenant
        seen = await encode_json(authed, [{"hash": sha(data)}], headers=headers)
        unseen = await encode_json(authed, [{"hash": sha(never)}], headers=headers)
        assert seen.status_code == unseen.status_code == 200
        assert {**seen.json()["items"][0], "hash": None} == {**unseen.json()["items"][0], "hash": None}
        assert seen.json()["items"][0]["status"] == "missing"
        r = await authed.get(f"/v1/embeddings/{sha(data)}", headers=headers)
        assert r.status_code == 404
        assert r.json() == {"error": {"kind": "not_found", "message": r.json()["error"]["message"]}}
    r = await encode_json(authed, [{"hash": sha(data)}], headers=A)
    assert r.json()["items"][0]["status"] == "ready"


async def test_no_single_flight_across_tenants(authed):
    """Two tenants sending the same new image at once each get their own encode: B never joins
    A's in-flight job, so B's latency cannot tell that A is encoding the same image."""
    data = png_bytes(902, 56, 28)
    ra, rb = await asyncio.gather(
        encode_json(authed, [{"data": data}], headers=A), encode_json(authed, [{"data": data}], headers=B)
    )
    assert ra.json()["items"][0]["status"] == rb.json()["items"][0]["status"] == "ready"
    m = (await authed.get("/metrics")).text
    assert metric(m, "visenc_encoded_images_total") == 2
    assert metric(m, "visenc_singleflight_joins_total") == 0


def test_keys_file_and_validation(tmp_path):
    f = tmp_path / "keys"
    f.write_text(f"# tenants\n{KEY_A}:tenant-a\n\n{KEY_B} : tenant-b  # ops\n")
    keys = load_api_keys(Settings(api_keys_file=f))
    assert sorted(keys.values()) == ["tenant-a", "tenant-b"]
    assert tenant_of(keys, KEY_B) == "tenant-b" and tenant_of(keys, KEY_B[:-1]) is None
    for bad in ["short:tenant", f"{KEY_A}:bad/tenant", f"{KEY_A}", f"{KEY_A}:t1,{KEY_A}:t2", " , "]:
        with pytest.raises(ApiKeyError) as e:
            create_app(Settings(api_keys=bad))
        assert KEY_A not in str(e.value)
    with pytest.raises(ApiKeyError):
        load_api_keys(Settings(api_keys_file=tmp_path / "missing"))


def test_every_key_is_compared(monkeypatch):
    """No early exit: a match on the first key costs as many comparisons as no match at all."""
    keys = load_api_keys(Settings(api_keys=KEYS))
    calls = []
    real = auth.hmac.compare_digest
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    for presented in [KEY_A, KEY_B, "sk-unknown-0123456789abcdef"]:
        calls.clear()
        tenant_of(keys, presented)
        assert len(calls) == len(keys)


async def test_no_secret_is_logged_in_process(tiny_tower, caplog):
    password = "redis-pass-3f9a1c7e"
    caplog.set_level(logging.DEBUG)
    settings = Settings(api_keys=KEYS, redis_url=f"redis://:{password}@127.0.0.1:1/0", log_level="debug")
    assert password not in repr(settings) and KEY_A not in repr(settings) and KEY_A not in str(settings.redacted())
    async with running_app(tiny_tower, api_keys=KEYS, log_level="debug") as client:
        await encode_json(client, [{"data": png_bytes(903, 28, 28)}], headers=A)
        await encode_json(client, [{"hash": "0" * 64}], headers={"authorization": f"Bearer {KEY_A}x"})
        await client.get("/v1/model", headers=B)
    text = caplog.text + "".join(str(r.args) for r in caplog.records)
    assert "API keys on: 2 keys" in text  # start-up did log (at info), just not the keys
    for secret in (KEY_A, KEY_B, password):
        assert secret not in text


def test_real_server_with_keys_and_a_password_protected_redis(tmp_path):
    """End to end at debug level: the client's api_key works, tenants are apart, the log holds no secret."""
    password = "redis-pass-8d2e5b61"
    log = tmp_path / "serve.log"
    with redis_process(None, "--requirepass", password) as (redis_url, _):
        url_with_password = redis_url.replace("redis://", f"redis://:{password}@")
        env = {"VISENC_API_KEYS": KEYS, "VISENC_REDIS_URL": url_with_password}
        with serve_subprocess("--log-level", "debug", "--max-wait-ms", "1", log=log, env=env) as (url, _):
            data = png_bytes(904, 28, 28)
            with Client(url, api_key=KEY_A) as a, Client(url, api_key=KEY_B) as b:
                (h,) = a.encode([data])
                assert a.fetch(h).shape == (h.num_tokens, h.hidden_size)
                with pytest.raises(NotFoundError):
                    b.fetch(h.hash)
            assert httpx.post(f"{url}/v1/encode", json={"items": [{"hash": h.hash}]}).status_code == 401
    text = log.read_text()
    assert "API keys on" in text
    for secret in (KEY_A, KEY_B, password):
        assert secret not in text
