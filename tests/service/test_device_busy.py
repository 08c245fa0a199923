"""The device never waits: on the simulated device (``models/sim.py``), the device thread takes its
batches itself while the event loop is blocked, and launches each forward before the one before it
ends (no host sync, no serial step between forwards). Its busy share under load: ``bench/bench_device_busy.py``."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from harness.images import png_bytes
from harness.waits import until
from tests.support.api import encode_json, fetch_rows, running_app, sha

from visenc.imaging.decode import decode
from visenc.models import sim

pytestmark = pytest.mark.serial  # a forward's 1 ms launch budget: a test on the other core breaks it

IMAGES = 16
#: 4 images a forward, 64 tokens each, 400 us a token: 102 ms of device time a forward, 1 ms launch (the host
#: has that long to take and launch the next one, on a loaded CI host too)
SPEC = "sim:launch_ms=1,token_us=400,patch=16,hidden=8"
#: far past the 4 forwards' device time: reached only when the device needs the event loop
BLOCKED_LIMIT_S = 20.0


@contextlib.contextmanager
def held(scheduler, monkeypatch) -> Iterator[threading.Event]:
    """The device thread takes no batch until the returned event is set."""
    gate = threading.Event()
    real = scheduler.take

    def take(*a, **kw):
        gate.wait()
        return real(*a, **kw)

    monkeypatch.setattr(scheduler, "take", take)
    try:
        yield gate
    finally:
        gate.set()


def block_the_loop_until(done, limit_s: float) -> bool:
    """Hold the event loop's thread (its GIL released) until ``done()`` or ``limit_s``: whether done."""
    deadline = time.monotonic() + limit_s
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


async def test_the_device_runs_every_ready_batch_while_the_loop_is_blocked(monkeypatch):
    tower = sim.load(SPEC)
    images = [png_bytes(900 + i, 128, 128) for i in range(IMAGES)]
    async with running_app(tower, max_batch_images=4, max_wait_ms=0, prefetch_tokens=4096) as client:
        engine = client.app.state.engine
        with held(engine.scheduler, monkeypatch) as gate:
            r = await encode_json(client, [{"data": d} for d in images], wait=False)
            assert r.status_code == 200, r.text
            await until(lambda: len(engine.scheduler._ready) == IMAGES)
            gate.set()
            ran = block_the_loop_until(lambda: sum(s.images for s in tower.sim.spans) >= IMAGES, BLOCKED_LIMIT_S)
        forwarded = sum(s.images for s in tower.sim.spans)
        assert ran, f"the device ran {forwarded} of {IMAGES} ready images while the event loop was blocked"
        spans = list(tower.sim.spans)
        assert [s.images for s in spans] == [4, 4, 4, 4]
        # each forward was launched while the one before it ran: the device never drained between them
        drained = [b.start - a.end for a, b in itertools.pairwise(spans) if b.start > a.end]
        assert not drained, f"the device idled between forwards: {drained} s (a host sync or a serial step)"
        for data in images:  # the rows were read once made, not before
            rows = await fetch_rows(client, sha(data))
            expected = tower.preprocess(decode(data, max_pixels=10**9)).pixels
            np.testing.assert_allclose(rows, np.repeat(expected[:, None], 8, axis=1), rtol=1e-6)
