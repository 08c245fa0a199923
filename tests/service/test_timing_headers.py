"""``X-Visenc-Queue-Time`` / ``X-Visenc-Encode-Time`` agree with the engine's own histograms."""

from __future__ import annotations

import asyncio
import time

import pytest
from harness.images import png_bytes
from harness.waits import metric, until
from tests.support.api import encode_json, held_device, running_app

pytestmark = pytest.mark.serial  # queue waits compared to the microsecond: a busy second core skews them


#: how much later the second request asks for the image the first is waiting for
LATER_S = 0.3


def timings(r) -> tuple[float, float]:
    assert r.status_code == 200, r.text
    return float(r.headers["x-visenc-queue-time"]), float(r.headers["x-visenc-encode-time"])


async def scrape(client) -> str:
    return (await client.get("/metrics")).text


@pytest.mark.parametrize("batch_images", [64, 1])  # one shared forward, or one forward per image
async def test_timing_headers_match_the_forwards_this_request_waited_for(tiny_tower, batch_images):
    images = [png_bytes(900 + i, 64 + 28 * i, 64) for i in range(3)]
    async with running_app(tiny_tower, max_batch_images=batch_images) as client:
        before = await scrape(client)
        t0 = time.perf_counter()
        r = await encode_json(client, [{"data": d} for d in images])
        wall_s = time.perf_counter() - t0
        queue_s, encode_s = timings(r)
        after = await scrape(client)

        forwards = metric(after, "visenc_forwards_total") - metric(before, "visenc_forwards_total")
        forward_sum = metric(after, "visenc_forward_seconds_sum") - metric(before, "visenc_forward_seconds_sum")
        wait_count = metric(after, "visenc_queue_wait_seconds_count") - metric(
            before, "visenc_queue_wait_seconds_count"
        )
        wait_sum = metric(after, "visenc_queue_wait_seconds_sum") - metric(before, "visenc_queue_wait_seconds_sum")
        # (with room for all three, images whose preprocessing finished late may still form a 2nd batch)
        assert 1 <= forwards <= 3 if batch_images > 1 else forwards == 3
        assert wait_count == 3
        # the only request in flight: its encode time is exactly the forwards the engine timed
        assert encode_s == pytest.approx(forward_sum, abs=2e-6)
        assert 0 < encode_s <= wall_s
        assert 0 < queue_s <= wall_s
        # all three were admitted together: the header is the longest of their three queue waits
        assert wait_sum / 3 - 2e-6 <= queue_s <= wait_sum + 2e-6
        if batch_images == 1:  # one forward each, one after another: the last one's wait is the longest
            assert queue_s > wait_sum / 3

        # all hits (bytes resent, or hash only): nothing waited, nothing ran
        for items in ([{"data": d} for d in images], [{"hash": h["hash"]} for h in r.json()["items"]]):
            assert timings(await encode_json(client, items)) == (0.0, 0.0)

        # wait=false answers before any forward: the headers are present and zero
        r = await encode_json(client, [{"data": png_bytes(950, 96, 64)}], wait=False)
        assert timings(r) == (0.0, 0.0)


async def test_a_request_joining_an_image_in_flight_counts_its_wait_from_its_own_admission(tiny_tower, monkeypatch):
    data = png_bytes(960, 64, 64)
    async with running_app(tiny_tower) as client:
        engine = client.app.state.engine
        before = await scrape(client)
        async with held_device(engine, monkeypatch) as gate:
            first = asyncio.create_task(encode_json(client, [{"data": data}]))
            await until(lambda: len(engine.scheduler._ready) == 1)
            await asyncio.sleep(LATER_S)
            second = asyncio.create_task(encode_json(client, [{"data": data}]))
            await until(lambda: [j.interest for j in engine.inflight.jobs.values()] == [2], what="the second joining")
            gate.set()
            queue_a, _ = timings(await first)
            queue_b, _ = timings(await second)
        after = await scrape(client)
        wait_count = metric(after, "visenc_queue_wait_seconds_count") - metric(
            before, "visenc_queue_wait_seconds_count"
        )
        wait_sum = metric(after, "visenc_queue_wait_seconds_sum") - metric(before, "visenc_queue_wait_seconds_sum")
        assert wait_count == 1  # one image, one wait: the first request's
        assert queue_a == pytest.approx(wait_sum, abs=2e-6)
        assert 0 < queue_b <= queue_a - LATER_S  # the second waited only from its own admission
