"""The real app in-process, and talking to it: ``running_app`` (engine, index and tower, lifespan
included, behind an httpx client), the request and read helpers, and ``reference``, the single-image
forward every served row must equal."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import numpy as np
from harness.waits import until

from visenc.bootstrap import create_app
from visenc.config import Settings
from visenc.imaging.decode import decode
from visenc.models.base import VisionTower

#: how long ``held_device`` waits for the device thread to come back for a batch (a quarter second when idle)
PARK_TIMEOUT_S = 10.0
MSGPACK = {"content-type": "application/msgpack", "accept": "application/msgpack"}


@contextlib.asynccontextmanager
async def running_app(
    tower: VisionTower, *, index: Callable[..., Any] | None = None, **overrides: object
) -> AsyncIterator[httpx.AsyncClient]:
    """The real app (engine, index, tower) in-process, lifespan included, behind an httpx client.
    ``index`` replaces the index builder (``tests.support.faults.faulty_index``)."""
    settings = Settings(**{"max_wait_ms": 1.0, **overrides})  # type: ignore[arg-type]
    app = create_app(settings, tower=tower) if index is None else create_app(settings, tower=tower, index=index)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://visenc") as client:
            client.app = app  # type: ignore[attr-defined]
            yield client


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def reference(tower: VisionTower, data: bytes) -> np.ndarray:
    """The single-image forward of the same tower: what every served embedding must equal."""
    prepared = tower.preprocess(decode(data, max_pixels=10**9))
    (out,) = tower.forward([prepared])
    return out.float().numpy()


async def encode_json(client, items, wait=True, headers=None):
    body = {"items": [{k: (b64(v) if k == "data" else v) for k, v in it.items()} for it in items], "wait": wait}
    return await client.post("/v1/encode", json=body, headers=headers or {})


async def fetch_rows(client, h: str, start=None, end=None, headers=None) -> np.ndarray:
    params = {k: v for k, v in (("start", start), ("end", end)) if v is not None}
    r = await client.get(f"/v1/embeddings/{h}", params=params, headers=headers or {})
    assert r.status_code == 200, r.text
    rows, hidden = map(int, r.headers["x-visenc-shape"].split(","))
    assert r.headers["x-visenc-dtype"] == "float32"
    return np.frombuffer(r.content, dtype="<f4").reshape(rows, hidden)


@contextlib.asynccontextmanager
async def held_device(encoder: Any, monkeypatch: Any) -> AsyncIterator[threading.Event]:
    """The device takes no batch until the returned event is set (images queue up, already admitted).

    Entered once the device thread waits at the gate: a take it had begun before ends first (within
    ``TAKE_TIMEOUT_S``, or with the images that were ready then), so none taken later slips past."""
    gate, parked = threading.Event(), threading.Event()
    real = encoder.scheduler.take

    def held(*a: Any, **kw: Any) -> Any:  # on the device thread, which takes its batches itself
        parked.set()
        gate.wait()
        return real(*a, **kw)

    monkeypatch.setattr(encoder.scheduler, "take", held)
    try:
        await until(parked.is_set, PARK_TIMEOUT_S, what="the device thread coming back for a batch")
        yield gate
    finally:
        gate.set()


async def encode_in_one_batch(client: Any, items: list[dict], monkeypatch: Any) -> httpx.Response:
    """One request whose images all wait ready before the device takes any: one batch where they fit."""
    engine = client.app.state.engine
    async with held_device(engine, monkeypatch) as gate:
        asking = asyncio.create_task(encode_json(client, items))
        await until(lambda: len(engine.scheduler._ready) == len(items), what="every image ready")
        gate.set()
        return await asking
