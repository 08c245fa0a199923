"""Redis killed and restarted (same port) under concurrent traffic on two replicas."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable

import httpx
import numpy as np
import redis.asyncio as aioredis
from harness.images import png_bytes
from harness.processes import redis_process
from harness.waits import free_port, metric, until
from tests.support.api import reference, running_app

from visenc_client import AsyncClient, image_hash
from visenc_client.format import entry_key


async def test_service_survives_a_redis_restart_under_traffic(tiny_tower):
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    pool = [png_bytes(600 + i, 64 + 8 * (i % 5), 64 + 8 * (i % 3)) for i in range(12)]
    expected = {image_hash(d): reference(tiny_tower, d) for d in pool}
    settings = {"redis_url": url, "redis_timeout_s": 0.5, "redis_retry_s": 0.2, "claim_poll_ms": 5.0}
    stop = asyncio.Event()
    served: list[int] = []

    async def traffic(clients: list[tuple[AsyncClient, httpx.AsyncClient]], seed: int) -> None:
        rng = random.Random(seed)
        n = 0
        while not stop.is_set() and n < 300:  # bounded in count and (by the stop event) in time
            n += 1
            await asyncio.sleep(0)  # L1 hits never suspend in-process: let the test's timers run
            vc, http = rng.choice(clients)
            images = rng.sample(pool, 3)
            handles = await vc.encode(images)  # hash first, bytes on a miss
            assert [h.status for h in handles] == ["ready"] * 3
            for h in handles:
                rows = await vc.fetch(h)  # whole, never partial, never another image's rows
                assert rows.shape == expected[h.hash].shape
                np.testing.assert_allclose(rows, expected[h.hash], atol=1e-5, rtol=0)
                part = await vc.fetch(h, 1, 3)
                np.testing.assert_array_equal(part, rows[1:3])
            # an image nobody has: every replica asks Redis, up or down, and answers "missing" at once
            r = await http.post("/v1/encode", json={"items": [{"hash": f"{rng.getrandbits(256):064x}"}]})
            assert r.json()["items"][0]["status"] == "missing"
            served.append(len(handles))

    with contextlib.ExitStack() as stack:
        _, proc = stack.enter_context(redis_process(port))
        async with running_app(tiny_tower, **settings) as a, running_app(tiny_tower, **settings) as b:
            timeout = httpx.Timeout(10.0)  # a request hanging on a dead Redis would fail the test
            clients = [
                AsyncClient("http://visenc", transport=httpx.ASGITransport(app=app.app), timeout=timeout)
                for app in (a, b)
            ]
            pairs = list(zip(clients, (a, b)))
            workers = [asyncio.create_task(traffic(pairs, seed)) for seed in range(4)]

            def served_at_least(n: int) -> Callable[[], bool]:  # or the traffic is over (bounded in count)
                return lambda: len(served) >= n or all(w.done() for w in workers)

            try:
                await until(served_at_least(4), 60, "traffic before the outage")
                proc.kill()  # SIGKILL: no goodbye; everything stored is lost (no persistence)
                proc.wait(timeout=5)
                before = len(served)
                await until(
                    lambda: len(served) >= before + 4 or all(w.done() for w in workers), 60, "traffic, Redis down"
                )
                for c in (a, b):  # each replica has met the dead Redis by now (traffic asks it for unknowns)
                    await c.post("/v1/encode", json={"items": [{"hash": "e" * 64}]})
                degraded = [(await c.get("/readyz")).json()["status"] for c in (a, b)]
                restarted = stack.enter_context(redis_process(port))  # same port, empty
                before = len(served)
                await until(
                    lambda: len(served) >= before + 4 or all(w.done() for w in workers), 60, "traffic, Redis back"
                )
                stop.set()
                await asyncio.gather(*workers)  # re-raises any failed request or wrong row
            finally:
                stop.set()
                for w in workers:
                    w.cancel()
                for c in clients:
                    await c.aclose()
            assert restarted[1].poll() is None
            assert degraded == ["degraded", "degraded"]
            assert len(served) > 10

            # Redis is used again without a restart of the service: a new image goes through to it
            fresh = png_bytes(699, 72, 72)
            await asyncio.sleep(0.25)  # past redis_retry_s
            async with AsyncClient("http://visenc", transport=httpx.ASGITransport(app=a.app)) as vc:
                (h,) = await vc.encode([fresh])
                assert h.status == "ready"
            fp = (await a.get("/v1/model")).json()["fingerprint"]
            raw = aioredis.Redis.from_url(url)
            await until(lambda: raw.exists(entry_key("default", fp, h.hash)), what="a's entry is in Redis")
            await raw.aclose()
            # b finds it there by hash: no bytes, no forward
            assert (await b.post("/v1/encode", json={"items": [{"hash": h.hash}]})).json()["items"][0][
                "status"
            ] == "ready"
            for c in (a, b):  # both touched Redis since it came back
                assert metric((await c.get("/metrics")).text, "visenc_index_up", tier="redis") == 1
            assert (await a.get("/readyz")).json()["status"] == "ready"
            texts = [(await c.get("/metrics")).text for c in (a, b)]
            errors = sum(
                metric(t, "visenc_redis_errors_total", op=op)
                for t in texts
                for op in ("get", "set", "claim", "renew", "unclaim")
            )
            assert errors > 0  # the outage was seen, and counted
