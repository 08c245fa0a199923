"""The compiled tower (``models/compiled.py``) on the CPU, where inductor compiles too:

- compiled rows equal eager rows (packed Qwen2/2.5-VL batches of mixed sizes, a fixed-size tower);
- after the warm-up, a stream of new image and batch sizes compiles no new graph;
- ``--compile`` / ``VISENC_COMPILE``: auto is on for CUDA only;
- a service on a compiled tower is not ready until its warm-up has built the graphs, then serves
  the eager tower's rows.
"""

from __future__ import annotations

import asyncio
import base64
import io
import threading
from typing import Any

import numpy as np
import pytest
import torch
from harness.tiny_families import save_family
from harness.waits import until
from PIL import Image
from tests.support.api import running_app

from visenc.cli import build_parser
from visenc.config import Settings
from visenc.imaging.decode import decode
from visenc.models import compiled
from visenc.models.loading import load_tower

pytestmark = pytest.mark.slow


def _batch(tower: Any, sizes: list[tuple[int, int]], seed: int = 3) -> list[Any]:
    rng = np.random.default_rng(seed)
    return [tower.preprocess(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))) for w, h in sizes]


@pytest.fixture(scope="module", params=["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-clip", "qwen3_vl"])
def towers(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """(eager, compiled and warmed up) towers with the same weights (Qwen3-VL: a family's checkpoint,
    transformers' own forward, deepstack rows)."""
    spec = request.param
    if spec == "qwen3_vl":
        spec = str(save_family(spec, tmp_path_factory.mktemp(spec)))
    eager, fast = load_tower(spec), load_tower(spec)
    assert fast.compile() >= 2
    before = compiled.graphs()
    fast.warm_up()
    assert compiled.graphs() > before  # compiled, not run eagerly past the recompile limit
    return eager, fast


def test_compiled_rows_equal_eager_rows(towers: tuple[Any, Any]) -> None:
    eager, fast = towers
    batch = _batch(eager, [(224, 224), (300, 200), (97, 131), (640, 480)])
    for a, b in zip(eager.forward(batch), fast.forward(batch), strict=True):
        torch.testing.assert_close(b, a, atol=1e-5 * a.abs().max().item(), rtol=0)


def test_new_sizes_after_the_warm_up_compile_no_graph(towers: tuple[Any, Any]) -> None:
    _, fast = towers
    before = compiled.graphs()
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 5, 1, 4, 2, 6):
        sizes = [(int(rng.integers(56, 700)), int(rng.integers(56, 700))) for _ in range(n)]
        rows = fast.forward(_batch(fast, sizes))
        assert len(rows) == n
    assert compiled.graphs() == before
    assert before <= compiled.RECOMPILE_LIMIT * 3  # a handful, whatever the sizes seen


def test_compile_defaults_to_the_device_and_is_a_flag_and_a_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert not compiled.wanted("auto", cpu) and compiled.wanted("auto", cuda)
    assert compiled.wanted("on", cpu) and not compiled.wanted("off", cuda)
    assert build_parser().parse_args(["serve", "--compile", "off"]).compile == "off"
    monkeypatch.setenv("VISENC_COMPILE", "on")
    assert Settings().compile == "on"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--compile", "sometimes"])


async def test_the_service_is_ready_once_its_compiled_tower_is_warm() -> None:
    eager, tower = load_tower("tiny-qwen2-vl"), load_tower("tiny-qwen2-vl")
    tower.compile()
    release, warming = threading.Event(), threading.Event()
    real_warm_up = tower.warm_up

    def held_warm_up() -> None:
        warming.set()
        assert release.wait(60)
        real_warm_up()

    tower.warm_up = held_warm_up
    async with running_app(tower) as client:
        await asyncio.to_thread(warming.wait, 60)
        r = await client.get("/readyz")
        assert r.status_code == 503 and "compiling" in r.json()["error"]["message"]
        release.set()
        await until(lambda: _ready(client), 60, "ready once warm")
        metrics = (await client.get("/metrics")).text
        graphs = next(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("visenc_compiled_"))
        assert graphs >= 1
        png = _png(320, 240)
        r = await client.post("/v1/encode", json={"items": [{"data": png}], "wait": True})
        assert r.status_code == 200, r.text
        h = r.json()["items"][0]
        got = await client.get(f"/v1/embeddings/{h['hash']}")
    rows = np.frombuffer(got.content, np.float32).reshape(h["num_tokens"], h["hidden_size"])
    want = eager.forward([eager.preprocess(decode(base64.b64decode(png), max_pixels=1 << 30))])[0].numpy()
    np.testing.assert_allclose(rows, want, atol=1e-5 * np.abs(want).max(), rtol=0)


def _png(w: int, h: int) -> str:
    rng = np.random.default_rng(9)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


async def _ready(client: Any) -> bool:
    return (await client.get("/readyz")).status_code == 200


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (compiled CUDA graphs)")
@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-qwen2.5-vl"])
def test_cuda_compiled_rows_equal_eager_rows_in_bf16(name: str) -> None:
    eager = load_tower(name, device="cuda", dtype="bfloat16")
    fast = load_tower(name, device="cuda", dtype="bfloat16")
    fast.compile()
    fast.warm_up()
    batch = _batch(eager, [(224, 224), (300, 200), (97, 131), (640, 480)])
    for a, b in zip(eager.forward(batch), fast.forward(batch), strict=True):
        torch.testing.assert_close(b.float(), a.float(), atol=2e-2 * a.float().abs().max().item(), rtol=0)
