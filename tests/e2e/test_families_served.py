"""Family checkpoints served end to end: the service's rows equal transformers' placeholder rows,
images of mixed sizes share batches, and ``/v1/model`` + ``/v1/model/layout`` describe the rows
and the placeholder span before any image exists."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import numpy as np
import pytest
from harness.tiny_families import build_family, placeholder_rows, reference_inputs, save_family
from PIL import Image
from tests.support.api import encode_json, fetch_rows, running_app, sha
from transformers import AutoImageProcessor

from visenc.models.loading import load_tower


def png(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("name", ["qwen3_vl", "gemma3", "mistral3", "idefics3"])
async def test_served_rows_equal_transformers(name: str, tmp_path: Path) -> None:
    path = save_family(name, tmp_path / name)
    tower = load_tower(str(path), image_backend="pil")
    model, _ = build_family(name)
    proc = AutoImageProcessor.from_pretrained(path, backend="pil")
    images = [png(w, h, i) for i, (w, h) in enumerate([(230, 150), (97, 61), (230, 150), (300, 120)])]
    async with running_app(tower, max_wait_ms=50.0) as client:
        info = (await client.get("/v1/model")).json()
        assert info["family"] == name and info["hidden_size"] == tower.hidden_size
        assert sum(col["width"] for col in info["row_layout"]) == tower.hidden_size
        # all at once, so that mixed sizes meet in the batcher
        answers = await asyncio.gather(*(encode_json(client, [{"hash": sha(d), "data": d}]) for d in images))
        for data, r in zip(images, answers, strict=True):
            assert r.status_code == 200, r.text
            (item,) = r.json()["items"]
            got = await fetch_rows(client, item["hash"])
            image = Image.open(io.BytesIO(data)).convert("RGB")
            inputs = reference_inputs(proc, image, tower.call_kwargs)
            ref = placeholder_rows(model, inputs, item["num_tokens"]).numpy()
            assert got.shape == ref.shape
            assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
            layout = (
                await client.get("/v1/model/layout", params={"width": image.width, "height": image.height})
            ).json()
            assert layout["num_tokens"] == item["num_tokens"]
            assert sum(seg.get("rows", 0) for seg in layout["span"]) == item["num_tokens"]


async def test_layout_states_spans_that_are_not_one_block(tmp_path: Path) -> None:
    tower = load_tower(str(save_family("mistral3", tmp_path / "m")), image_backend="pil")
    async with running_app(tower) as client:
        r = await client.get("/v1/model/layout", params={"width": 230, "height": 150})
        assert r.status_code == 200, r.text
        body = r.json()
        # 230x150 fits longest_edge 224 as 224x146 → multiples of the merged patch (28): 6x8 rows,
        # [IMG_BREAK] after each row but the last (PixtralProcessor's count: test_mistral3_processor.py)
        assert body["num_tokens"] == 48
        assert body["span"] == [{"rows": 8}, {"text": "[IMG_BREAK]"}] * 5 + [{"rows": 8}, {"text": "[IMG_END]"}]
        bad = await client.get("/v1/model/layout", params={"width": 0, "height": 10})
        assert bad.status_code == 422
        assert (await client.get("/readyz")).status_code == 200


async def test_qwen3_vl_rows_carry_deepstack_levels(tmp_path: Path) -> None:
    tower = load_tower(str(save_family("qwen3_vl", tmp_path / "q")), image_backend="pil")
    async with running_app(tower) as client:
        info = (await client.get("/v1/model")).json()
        names = [col["name"] for col in info["row_layout"]]
        assert names == ["main", "deepstack_1", "deepstack_2"]
        layout = (await client.get("/v1/model/layout", params={"width": 230, "height": 150})).json()
        assert layout["span"][0] == {"text": "<|vision_start|>"} and layout["span"][-1] == {"text": "<|vision_end|>"}
