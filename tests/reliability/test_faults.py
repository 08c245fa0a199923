"""Injected faults (visenc/engine/faults.py): failing forwards, a stalled worker, a slow index; SIGTERM."""

from __future__ import annotations

import asyncio
import random
import signal
import threading
import time

import httpx
import numpy as np
from tests.conftest import running_app
from tests.images import png_bytes
from tests.reliability.conftest import server_process
from tests.reliability.test_backpressure import _b64, until
from tests.service.test_api import encode_json, fetch_rows, metric, reference, sha


async def test_failed_forwards_fail_only_their_own_images_and_the_worker_lives_on(tiny_tower):
    rate, seed, n = 0.5, 11, 8
    rng = random.Random(seed)
    expected_fail = [rng.random() < rate for _ in range(n)]  # the injector draws once per forward
    assert any(expected_fail) and not all(expected_fail)
    async with running_app(tiny_tower, fault_forward_fail_rate=rate, fault_seed=seed) as client:
        images = [png_bytes(700 + i, 28, 28) for i in range(n)]
        for data, fail in zip(images, expected_fail):  # one request, one image, one forward each
            r = await encode_json(client, [{"data": data}])
            assert r.status_code == 200
            item = r.json()["items"][0]
            if fail:
                assert item["status"] == "error" and item["error"] == "encoding failed: InjectedFault"
                assert (await client.get(f"/v1/embeddings/{sha(data)}")).status_code == 404  # nothing cached
            else:
                assert item["status"] == "ready"
                np.testing.assert_allclose(await fetch_rows(client, sha(data)), reference(tiny_tower, data),
                                           atol=1e-5, rtol=0)
            assert (await client.get("/readyz")).status_code == 200
        m = (await client.get("/metrics")).text
        assert metric(m, "visenc_encode_failures_total") == sum(expected_fail)
        assert metric(m, "visenc_encoded_images_total") == n - sum(expected_fail)
        assert client.app.state.encoder.inflight == {}


async def test_stalled_worker_turns_unready_and_requests_fail_fast(tiny_tower):
    async with running_app(tiny_tower, fault_forward_delay_s=2.0, stall_timeout_s=0.3) as client:
        encoder = client.app.state.encoder
        a, b, c = (png_bytes(720 + i, 28, 28) for i in range(3))
        first = asyncio.create_task(encode_json(client, [{"data": a}]))
        await until(lambda: encoder.worker.busy_since is not None)
        t0 = time.monotonic()
        queued = asyncio.create_task(encode_json(client, [{"data": b}]))  # behind the stuck forward
        await until(lambda: encoder.worker.stalled)
        r = await client.get("/readyz")
        assert r.status_code == 503 and "stall_timeout_s=0.3" in r.json()["error"]["message"]
        r = await encode_json(client, [{"data": c}])
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        r = await queued  # failed by the watchdog, not left to its deadline
        assert r.status_code == 503 and "stalled" in r.json()["error"]["message"]
        assert time.monotonic() - t0 < 1.9, "the requests waited for the stalled forward"
        assert not first.done()
        r = await first  # the stuck forward does finish: its own request gets its answer
        assert r.status_code == 200 and r.json()["items"][0]["status"] == "ready"
        await until(lambda: not encoder.worker.stalled)
        assert (await client.get("/readyz")).status_code == 200
        r = await encode_json(client, [{"hash": sha(a)}])  # hits are answered whatever the worker does
        assert r.json()["items"][0]["status"] == "ready"
        m = (await client.get("/metrics")).text
        assert metric(m, "visenc_worker_stalls_total") == 1


async def test_slow_index_still_answers_within_the_deadline(tiny_tower):
    async with running_app(tiny_tower, fault_index_delay_s=0.2, request_timeout_s=5) as client:
        data = png_bytes(730, 28, 28)
        t0 = time.monotonic()
        r = await encode_json(client, [{"data": data}])
        assert r.json()["items"][0]["status"] == "ready"
        r = await encode_json(client, [{"hash": sha(data)}])
        assert r.json()["items"][0]["status"] == "ready"
        assert time.monotonic() - t0 >= 0.4  # both lookups went through the slowed index


def test_sigterm_finishes_in_flight_requests_then_exits_0(tmp_path):
    log = tmp_path / "serve.log"
    with server_process("--fault-forward-delay-s", "2", "--max-wait-ms", "1", log=log) as (url, proc):
        result: dict[str, object] = {}

        def call() -> None:
            try:
                result["r"] = httpx.post(f"{url}/v1/encode", json={"items": [{"data": _b64(png_bytes(740, 28, 28))}]},
                                         timeout=30)
            except Exception as e:  # reported below
                result["r"] = e

        t = threading.Thread(target=call)
        t.start()
        time.sleep(0.7)  # the encode is in its (2 s) forward
        proc.send_signal(signal.SIGTERM)
        t.join(30)
        r = result["r"]
        assert isinstance(r, httpx.Response) and r.status_code == 200, r
        assert r.json()["items"][0]["status"] == "ready"
        assert proc.wait(timeout=30) == 0
    text = log.read_text()
    assert "Waiting for connections to close" in text  # uvicorn did wait for the in-flight request
    assert "Traceback" not in text
