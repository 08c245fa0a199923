"""Bounded queue (429 + Retry-After), deadlines (504), and cancellation that leaves nothing behind."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import httpx
import pytest
from harness.images import png_bytes
from harness.processes import serve_subprocess
from harness.waits import metric, until, wait_until
from tests.support.api import b64, encode_json, held_device, running_app, sha
from tests.support.serve_faulty import launcher as faulty


def assert_no_leaks(encoder) -> None:
    assert encoder.inflight.jobs == {}
    assert encoder.scheduler.depth == 0 and encoder.scheduler.staged_tokens == 0
    assert not encoder.outputs.pending_writes  # write-behind tasks all finished


async def test_full_queue_answers_429_with_retry_after(tiny_tower, monkeypatch):
    async with running_app(tiny_tower, max_queue_images=2) as client:
        encoder = client.app.state.engine
        async with held_device(encoder, monkeypatch) as gate:
            a, b, c = (png_bytes(300 + i, 28, 28) for i in range(3))
            r = await encode_json(client, [{"data": a}, {"data": b}], wait=False)
            assert r.status_code == 200, r.text
            assert [it["status"] for it in r.json()["items"]] == ["pending", "pending"]
            r = await encode_json(client, [{"data": c}], wait=False)
            assert r.status_code == 429
            assert r.headers["retry-after"] == "1"
            assert "max_queue_images=2" in r.json()["error"]["message"]
            # joining work already queued, or a hash-only lookup, adds nothing: still admitted
            r = await encode_json(client, [{"data": a}, {"hash": sha(c)}], wait=False)
            assert [it["status"] for it in r.json()["items"]] == ["pending", "missing"]
            assert encoder.scheduler.depth == 2  # memory stayed bounded: the refused image was not queued
            gate.set()
            rows = await client.get(f"/v1/embeddings/{sha(a)}")
            assert rows.status_code == 200
        await until(lambda: not encoder.inflight.jobs)
        r = await encode_json(client, [{"data": c}])
        assert r.json()["items"][0]["status"] == "ready"


async def test_encode_deadline_504_and_the_work_is_released(tiny_tower, monkeypatch):
    async with running_app(tiny_tower, request_timeout_s=0.3, fetch_timeout_s=0.3) as client:
        encoder = client.app.state.engine
        async with held_device(encoder, monkeypatch):
            data = png_bytes(310, 28, 28)
            t0 = time.monotonic()
            r = await encode_json(client, [{"data": data}])
            assert r.status_code == 504 and "request_timeout_s=0.3" in r.json()["error"]["message"]
            assert time.monotonic() - t0 < 3
            # nobody waits any more: the queued image is dropped, not left for the device
            await until(lambda: not encoder.inflight.jobs)
            assert encoder.scheduler.depth == 0
            # a fetch of a pending image has its own deadline
            await encode_json(client, [{"data": data}], wait=False)
            r = await client.get(f"/v1/embeddings/{sha(data)}")
            assert r.status_code == 504 and "fetch_timeout_s=0.3" in r.json()["error"]["message"]
        m = (await client.get("/metrics")).text
        assert metric(m, "visenc_cancelled_images_total") == 1
        assert metric(m, "visenc_requests_total", endpoint="/v1/encode", status="504") == 1


async def test_many_concurrent_requests_cancel_half_rest_succeed_nothing_leaks(tiny_tower, monkeypatch):
    """30 requests of [own image, one of 5 shared images]; the even ones are cancelled while queued.

    The odd ones all succeed; each shared image is encoded once for everyone still waiting; the
    images only cancelled requests wanted are never encoded; the single-flight map, the queue,
    the staged budget, the waiters gauge and the background tasks all drain to empty."""
    async with running_app(tiny_tower, max_batch_images=8, request_timeout_s=30) as client:
        encoder = client.app.state.engine
        own = [png_bytes(400 + k, 28, 28) for k in range(30)]
        shared = [png_bytes(500 + j, 56, 28) for j in range(5)]
        async with held_device(encoder, monkeypatch) as gate:
            tasks = [
                asyncio.create_task(encode_json(client, [{"data": own[k]}, {"data": shared[k % 5]}])) for k in range(30)
            ]
            # every request has joined its two images (a request still reading its body would make
            # a new job for a shared image whose old one the cancellations dropped)
            await until(lambda: sum(j.interest for j in encoder.inflight.jobs.values()) == 60)
            assert len(encoder.inflight.jobs) == 35
            for t in tasks[::2]:
                t.cancel()
            cancelled = await asyncio.gather(*tasks[::2], return_exceptions=True)
            assert all(isinstance(r, asyncio.CancelledError) for r in cancelled)
            # every image only the cancelled requests wanted is gone before any forward ran
            await until(lambda: len(encoder.inflight.jobs) == 20)
            gate.set()
            survivors = await asyncio.gather(*tasks[1::2])
        for r in survivors:
            assert r.status_code == 200 and [it["status"] for it in r.json()["items"]] == ["ready", "ready"]
        await until(lambda: not encoder.inflight.jobs and not encoder.outputs.pending_writes)
        assert_no_leaks(encoder)
        m = (await client.get("/metrics")).text
        assert metric(m, "visenc_encoded_images_total") == 15 + 5
        assert metric(m, "visenc_cancelled_images_total") == 15
        assert metric(m, "visenc_singleflight_waiting") == 0
        for k in range(0, 30, 2):  # what was dropped is not cached: a later request encodes it
            r = await encode_json(client, [{"hash": sha(own[k])}])
            assert r.json()["items"][0]["status"] == "missing"


def test_client_disconnect_cancels_its_queued_work(tmp_path):
    """With a real uvicorn: a client that closes its connection mid-wait has its queued image dropped.

    The device is busy for ~2 s with image X (injected delay, one image per forward); image Y's
    request is queued behind it and its client gives up after 0.5 s. Without disconnect detection
    Y would stay wanted until request_timeout_s and be encoded when the device frees up."""
    with serve_subprocess(
        "--max-batch-images",
        "1",
        "--max-wait-ms",
        "1",
        log=tmp_path / "serve.log",
        launcher=faulty("--forward-delay-s", "2"),
    ) as (url, _):
        x, y = png_bytes(600, 28, 28), png_bytes(601, 28, 28)
        with httpx.Client(base_url=url, timeout=30) as http:
            import threading

            result: dict[str, httpx.Response] = {}
            first = threading.Thread(
                target=lambda: result.setdefault("x", http.post("/v1/encode", json={"items": [{"data": b64(x)}]}))
            )
            first.start()
            wait_until(lambda: metric(http.get("/metrics").text, "visenc_inflight_images") == 1, 10, "X admitted")
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{url}/v1/encode", json={"items": [{"data": b64(y)}]}, timeout=0.5)
            first.join(30)
            assert result["x"].status_code == 200

            def settled() -> bool:
                m = http.get("/metrics").text
                return metric(m, "visenc_inflight_images") == 0 and metric(m, "visenc_queue_depth") == 0

            wait_until(settled, 10, "nothing in flight or queued")
            m = http.get("/metrics").text
            assert metric(m, "visenc_encoded_images_total") == 1  # only X
            assert metric(m, "visenc_cancelled_images_total") == 1  # Y, dropped before its forward
            assert metric(m, "visenc_requests_total", endpoint="/v1/encode", status="499") == 1
            r = http.post("/v1/encode", json={"items": [{"hash": sha(y)}]})
            assert r.json()["items"][0]["status"] == "missing"


def recording_inspect(encoder, monkeypatch, block_at: int | None = None) -> tuple[list[int], threading.Event]:
    """Record, at each upload's inspection, how many jobs the engine has in flight; the
    ``block_at``-th inspection (0-based) waits for the returned event first."""
    seen: list[int] = []
    release = threading.Event()
    real = encoder.intake.prep.inspect

    def inspect(data, given):
        seen.append(len(encoder.inflight.jobs))
        if len(seen) - 1 == block_at:
            release.wait(10)
        return real(data, given)

    monkeypatch.setattr(encoder.intake.prep, "inspect", inspect)
    return seen, release


async def test_a_big_requests_first_images_start_before_its_last_are_inspected(tiny_tower, monkeypatch):
    """Intake takes a request in waves ending after 1, 2, 4, ... uploads: each wave is admitted
    and started before the next is inspected."""
    async with running_app(tiny_tower) as client:
        encoder = client.app.state.engine
        seen, _ = recording_inspect(encoder, monkeypatch)
        datas = [png_bytes(900 + i, 28, 28) for i in range(8)]
        async with held_device(encoder, monkeypatch) as gate:
            r = await encode_json(client, [{"data": d} for d in datas], wait=False)
            assert [it["status"] for it in r.json()["items"]] == ["pending"] * 8
            # waves [0], [1, 2], [3..6], [7]: in flight when each upload was inspected
            assert seen == [0, 1, 1, 3, 3, 3, 3, 7]
            gate.set()
        for d in datas:
            assert (await client.get(f"/v1/embeddings/{sha(d)}")).status_code == 200
        await until(lambda: not encoder.inflight.jobs)
        assert_no_leaks(encoder)


async def test_a_request_that_may_not_fit_is_one_wave_and_refused_before_any_of_it_starts(tiny_tower, monkeypatch):
    async with running_app(tiny_tower, max_queue_images=3) as client:
        encoder = client.app.state.engine
        seen, _ = recording_inspect(encoder, monkeypatch)
        async with held_device(encoder, monkeypatch):
            r = await encode_json(client, [{"data": png_bytes(920 + i, 28, 28)} for i in range(4)], wait=False)
            assert r.status_code == 429
            assert seen == [0, 0, 0, 0] and encoder.scheduler.depth == 0 and not encoder.inflight.jobs


async def test_a_request_abandoned_between_waves_releases_what_its_first_waves_started(tiny_tower, monkeypatch):
    async with running_app(tiny_tower) as client:
        encoder = client.app.state.engine
        seen, release = recording_inspect(encoder, monkeypatch, block_at=3)  # the first upload of wave 3
        datas = [png_bytes(930 + i, 28, 28) for i in range(6)]
        async with held_device(encoder, monkeypatch):
            task = asyncio.create_task(encode_json(client, [{"data": d} for d in datas], wait=True))
            await until(lambda: len(seen) >= 4)
            assert len(encoder.inflight.jobs) == 3  # waves 1 and 2 started
            task.cancel()  # the client goes away while wave 3 is inspected
            with contextlib.suppress(asyncio.CancelledError):
                await task
            release.set()
            await until(lambda: not encoder.inflight.jobs)  # nobody wants them: dropped, not encoded
        assert_no_leaks(encoder)
        assert metric((await client.get("/metrics")).text, "visenc_forwards_total") == 0
