"""Failure semantics, with faults injected by test support (tests/support/faults.py):
a failing or stalled forward answers its waiters with 503 within a second, readiness turns
false and the worker restarts; a device that cannot be restarted stops the process non-zero;
shutdown drains within a bound; a slow index still answers; outputs leave the device thread."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import httpx
import numpy as np
from harness.images import png_bytes
from harness.processes import serve_subprocess
from harness.waits import metric, until, wait_until
from tests.support.api import b64, encode_in_one_batch, encode_json, fetch_rows, reference, running_app, sha
from tests.support.faults import FaultyTower, faulty_index
from tests.support.serve_faulty import launcher as faulty

from visenc.engine.interface import EncodeItem
from visenc.engine.job import JobState
from visenc.engine.worker import WorkerState
from visenc.errors import NotReady


async def test_failed_forward_answers_503_restarts_and_serves_again(tiny_tower):
    tower = FaultyTower(tiny_tower, fail_first=1)
    async with running_app(tower) as client:
        engine = client.app.state.engine
        bad, good = png_bytes(700, 28, 28), png_bytes(701, 28, 28)
        t0 = time.monotonic()
        r = await encode_json(client, [{"data": bad}])
        assert time.monotonic() - t0 < 1.0
        assert r.status_code == 503 and "InjectedFault" in r.json()["error"]["message"]
        assert r.headers["retry-after"] == "5"
        await until(lambda: engine.worker.state is WorkerState.HEALTHY)
        assert (await client.get("/readyz")).status_code == 200
        assert (await client.get(f"/v1/embeddings/{sha(bad)}")).status_code == 404  # nothing cached
        for data in (bad, good):  # the same image again, and another: both encode now
            r = await encode_json(client, [{"data": data}])
            assert r.status_code == 200 and r.json()["items"][0]["status"] == "ready"
            np.testing.assert_allclose(await fetch_rows(client, sha(data)), reference(tiny_tower, data), atol=1e-5)
        m = (await client.get("/metrics")).text
        assert metric(m, "visenc_encode_failures_total", kind="forward") == 1
        assert metric(m, "visenc_worker_restarts_total") == 1
        assert engine.inflight.jobs == {}


async def test_readiness_is_false_while_the_worker_restarts(tiny_tower):
    # the first forward fails; the restart's probe forward is slow, so readiness can be read meanwhile
    tower = FaultyTower(tiny_tower, fail_first=1, delay_s=1.5, delay_first=2)
    async with running_app(tower, stall_timeout_s=5) as client:
        engine = client.app.state.engine
        r = await encode_json(client, [{"data": png_bytes(705, 28, 28)}])
        assert r.status_code == 503
        await until(lambda: engine.worker.state is WorkerState.RESTARTING)
        r = await client.get("/readyz")
        assert r.status_code == 503 and "InjectedFault" in r.json()["error"]["message"]
        r = await encode_json(client, [{"data": png_bytes(706, 28, 28)}])  # new work is refused meanwhile
        assert r.status_code == 503
        await until(lambda: engine.worker.state is WorkerState.HEALTHY)
        assert (await client.get("/readyz")).status_code == 200


async def test_stalled_forward_answers_503_within_a_second_and_restarts(tiny_tower):
    # the limit holds for every forward: the restart's probe and b's must stay well within it on a busy host
    tower = FaultyTower(tiny_tower, delay_s=4.0, delay_first=1)
    async with running_app(tower, stall_timeout_s=1.0) as client:
        engine = client.app.state.engine
        a, b = png_bytes(720, 28, 28), png_bytes(721, 28, 28)
        t0 = time.monotonic()
        r = await encode_json(client, [{"data": a}])
        assert time.monotonic() - t0 < 1.0 + 1.0, "the waiter of a stalled forward was not answered in time"
        assert r.status_code == 503 and "stall_timeout_s=1.0" in r.json()["error"]["message"]
        await until(lambda: engine.worker.state is WorkerState.HEALTHY)
        r = await encode_json(client, [{"data": b}])  # a fresh device thread serves on
        assert r.status_code == 200 and r.json()["items"][0]["status"] == "ready"
        m = (await client.get("/metrics")).text
        assert metric(m, "visenc_worker_stalls_total") == 1
        assert metric(m, "visenc_encode_failures_total", kind="stall") == 1


async def test_hits_are_answered_while_the_device_is_down(tiny_tower):
    tower = FaultyTower(tiny_tower, fail_first=1_000_000)
    async with running_app(tower, worker_restart_attempts=1) as client:
        data = png_bytes(725, 28, 28)
        tower.fail_first = 0
        assert (await encode_json(client, [{"data": data}])).json()["items"][0]["status"] == "ready"
        tower.fail_first = 1_000_000  # from now on every forward fails: the restart cannot succeed
        r = await encode_json(client, [{"data": png_bytes(726, 28, 28)}])
        assert r.status_code == 503
        await until(lambda: client.app.state.fatal is not None)
        assert (await client.get("/readyz")).status_code == 503
        r = await encode_json(client, [{"hash": sha(data)}])  # a hit needs no device
        assert r.status_code == 200 and r.json()["items"][0]["status"] == "ready"


async def test_a_device_that_cannot_be_restarted_answers_images_being_preprocessed_503(tiny_tower, monkeypatch):
    """Image B is being preprocessed when the device is given up (image A's forward fails, and so
    does the restart's probe): B's waiter is answered 503 (retry) like A's, not a per-image failure,
    and B's staging comes back."""
    tower = FaultyTower(tiny_tower, fail_first=1_000_000)
    async with running_app(tower, worker_restart_attempts=1, preprocess_workers=2) as client:
        engine = client.app.state.engine
        a, b = png_bytes(735, 28, 28), png_bytes(736, 28, 28)
        entered, release = threading.Event(), threading.Event()
        real = engine.scheduler._preprocess

        def preprocess(data):
            if data == b:  # B's preprocessing holds its pool thread until the test lets it go
                entered.set()
                release.wait(30)
            return real(data)

        monkeypatch.setattr(engine.scheduler, "_preprocess", preprocess)
        try:
            waiting_b = asyncio.create_task(encode_json(client, [{"data": b}]))
            await until(entered.is_set, what="B's preprocessing started")
            r = await encode_json(client, [{"data": a}])
            assert r.status_code == 503
            await until(lambda: client.app.state.fatal is not None, what="the device given up")
            r = await asyncio.wait_for(waiting_b, 10)
            assert r.status_code == 503, r.text
            assert "the device cannot be used" in r.json()["error"]["message"]
            assert engine.scheduler.staged_tokens == 0 and engine.inflight.jobs == {}
        finally:
            release.set()


def test_device_that_cannot_be_restarted_exits_non_zero(tmp_path):
    log = tmp_path / "serve.log"
    with serve_subprocess("--max-wait-ms", "1", log=log, launcher=faulty("--fail-always")) as (url, proc):
        r = httpx.post(f"{url}/v1/encode", json={"items": [{"data": b64(png_bytes(730, 28, 28))}]}, timeout=30)
        assert r.status_code == 503
        assert proc.wait(timeout=30) == 3  # EXIT_DEVICE_FAILED: a supervisor restarts the process
    assert "device worker cannot be restarted" in log.read_text()


async def test_slow_index_still_answers_within_the_deadline(tiny_tower):
    async with running_app(tiny_tower, index=faulty_index(delay_s=0.2), request_timeout_s=5) as client:
        data = png_bytes(730, 28, 28)
        t0 = time.monotonic()
        r = await encode_json(client, [{"data": data}])
        assert r.json()["items"][0]["status"] == "ready"
        r = await encode_json(client, [{"hash": sha(data)}])
        assert r.json()["items"][0]["status"] == "ready"
        assert time.monotonic() - t0 >= 0.4  # both lookups went through the slowed index


async def test_outputs_are_copied_off_the_device_thread(tiny_tower):
    """Forward N+1 starts while forward N's outputs are still being copied out and packed."""
    tower = FaultyTower(tiny_tower, output_delay_s=0.3)
    async with running_app(tower, max_batch_images=1) as client:
        engine = client.app.state.engine
        spans: list[tuple[float, float]] = []
        starts: list[float] = []

        def materialised(batch, seconds):
            spans.append((time.monotonic() - seconds, time.monotonic()))
            starts.extend(j.started_at for j in batch)

        engine.outputs.on_materialised = materialised
        images = [png_bytes(740 + i, 28, 28) for i in range(3)]
        r = await encode_json(client, [{"data": d} for d in images])
        assert [it["status"] for it in r.json()["items"]] == ["ready"] * 3
        assert len(spans) == 3
        # the second forward started before the first one's outputs were done
        assert starts[1] < spans[0][1], (starts, spans)


async def test_shutdown_never_hangs_on_a_stalled_forward(tiny_tower):
    tower = FaultyTower(tiny_tower, delay_s=30.0, delay_first=1)
    client_cm = running_app(tower, shutdown_timeout_s=0.5, stall_timeout_s=60)
    client = await client_cm.__aenter__()
    engine = client.app.state.engine
    task = asyncio.create_task(encode_json(client, [{"data": png_bytes(750, 28, 28)}]))
    await until(lambda: engine.worker.busy_since is not None)
    t0 = time.monotonic()
    await client_cm.__aexit__(None, None, None)
    assert time.monotonic() - t0 < 5.0
    r = await asyncio.wait_for(task, 5)
    assert r.status_code == 503


async def test_shutdown_answers_an_image_whose_preprocessing_was_started_but_never_ran(tiny_tower):
    """The engine stops in the same turn of the loop as an image's preprocessing was started (its
    task has not run a step yet): the image is answered 503 all the same, its staging comes back
    and nothing stays in flight."""
    client_cm = running_app(tiny_tower)
    client = await client_cm.__aenter__()
    engine = client.app.state.engine
    try:
        (handle,) = await engine.encode([EncodeItem(data=png_bytes(755, 28, 28))], "default", wait=False)
        assert handle.status == "pending"
        (job,) = engine.inflight.jobs.values()
        assert job.state is JobState.PREPARING and engine.scheduler.staged_tokens > 0
        await engine.stop()  # no await in between: the preparation's task never ran
    finally:
        await client_cm.__aexit__(None, None, None)
    assert job.future.done() and isinstance(job.future.exception(), NotReady)
    assert engine.scheduler.staged_tokens == 0 and engine.inflight.jobs == {}


def test_sigterm_finishes_in_flight_requests_then_exits_0(tmp_path):
    log = tmp_path / "serve.log"
    with serve_subprocess("--max-wait-ms", "1", log=log, launcher=faulty("--forward-delay-s", "2")) as (url, proc):
        result: dict[str, object] = {}

        def call() -> None:
            try:
                body = {"items": [{"data": b64(png_bytes(760, 28, 28))}]}
                result["r"] = httpx.post(f"{url}/v1/encode", json=body, timeout=30)
            except Exception as e:  # reported below
                result["r"] = e

        t = threading.Thread(target=call)
        t.start()
        wait_until(lambda: metric(httpx.get(f"{url}/metrics").text, "visenc_queue_wait_seconds_count") >= 1, 30)
        proc.send_signal(signal.SIGTERM)
        t.join(30)
        r = result["r"]
        assert isinstance(r, httpx.Response) and r.status_code == 200, r
        assert r.json()["items"][0]["status"] == "ready"
        assert proc.wait(timeout=30) == 0
    text = log.read_text()
    assert "Waiting for connections to close" in text  # uvicorn did wait for the in-flight request
    assert "Traceback" not in text


async def test_a_crash_of_the_worker_loop_itself_fails_its_batch_and_restarts(tiny_tower, monkeypatch):
    """Not the forward: the loop around it raises (a bug). The batch it held is answered with 503
    at once, the worker restarts, and the next request is served."""
    async with running_app(tiny_tower) as client:
        engine = client.app.state.engine
        real = engine.worker.device._run_batch
        calls = {"n": 0}

        def crashing(batch, generation):  # on the device thread
            calls["n"] += 1
            if calls["n"] == 1:
                raise KeyError("a bug in the loop")
            real(batch, generation)

        monkeypatch.setattr(engine.worker.device, "_run_batch", crashing)
        t0 = time.monotonic()
        r = await encode_json(client, [{"data": png_bytes(770, 28, 28)}])
        assert r.status_code == 503 and "KeyError" in r.json()["error"]["message"]
        assert time.monotonic() - t0 < 1.0
        await until(lambda: engine.worker.state is WorkerState.HEALTHY)
        r = await encode_json(client, [{"data": png_bytes(771, 28, 28)}])
        assert r.status_code == 200 and r.json()["items"][0]["status"] == "ready"
        assert engine.inflight.jobs == {} and engine.scheduler.staged_tokens == 0


async def test_out_of_memory_splits_the_batch_and_retries_down_to_one_image(tiny_tower, monkeypatch):
    """A forward that runs out of memory is split in halves and retried; only an image that does not
    fit even alone fails, with a per-item ``out_of_memory`` error. The rows equal the single-image forward."""
    small = [png_bytes(780 + i, 56, 56) for i in range(4)]  # 16 patches each
    big = png_bytes(790, 112, 112)  # 64 patches: over the limit even alone
    tower = FaultyTower(tiny_tower, oom_above_tokens=40)
    async with running_app(tower, max_batch_images=8) as client:
        r = await encode_in_one_batch(client, [{"data": d} for d in [*small, big]], monkeypatch)
        assert r.status_code == 200, r.text
        items = r.json()["items"]
        assert [it["status"] for it in items] == ["ready"] * 4 + ["error"]
        assert items[4]["reason"] == "out_of_memory"
        for data in small:
            np.testing.assert_allclose(await fetch_rows(client, sha(data)), reference(tiny_tower, data), atol=1e-5)
        # 5 ran out of memory, then its halves in turn: 2 fit, 3 did not (1 fits, 2 did not: 1, 1 alone)
        assert tower.batch_sizes == [5, 2, 3, 1, 2, 1, 1]
        assert (await client.get("/readyz")).status_code == 200  # an OOM is not a device failure
        m = (await client.get("/metrics")).text
        assert metric(m, "visenc_oom_splits_total") == 4  # the three splits and the lone image's failure
        assert metric(m, "visenc_worker_restarts_total") == 0
