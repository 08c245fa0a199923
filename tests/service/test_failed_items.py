"""Every failed item is counted by its reason, and a 404 says whether the service ever held the image."""

from __future__ import annotations

import pytest
from harness.images import png_bytes
from harness.waits import metric
from tests.support.api import encode_json, fetch_rows, running_app, sha


async def _counts(service, reason: str) -> tuple[float, float]:
    text = (await service.get("/metrics")).text
    return metric(text, "visenc_errors_total", kind=reason), metric(text, "visenc_failed_items_total", reason=reason)


@pytest.mark.parametrize("wait", [False, True])
async def test_each_item_answered_error_is_counted_by_its_reason(service, wait):
    """An item answered ``error`` counts in both counters; a truncated image is found only when decoded, so
    without ``wait`` it is answered ``pending`` and its error is answered (and counted) to whoever fetches it."""
    truncated = png_bytes(41, 64, 64)[:200]
    items = [{"data": b"not an image"}, {"data": png_bytes(40, 64, 64)}, {"data": b""}, {"data": truncated}]
    items += [{"data": png_bytes(42, 64, 64), "hash": "0" * 64}]
    before = {r: await _counts(service, r) for r in ("invalid_image", "hash_mismatch")}
    r = await encode_json(service, items, wait=wait)
    assert r.status_code == 200, r.text
    late = None if not wait else "invalid_image"
    assert [it.get("reason") for it in r.json()["items"]] == [
        "invalid_image",
        None,
        "invalid_image",
        late,
        "hash_mismatch",
    ]
    after = {r: await _counts(service, r) for r in ("invalid_image", "hash_mismatch")}
    answered = 3 if wait else 2
    assert after["invalid_image"] == tuple(n + answered for n in before["invalid_image"])
    assert after["hash_mismatch"] == tuple(n + 1 for n in before["hash_mismatch"])
    if not wait:
        fetched = await service.get(f"/v1/embeddings/{sha(truncated)}")
        assert fetched.status_code == 400 and fetched.json()["error"]["kind"] == "invalid_image", fetched.text
        errors, items_failed = await _counts(service, "invalid_image")
        assert (errors, items_failed) == (after["invalid_image"][0] + 1, after["invalid_image"][1])


async def test_a_404_says_whether_the_image_was_evicted_or_never_encoded(service):
    first, second = png_bytes(43, 64, 64), png_bytes(44, 64, 64)
    never = await service.get(f"/v1/embeddings/{sha(first)}")
    assert never.status_code == 404 and "never encoded here" in never.json()["error"]["message"]
    assert (await encode_json(service, [{"data": first}])).json()["items"][0]["status"] == "ready"
    await fetch_rows(service, sha(first))  # read: no longer pinned for its caller
    local = service.app.state.engine.index.local  # type: ignore[attr-defined]
    local.max_bytes = local.bytes  # room for one entry: the next one evicts the first
    assert (await encode_json(service, [{"data": second}])).json()["items"][0]["status"] == "ready"
    gone = await service.get(f"/v1/embeddings/{sha(first)}")
    assert gone.status_code == 404, gone.text
    message = gone.json()["error"]["message"]
    assert "evicted: the memory index was full" in message and "encode it again" in message
    # encoded again, it is found again, and a later 404 would no longer say evicted for a held entry
    local.max_bytes *= 4
    assert (await encode_json(service, [{"data": first}])).json()["items"][0]["status"] == "ready"
    assert local.gone(next(k for k in local._order if k.endswith(sha(first)))) is None


async def test_with_redis_a_failed_image_is_answered_its_error_not_another_replicas(redis_url, tiny_tower):
    """The queued mark of an image whose bytes failed here outlives it in Redis: a fetch answers the
    item's error, not a wait for "another replica that did not finish"."""
    truncated = png_bytes(45, 64, 64)[:200]
    async with running_app(tiny_tower, redis_url=redis_url) as app:
        r = await encode_json(app, [{"data": truncated}], wait=True)
        assert r.json()["items"][0]["reason"] == "invalid_image", r.text
        fetched = await app.get(f"/v1/embeddings/{sha(truncated)}")
        assert fetched.status_code == 400 and fetched.json()["error"]["kind"] == "invalid_image", fetched.text
