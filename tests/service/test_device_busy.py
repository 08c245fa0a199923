"""The device never waits: on the simulated device (``models/sim.py``), the device thread takes its
batches itself while the event loop is blocked, and launches each forward before the one before it
ends (no host sync, no serial step between forwards); each forward's rows are on the host before the
next forward ends (no wait for the whole device in the copy out); preprocessing threads hand their
images to the device without the loop. Its busy share under load: ``bench/bench_device_busy.py``."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
from harness.images import png_bytes
from harness.waits import until
from tests.support.api import encode_json, fetch_rows, held_device, running_app, sha

from visenc.imaging.decode import decode
from visenc.models import sim

pytestmark = pytest.mark.serial  # a forward's 1 ms launch budget: a test on the other core breaks it

IMAGES = 16
#: 4 images a forward, 64 tokens each, 400 us a token: 102 ms of device time a forward, 1 ms launch (the host
#: has that long to take and launch the next one, on a loaded CI host too)
SPEC = "sim:launch_ms=1,token_us=400,patch=16,hidden=8"
#: 64 ms of device time an image: preprocessing keeps ahead of the device, also on a loaded host
SLOW_SPEC = "sim:launch_ms=1,token_us=1000,patch=16,hidden=8"
#: far past the 4 forwards' device time: reached only when the device needs the event loop
BLOCKED_LIMIT_S = 20.0


def block_the_loop_until(done, limit_s: float) -> bool:
    """Hold the event loop's thread (its GIL released) until ``done()`` or ``limit_s``: whether done."""
    deadline = time.monotonic() + limit_s
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def assert_never_drained(spans: list[sim.Span]) -> None:
    """Each forward was launched while the one before it ran: the device never drained between them."""
    drained = [b.start - a.end for a, b in itertools.pairwise(spans) if b.start > a.end]
    assert not drained, f"the device idled between forwards: {drained} s (a host sync or a serial step)"


def assert_copied_before_the_next_forward_ends(tower: sim.SimTower, spans: list[sim.Span]) -> None:
    """A copy out waits for its own forward's event only: its rows land while the next forward runs."""
    copied = dict(tower.sim.copies)
    late = [(a.end, copied.get(a.end)) for a, b in itertools.pairwise(spans) if copied.get(a.end, b.end) >= b.end]
    assert not late, f"rows copied out only after the next forward ended (a wait for the whole device): {late}"


def histogram(metric) -> tuple[float, float]:
    samples = {s.name: s.value for s in metric.collect()[0].samples if not s.labels.get("le")}
    return samples[metric._name + "_count"], samples[metric._name + "_sum"]


def assert_forward_seconds_from_the_device(metrics, spans: list[sim.Span], launch_s: float) -> None:
    """``visenc_forward_seconds`` is the device's time (events around each forward), the launch a metric apart."""
    count, device_s = histogram(metrics.forward_seconds)
    busy = sum(s.end - s.start for s in spans)
    assert count == len(spans)
    # a forward's start event completes when the work before it does: its time is its span's, plus its
    # own launch where the device was idle when it was recorded (the first forward)
    assert busy - 1e-6 <= device_s <= busy + len(spans) * launch_s * 5, (device_s, busy)
    count, launch_total = histogram(metrics.forward_launch_seconds)
    assert count == len(spans) and launch_total < busy / 4, (launch_total, busy)


async def test_the_device_runs_every_ready_batch_while_the_loop_is_blocked(monkeypatch):
    tower = sim.load(SPEC)
    images = [png_bytes(900 + i, 128, 128) for i in range(IMAGES)]
    async with running_app(tower, max_batch_images=4, max_wait_ms=0, prefetch_tokens=4096) as client:
        engine = client.app.state.engine
        async with held_device(engine, monkeypatch) as gate:
            r = await encode_json(client, [{"data": d} for d in images], wait=False)
            assert r.status_code == 200, r.text
            await until(lambda: len(engine.scheduler._ready) == IMAGES)
            gate.set()
            ran = block_the_loop_until(lambda: sum(s.images for s in tower.sim.spans) >= IMAGES, BLOCKED_LIMIT_S)
        forwarded = sum(s.images for s in tower.sim.spans)
        assert ran, f"the device ran {forwarded} of {IMAGES} ready images while the event loop was blocked"
        spans = list(tower.sim.spans)
        assert [s.images for s in spans] == [4, 4, 4, 4]
        assert_never_drained(spans)
        assert_copied_before_the_next_forward_ends(tower, spans)
        # the copy-out thread records a forward's seconds once its rows are out, just after its span ends
        await until(lambda: histogram(engine.metrics.forward_seconds)[0] >= len(spans), what="every forward's seconds")
        assert_forward_seconds_from_the_device(engine.metrics, spans, tower.spec.launch_ms / 1000)
        for data in images:  # the rows were read once made, not before
            rows = await fetch_rows(client, sha(data))
            expected = tower.preprocess(decode(data, max_pixels=10**9)).pixels
            np.testing.assert_allclose(rows, np.repeat(expected[:, None], 8, axis=1), rtol=1e-6)


async def test_preprocessing_threads_hand_images_to_the_device_while_the_loop_is_blocked():
    """The event loop is blocked before the images' preprocessing ends: the device forwards all of them."""
    tower = sim.load(SLOW_SPEC)
    images = [png_bytes(1900 + i, 128, 128) for i in range(IMAGES)]
    async with running_app(tower, max_batch_images=4, max_wait_ms=0, prefetch_tokens=4096) as client:
        engine = client.app.state.engine
        slow = engine.scheduler._preprocess

        def preprocess(data):
            time.sleep(0.01)  # a large image's decode (GIL released), well ahead of the device still
            return slow(data)

        engine.scheduler._preprocess = preprocess
        r = await encode_json(client, [{"data": d} for d in images], wait=False)
        assert r.status_code == 200, r.text
        await until(lambda: all_bytes_taken(engine))
        ready = len(engine.scheduler._ready) + sum(s.images for s in tower.sim.spans)
        assert ready < IMAGES, "preprocessing ended before the loop was blocked: the test proves nothing"
        ran = block_the_loop_until(lambda: sum(s.images for s in tower.sim.spans) >= IMAGES, BLOCKED_LIMIT_S)
        forwarded = sum(s.images for s in tower.sim.spans)
        assert ran, f"the device forwarded {forwarded} of {IMAGES} images while the event loop was blocked"
        spans = list(tower.sim.spans)
        assert_never_drained(spans[1:])  # the first forward may run before the second image is ready
        for data in images:
            rows = await fetch_rows(client, sha(data))
            expected = tower.preprocess(decode(data, max_pixels=10**9)).pixels
            np.testing.assert_allclose(rows, np.repeat(expected[:, None], 8, axis=1), rtol=1e-6)


def all_bytes_taken(engine) -> bool:
    """Every image is with the preprocessing pool (or past it): nothing more needs the loop."""
    scheduler = engine.scheduler
    return not scheduler._waiting and all(job._data is None for job in scheduler._preparing.values())
