"""A stalled forward's thread is abandoned: when its forward comes back late, it forwards nothing more of
its batch (those jobs were answered 503) and leaves the live device loop's state alone."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence

import torch
from harness.images import png_bytes
from harness.waits import until
from tests.support.api import encode_in_one_batch, encode_json, running_app
from tests.support.faults import FaultyTower

from visenc.engine.device import DeviceLoop
from visenc.engine.worker import WorkerState
from visenc.metrics import Metrics
from visenc.models import sim
from visenc.models.base import Prepared


class GroupedStallingTower(FaultyTower):
    """One device call an image; the first one blocks until ``release`` is set. Records each call's thread."""

    def __init__(self, inner, release: threading.Event) -> None:
        super().__init__(inner)
        self.release = release
        self.calls: list[tuple[int, int]] = []  # (thread id, images)

    def forward_groups(self, batch: Sequence[Prepared]) -> list[list[int]]:
        return [[i] for i in range(len(batch))]

    def forward(self, batch: Sequence[Prepared]) -> list[torch.Tensor]:
        first = not self.calls
        self.calls.append((threading.get_ident(), len(batch)))
        if first:
            self.release.wait(30)
        return super().forward(batch)


async def test_an_abandoned_device_thread_forwards_no_more_of_its_batch(tiny_tower, monkeypatch, caplog):
    release = threading.Event()
    tower = GroupedStallingTower(tiny_tower, release)
    try:
        async with running_app(tower, stall_timeout_s=0.3, max_wait_ms=300.0) as client:
            engine = client.app.state.engine
            images = [{"data": png_bytes(760 + i, 28, 28)} for i in range(3)]
            r = await encode_in_one_batch(client, images, monkeypatch)  # the three images go in one batch
            assert r.status_code == 503 and "stall_timeout_s" in r.text
            await until(lambda: engine.worker.state is WorkerState.HEALTHY)
            stalled = tower.calls[0][0]
            live = engine.worker.device
            live.busy_since = marked = time.monotonic() + 3600  # as if the live loop were in a forward
            caplog.clear()
            release.set()  # the stalled forward comes back, late
            await asyncio.sleep(1.0)  # time for it to go on, if it does
            assert live.busy_since == marked, "the abandoned thread reset the live loop's busy_since"
            errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
            assert errors == [], errors
            live.busy_since = None
            late = [n for t, n in tower.calls[1:] if t == stalled]
            assert late == [], f"the abandoned thread forwarded {sum(late)} more images of its failed batch"
    finally:
        release.set()


async def test_a_launched_forward_the_device_never_ends_is_a_stall():
    """The forward call returns at launch (as CUDA's does); its device work runs past ``stall_timeout_s``:
    the watchdog sees it, and its waiter is answered 503 long before the device would end it."""
    tower = sim.load("sim:launch_ms=1,token_us=100000,patch=16,hidden=8")  # 64 tokens: 6.4 s on the device
    async with running_app(tower, stall_timeout_s=0.5, shutdown_timeout_s=1.0) as client:
        t0 = time.monotonic()
        r = await encode_json(client, [{"data": png_bytes(795, 128, 128)}])
        assert r.status_code == 503 and "stall_timeout_s=0.5" in r.text, r.text
        assert time.monotonic() - t0 < 4.0, "the stalled forward's waiter was answered only when it ended"


async def test_after_a_stall_the_restarted_device_idles_without_another(tiny_tower):
    """The stalled batch's start is not the new loop's: with nothing more to do, it is never called stalled."""
    release = threading.Event()
    tower = GroupedStallingTower(tiny_tower, release)
    try:
        async with running_app(tower, stall_timeout_s=0.3) as client:
            engine = client.app.state.engine
            r = await encode_json(client, [{"data": png_bytes(770, 28, 28)}])
            assert r.status_code == 503 and "stall_timeout_s" in r.text
            await until(lambda: engine.worker.state is WorkerState.HEALTHY)
            await asyncio.sleep(1.0)  # four of the watchdog's looks at an idle device
            assert engine.worker.state is WorkerState.HEALTHY
            assert engine.metrics.worker_stalls._value.get() == 1
            r = await encode_json(client, [{"data": png_bytes(771, 28, 28)}])
            assert r.status_code == 200 and r.json()["items"][0]["status"] == "ready"
    finally:
        release.set()


def test_a_loop_retired_while_it_waits_for_a_launched_forward_takes_no_more_batches(monkeypatch):
    """A stall declared while the device thread waits on a launched forward retires its loop: once the
    wait ends, that thread takes nothing (what it took would be failed, though the live loop could run it)."""
    taken: list[int] = []

    class Ready:
        def take(self, max_wait_s: float, timeout_s: float) -> list:
            taken.append(threading.get_ident())
            return []

        def dispatch(self) -> None:
            pass

    device = DeviceLoop(
        sim.load("sim:launch_ms=1,token_us=10,patch=16,hidden=8"), Ready(), None, metrics=Metrics(), max_wait_s=0.0
    )
    loop = asyncio.new_event_loop()
    try:
        generation = device.bind(loop)
        monkeypatch.setattr(device, "_wait_launched", lambda g: device.retire())  # the stall, during the wait
        assert device.run(generation) is None
    finally:
        loop.close()
    assert taken == [], "a retired device loop took a batch"
