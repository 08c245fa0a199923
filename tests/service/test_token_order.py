"""Encode in token order, fetch raises priority: observed on the real engine and tiny tower.

The device is held on a gate inside the tower's forward, so the queue behind it
is built up deterministically; every forward is numbered, and each completed
image records the number of the forward that produced it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgpack
import pytest
from harness.images import png_bytes
from harness.waits import until
from tests.support.api import encode_json, running_app

from visenc.models.base import VisionTower

# mixed resolutions: several buckets, all packable into one forward
SIZES = [(64, 64), (120, 80), (84, 140), (200, 56), (96, 96), (64, 120)]


@dataclass
class Probe:
    """Holds the device at its first forward and records which forward completed each image."""

    gate: threading.Event = field(default_factory=threading.Event)
    forwards: int = 0
    held_started: threading.Event = field(default_factory=threading.Event)
    batch_of: dict[str, int] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)


@contextlib.asynccontextmanager
async def held_app(tiny_tower: VisionTower, monkeypatch: pytest.MonkeyPatch, **settings) -> AsyncIterator[tuple]:
    probe = Probe()
    real_forward = tiny_tower.forward

    def forward(batch):  # device thread
        probe.forwards += 1
        if probe.forwards == 1:
            probe.held_started.set()
            assert probe.gate.wait(timeout=30), "test never released the device"
        return real_forward(batch)

    monkeypatch.setattr(tiny_tower, "forward", forward)
    async with running_app(tiny_tower, **settings) as client:
        outputs = client.app.state.engine.outputs  # type: ignore[attr-defined]
        materialised = 0

        def record(batch, seconds):  # event loop thread; batches are copied out in forward order
            nonlocal materialised
            materialised += 1
            for job in batch:
                probe.batch_of[job.image_hash] = materialised
                probe.order.append(job.image_hash)

        outputs.on_materialised = record
        try:
            yield client, probe
        finally:
            probe.gate.set()


async def occupy_device(client, probe: Probe, seed: int) -> asyncio.Task:
    """Start one encode whose forward blocks on the gate; return once the device is held."""
    task = asyncio.create_task(encode_json(client, [{"data": png_bytes(seed, 64, 64)}]))
    await until(probe.held_started.is_set, what="the first forward started")
    return task


def hashes_of(response) -> list[str]:
    assert response.status_code == 200, response.text
    return [it["hash"] for it in response.json()["items"]]


async def test_images_complete_in_prompt_order_and_requests_in_arrival_order(tiny_tower, monkeypatch):
    # the prefetch budget holds every image (all ready before the release); 4 images per forward
    async with held_app(tiny_tower, monkeypatch, max_batch_tokens=4096, max_batch_images=4) as (client, probe):
        await check_prompt_and_arrival_order(client, probe)


async def check_prompt_and_arrival_order(client, probe: Probe) -> None:
    blocker = await occupy_device(client, probe, seed=900)
    scheduler = client.app.state.engine.scheduler  # type: ignore[attr-defined]
    a = [png_bytes(910 + i, w, h) for i, (w, h) in enumerate(SIZES)]
    b = [png_bytes(930 + i, w, h) for i, (w, h) in enumerate(reversed(SIZES))]
    ha = hashes_of(await encode_json(client, [{"data": d} for d in a], wait=False))
    hb = hashes_of(await encode_json(client, [{"data": d} for d in b], wait=False))
    # everything is admitted and queued behind the held forward before it is released
    await until(lambda: scheduler.depth == len(a) + len(b), what="both requests are queued")
    probe.gate.set()
    await blocker
    await until(lambda: set(ha + hb) <= set(probe.batch_of), what="every image is encoded")
    assert all(
        it["status"] == "ready" for it in (await encode_json(client, [{"hash": h} for h in ha + hb])).json()["items"]
    )
    done = [h for h in probe.order if h in set(ha + hb)]
    assert done == ha + hb, "images did not complete in (request arrival, prompt position) order"
    batches = [probe.batch_of[h] for h in ha + hb]
    assert batches == sorted(batches) and len(set(batches)) > 2, batches  # several forwards, in order


async def test_fetch_of_late_images_moves_them_all_into_the_next_forward(tiny_tower, monkeypatch):
    # 200 input patches per forward (a few small images), prefetch gate at 400
    async with held_app(tiny_tower, monkeypatch, max_batch_tokens=200, prefetch_tokens=400) as (client, probe):
        await check_fetch_priority(client, probe)


async def check_fetch_priority(client, probe: Probe) -> None:
    blocker = await occupy_device(client, probe, seed=950)
    scheduler = client.app.state.engine.scheduler  # type: ignore[attr-defined]
    images = [png_bytes(960 + i, *SIZES[i % len(SIZES)]) for i in range(16)]
    hashes = hashes_of(await encode_json(client, [{"data": d} for d in images], wait=False))
    # the prefetch gate admits only the first few images into preprocessing; the last ones wait
    await until(lambda: len(scheduler._ready) >= 2 and not scheduler._preparing, what="the staged work is ready")
    late = hashes[-3:]
    assert set(late) <= {j.image_hash for j in scheduler._waiting}, "the last images should be behind the gate"
    # one fetch for the three (one prefill chunk): all of them are bumped at once, not one after the other
    body = msgpack.packb({"ranges": [{"hash": h} for h in late]})
    fetch = asyncio.create_task(
        client.post("/v1/embeddings/fetch", content=body, headers={"content-type": "application/msgpack"})
    )
    await until(lambda: set(late) <= {j.image_hash for j in scheduler._ready}, what="the fetched images are ready")
    probe.gate.set()
    await blocker
    r = await asyncio.wait_for(fetch, 30)
    assert r.status_code == 200
    assert [probe.batch_of[h] for h in late] == [2, 2, 2], "the fetched images did not run in the next forward"
    await until(lambda: set(hashes) <= set(probe.batch_of), what="every image is encoded")
    assert min(probe.batch_of[h] for h in hashes[:-3]) >= 3  # an urgent forward is not padded with the rest
