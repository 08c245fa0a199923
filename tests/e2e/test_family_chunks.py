"""Chunked fetch per family: every prefill chunk's rows equal the VLM's own ``inputs_embeds`` there.

For each family, the prompt is one text token, the image's placeholder span as
``/v1/model/layout`` states it (each text piece written as one text token here, e.g.
Mistral 3's ``[IMG_BREAK]`` between rows of patches, Idefics3's tile markers), and one text
token. transformers' whole VLM runs on that prompt with the image's pixels (its own
placeholder check included) and the ``inputs_embeds`` its language model receives are
captured. visenc serves the same checkpoint; the image is placed with
``ImagePlacement.from_span`` and fetched chunk by chunk (dense layout, chunks of 7 positions):
at every image position of every chunk the fetched row equals the model's ``inputs_embeds``
row (for Qwen3-VL the row's ``main`` columns, and its ``deepstack_i`` columns equal the
deepstack features the model adds at that position), and text positions are left alone.
"""

from __future__ import annotations

import io
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from harness.tiny_families import (
    BUILDERS,
    IMAGE_TOKEN,
    build_family,
    language_model_inputs,
    reference_inputs,
    save_family,
)
from PIL import Image
from tests.support.api import running_app
from transformers import AutoImageProcessor

from visenc.models.base import compact
from visenc.models.loading import load_tower
from visenc_client import AsyncClient, ImagePlacement

TEXT_TOKEN = 7
CHUNK = 7


@pytest.mark.parametrize("name", sorted(BUILDERS))
async def test_every_chunk_equals_the_models_inputs_embeds(name: str, tmp_path: Path) -> None:
    path = save_family(name, tmp_path / name)
    tower = load_tower(str(path), image_backend="pil")
    model, _ = build_family(name)
    rng = np.random.default_rng(3)
    image = Image.fromarray(rng.integers(0, 256, (150, 230, 3), dtype=np.uint8))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    span = compact(tower.span(*image.size))  # what /v1/model/layout answers
    ids = [TEXT_TOKEN]
    for piece in span:
        ids += [IMAGE_TOKEN] * piece["rows"] if "rows" in piece else [TEXT_TOKEN]
    ids.append(TEXT_TOKEN)
    input_ids = torch.tensor([ids])
    proc = AutoImageProcessor.from_pretrained(path, backend="pil")
    embeds, deepstack = language_model_inputs(model, reference_inputs(proc, image, tower.call_kwargs), input_ids)
    is_image = input_ids[0] == IMAGE_TOKEN
    main = embeds.shape[1]

    async with running_app(tower) as client:
        transport = httpx.ASGITransport(app=client.app)  # type: ignore[attr-defined]
        async with AsyncClient("http://visenc", transport=transport) as vc:
            (handle,) = await vc.encode([buf.getvalue()], wait=True)
            layout = (await client.get("/v1/model/layout", params={"width": 230, "height": 150})).json()
            assert layout["span"] == span
            placement = ImagePlacement.from_span(handle, 1, layout["span"], lambda text: 1)
            assert placement.num_tokens == int(is_image.sum())
            for start in range(0, len(ids), CHUNK):
                end = min(len(ids), start + CHUNK)
                got = np.full((end - start, tower.hidden_size), np.nan, np.float32)
                await vc.fetch_chunk([placement], start, end, out=got, dense=True)
                for pos in range(start, end):
                    row = got[pos - start]
                    if not is_image[pos]:
                        assert np.isnan(row).all(), (name, pos)
                        continue
                    want = embeds[pos].numpy()
                    scale = np.abs(want).max()
                    assert np.abs(row[:main] - want).max() <= 1e-4 * scale, (name, pos)
                    k = int(is_image[:pos].sum())  # the image's k-th row
                    for level, feats in enumerate(deepstack, start=1):
                        extra = row[level * main : (level + 1) * main]
                        assert np.abs(extra - feats[k].numpy()).max() <= 1e-4 * np.abs(feats[k].numpy()).max()
