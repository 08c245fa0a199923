"""A compiled tower's warm-up never crash-loops the service (``engine/worker.py``, ``models/compiled.py``).

The warm-up is a simulated long compile (``tests.support.faults.FaultyTower``): it holds dynamo's
compile lock, as a cold compile of a large tower does, for longer than ``stall_timeout_s``.

- The warm-up has its own time limit, not ``stall_timeout_s``: the service says "warming up" the
  whole time, then becomes ready once, with no stall, no restart (in-process, and as a real
  ``visenc serve`` whose stall timeout is a fraction of the warm-up).
- Past its own limit (``warm_up_timeout_s``), the tower serves eagerly: the probe of a fresh device
  thread does not wait for the compile lock the abandoned warm-up still holds, and the rows are
  the eager tower's.
- Whether the tower runs compiled, and why not, is in ``/readyz``, ``visenc_compile_state`` and the log.
"""

from __future__ import annotations

import asyncio
import base64
import io
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from harness.processes import serve_subprocess
from harness.waits import until
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families
from tests.support.api import running_app
from tests.support.faults import FaultyTower
from tests.support.serve_faulty import launcher as faulty

from visenc import bootstrap
from visenc.config import Settings
from visenc.imaging.decode import decode
from visenc.models import compiled
from visenc.models.loading import load_tower

STALL_S = 0.2


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """Dynamo's caches empty before and after: the graphs built here are not another test's."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()  # waits for dynamo's lock: after ``gate`` has let the simulated compile end


@pytest.fixture
def gate(fresh_dynamo: None) -> Iterator[threading.Event]:
    """Opens the simulated compile at the end of the test whatever happens (it holds dynamo's lock)."""
    event = threading.Event()
    yield event
    event.set()


def _compiled_tower(gate: threading.Event) -> FaultyTower:
    inner = load_tower("tiny-qwen2-vl")
    assert inner.compile() >= 2
    return FaultyTower(inner, warm_up_gate=gate)


def _sample(text: str, name: str, **labels: str) -> float:
    """One sample of ``/metrics`` text."""
    values = [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and sample.labels == labels
    ]
    assert len(values) == 1, (name, labels, values)
    return values[0]


async def test_a_warm_up_longer_than_the_stall_timeout_is_ready_once_without_a_restart(gate: threading.Event) -> None:
    tower = _compiled_tower(gate)
    async with running_app(tower, stall_timeout_s=STALL_S) as client:
        await asyncio.to_thread(tower.warming.wait, 60)
        held_since = time.monotonic()
        answers: list[Any] = []

        async def past_five_stall_timeouts() -> bool:
            answers.append(await client.get("/readyz"))
            return time.monotonic() - held_since > 5 * STALL_S

        await until(past_five_stall_timeouts, 60, "the warm-up held past five stall timeouts")
        assert {r.status_code for r in answers} == {503}
        assert all("warming up: compiling" in r.json()["error"]["message"] for r in answers)
        metrics = (await client.get("/metrics")).text
        assert _sample(metrics, "visenc_compile_state", state="warming", cause="none") == 1
        gate.set()
        await until(lambda: _ready(client), 60, "ready once warm")
        ready = await client.get("/readyz")
        assert ready.json()["compile"]["state"] == "compiled"
        metrics = (await client.get("/metrics")).text
    assert _sample(metrics, "visenc_worker_restarts_total") == 0
    assert _sample(metrics, "visenc_worker_stalls_total") == 0
    assert _sample(metrics, "visenc_compile_state", state="compiled", cause="none") == 1
    assert _sample(metrics, "visenc_compile_state", state="warming", cause="none") == 0


async def test_a_warm_up_past_its_limit_serves_eagerly(gate: threading.Event) -> None:
    """The abandoned warm-up still holds dynamo's compile lock (the gate stays shut): the restart's
    probe and the requests run the eager tower, which never asks for it."""
    tower = _compiled_tower(gate)
    eager = load_tower("tiny-qwen2-vl")
    async with running_app(tower, stall_timeout_s=30.0, warm_up_timeout_s=0.5) as client:
        await until(lambda: _ready(client), 60, "ready on the eager tower")
        assert not gate.is_set()
        detail = (await client.get("/readyz")).json()["compile"]
        assert detail["state"] == "eager" and detail["cause"] == "warm_up_timeout", detail
        assert "warm_up_timeout_s=0.5" in detail["detail"]
        png = _png()
        r = await client.post("/v1/encode", json={"items": [{"data": png}], "wait": True})
        assert r.status_code == 200 and r.json()["items"][0]["status"] == "ready", r.text
        h = r.json()["items"][0]
        got = await client.get(f"/v1/embeddings/{h['hash']}")
        metrics = (await client.get("/metrics")).text
    assert _sample(metrics, "visenc_compile_state", state="eager", cause="warm_up_timeout") == 1
    assert _sample(metrics, "visenc_worker_restarts_total") == 1  # the probe of the fresh device thread
    assert tower.compiled_blocks == 0
    rows = np.frombuffer(got.content, np.float32).reshape(h["num_tokens"], h["hidden_size"])
    want = eager.forward([eager.preprocess(decode(base64.b64decode(png), max_pixels=1 << 30))])[0].numpy()
    np.testing.assert_allclose(rows, want, atol=1e-6 * np.abs(want).max(), rtol=0)


async def test_left_compiled_past_its_limit_the_worker_dies(
    gate: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control of the test above: the blocks left compiled after the warm-up is abandoned, the
    probe's first call of a block waits for the compile lock the abandoned warm-up holds, stalls, and
    the worker gives up (the process would exit and compile cold again: a crash loop)."""
    monkeypatch.setattr(compiled, "uncompile_blocks", lambda model: None)
    tower = _compiled_tower(gate)
    settings = {"stall_timeout_s": 0.5, "warm_up_timeout_s": 0.5, "worker_restart_attempts": 1}
    async with running_app(tower, **settings) as client:
        app = client.app  # type: ignore[attr-defined]
        await until(lambda: app.state.fatal is not None, 60, "the worker gave up")
        assert "the probe forward ran longer than stall_timeout_s" in app.state.fatal, app.state.fatal
        assert (await client.get("/readyz")).status_code == 503
        gate.set()  # the abandoned compile ends; the stalled probe behind it with it


def test_a_real_server_warming_longer_than_its_stall_timeout_does_not_exit(tmp_path: Path) -> None:
    """``visenc serve --compile on --stall-timeout-s 0.3`` with a 3 s warm-up: ready, once, still running."""
    log = tmp_path / "serve.log"
    args = ("--compile", "on", "--stall-timeout-s", "0.3", "--max-wait-ms", "1")
    with serve_subprocess(*args, log=log, launcher=faulty("--warm-up-delay-s", "3")) as (url, proc):
        assert proc.poll() is None
        ready = httpx.get(f"{url}/readyz", timeout=10)
        assert ready.status_code == 200 and ready.json()["compile"]["state"] == "compiled", ready.text
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert _sample(metrics, "visenc_worker_restarts_total") == 0
    text = log.read_text()
    assert "the tower runs compiled" in text and "compiled tower warmed up" in text


async def test_a_tower_off_by_setting_says_so() -> None:
    """Not compiled (compile=auto on a CPU, as start-up loads it): the why is in ``/readyz`` and the metric."""
    tower = bootstrap.load_tower(Settings(model="tiny-qwen2-vl"))
    assert tower.compilation.state == "eager" and tower.compiled_blocks == 0
    async with running_app(tower) as client:
        await until(lambda: _ready(client), 30, "ready")
        detail = (await client.get("/readyz")).json()["compile"]
        metrics = (await client.get("/metrics")).text
    assert detail == {
        "state": "eager",
        "cause": "setting",
        "detail": "compile=auto on cpu (auto compiles on CUDA only)",
    }
    assert _sample(metrics, "visenc_compile_state", state="eager", cause="setting") == 1


async def _ready(client: Any) -> bool:
    return (await client.get("/readyz")).status_code == 200


def _png() -> str:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (200, 260, 3), dtype=np.uint8)).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()
