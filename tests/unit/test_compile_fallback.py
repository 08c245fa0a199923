"""A tower whose blocks the compiler backend fails to compile runs eagerly: same rows, no error,
no graph (``models/compiled.py``), and the service is ready on it and says why; so it does when the
warm-up compiled no graph at all without an error (dynamo disabled)."""

from __future__ import annotations

import base64
import io
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import torch._inductor.compile_fx
from harness.processes import serve_subprocess
from harness.waits import until
from PIL import Image
from tests.support.api import running_app

from visenc.models import compiled
from visenc.models.loading import load_tower

pytestmark = pytest.mark.slow


@pytest.fixture
def broken_backend(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """inductor raises as it does on a host without a working compiler; dynamo's caches start and end
    empty (a frame that failed to compile is otherwise skipped for the rest of the process)."""

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no C++ compiler found")

    torch._dynamo.reset()
    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", fail)
    yield
    monkeypatch.undo()
    torch._dynamo.reset()


@pytest.mark.parametrize("spec", ["tiny-clip", "tiny-qwen2-vl"])
def test_a_block_that_fails_to_compile_runs_eagerly(broken_backend: None, spec: str) -> None:
    eager, fast = load_tower(spec), load_tower(spec)
    assert fast.compile() >= 2
    before = compiled.graphs()
    fast.warm_up()  # does not raise
    assert compiled.graphs() == before
    rng = np.random.default_rng(5)
    batch = [
        fast.preprocess(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)))
        for w, h in [(224, 224), (300, 200)]
    ]
    for a, b in zip(eager.forward(batch), fast.forward(batch), strict=True):
        torch.testing.assert_close(b, a, atol=0, rtol=0)


async def test_the_service_is_ready_on_a_tower_that_failed_to_compile(
    broken_backend: None, caplog: pytest.LogCaptureFixture
) -> None:
    tower = load_tower("tiny-clip")
    tower.compile()
    with caplog.at_level(logging.WARNING, logger="visenc.engine.worker"):
        async with running_app(tower) as client:
            await until(lambda: _ready(client), 60, "ready on the eager tower")
            detail = (await client.get("/readyz")).json()["compile"]
            r = await client.post("/v1/encode", json={"items": [{"data": _png()}], "wait": True})
            assert r.status_code == 200 and r.json()["items"][0]["status"] == "ready", r.text
            metrics = (await client.get("/metrics")).text
    # the why, in /readyz, the metric and the log: the backend's own error
    assert detail["state"] == "eager" and detail["cause"] == "backend", detail
    assert "no C++ compiler found" in detail["detail"]
    assert 'visenc_compile_state{cause="backend",state="eager"} 1.0' in metrics
    assert any("runs eagerly (backend)" in r.getMessage() for r in caplog.records)
    assert tower.compiled_blocks == 0  # uncompiled: the blocks never enter dynamo again


def test_a_server_whose_warm_up_compiled_nothing_says_it_runs_eagerly(tmp_path: Path) -> None:
    """``TORCHDYNAMO_DISABLE=1``: ``torch.compile`` leaves every block eager and reports no error.
    The warm-up built no graph, so ``/readyz``, the metric and the log say eager, not compiled
    (``tests/unit/test_warm_up.py``'s real server, without the variable, says compiled)."""
    log = tmp_path / "serve.log"
    with serve_subprocess("--compile", "on", env={"TORCHDYNAMO_DISABLE": "1"}, log=log) as (url, _):
        detail = httpx.get(f"{url}/readyz", timeout=10).json()["compile"]
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert detail["state"] == "eager" and detail["cause"] == "backend", detail
    assert "compiled no graph" in detail["detail"]
    assert 'visenc_compile_state{cause="backend",state="eager"} 1.0' in metrics
    assert "the tower runs eagerly (backend)" in log.read_text()


def _png() -> str:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(9).integers(0, 256, (240, 320, 3), dtype=np.uint8)).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


async def _ready(client: Any) -> bool:
    return (await client.get("/readyz")).status_code == 200
