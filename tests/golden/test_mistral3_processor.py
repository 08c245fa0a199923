"""Mistral 3 against transformers' full ``PixtralProcessor`` (not only its image processor).

The processor asks its image processor for multiples of a *merged* patch (``patch_size *
spatial_merge_size``), and writes ``[IMG]`` placeholders, ``[IMG_BREAK]`` after each row and
``[IMG_END]`` last. At random sizes (seeded; 1 px up to past ``longest_edge``, every aspect ratio,
most not multiples of the patch or the merged patch), in both image-processor backends:

- the handle's token count (``layout``, from the size alone) equals the processor's ``[IMG]`` count;
- the span (rows and break/end tokens) equals the processor's placeholder text;
- the rows equal what the VLM places into ``inputs_embeds`` at those placeholders when it is given
  the processor's own ``pixel_values`` (fp32, within 1e-4 of the largest value).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from harness.tiny_families import IMAGE_TOKEN, build_family, language_model_inputs, save_family
from PIL import Image
from tests.support.tiny_processors import BACKENDS
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoImageProcessor, PixtralProcessor, PreTrainedTokenizerFast

from visenc.errors import InvalidImage
from visenc.models.base import Rows
from visenc.models.loading import load_tower

SPECIALS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]


def sizes(n: int = 24) -> list[tuple[int, int]]:
    rng = np.random.default_rng(28)
    picked = [(256, 256), (1, 1), (27, 29), (300, 5), (5, 300), (224, 223)]
    while len(picked) < n:
        w, h = (int(x) for x in np.exp(rng.uniform(0, np.log(700), 2)))
        picked.append((max(1, w), max(1, h)))
    picked += [(57, 1), (100, 3), (1, 57), (3, 100)]  # sides an HWC array's shape makes look like channels
    return picked


def _tokenizer() -> PreTrainedTokenizerFast:
    """Every placeholder its own token ("[IMG]" is id 0, as the tiny model's image token is remapped)."""
    tok = Tokenizer(models.WordLevel({"[UNK]": 3, **{s: i for i, s in enumerate(SPECIALS)}}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = save_family("mistral3", tmp_path_factory.mktemp("mistral3"))
    model, _ = build_family("mistral3")
    return path, model


@pytest.mark.parametrize("backend", BACKENDS)
def test_tokens_span_and_rows_equal_pixtral_processor(checkpoint: tuple[Path, Any], backend: str) -> None:
    path, model = checkpoint
    tower = load_tower(str(path), image_backend=backend)
    config = model.config
    processor = PixtralProcessor(
        image_processor=AutoImageProcessor.from_pretrained(path, backend=backend),
        tokenizer=_tokenizer(),
        patch_size=config.vision_config.patch_size,
        spatial_merge_size=config.spatial_merge_size,
    )
    rng = np.random.default_rng(3)
    for width, height in sizes():
        image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        out = processor(text="[IMG]", images=[image], return_tensors="pt")
        ids = out["input_ids"][0]
        placeholders = int((ids == 0).sum())
        try:
            layout = tower.layout(width, height)
        except InvalidImage:
            assert placeholders == 0, (width, height)
            continue
        assert layout.num_tokens == placeholders, (width, height)
        span = "".join("[IMG]" * s.count if isinstance(s, Rows) else s for s in tower.span(width, height))
        assert span == "".join(processor.tokenizer.convert_ids_to_tokens(ids.tolist())), (width, height)
        if placeholders == 1:  # transformers' own Mistral3Model cannot run a one-row image (it squeezes
            continue  # the row away; visenc's forward runs such an image beside a copy of itself)
        prepared = tower.preprocess(image)
        rows = tower.forward([prepared])[0]
        lm_ids = torch.where(ids == 0, IMAGE_TOKEN, 1)[None]  # the tiny VLM's own image-token id
        inputs = {"pixel_values": out["pixel_values"], "image_sizes": out["image_sizes"]}
        embeds, _ = language_model_inputs(model, inputs, lm_ids)
        want = embeds[lm_ids[0] == IMAGE_TOKEN]
        scale = want.abs().max().item()
        assert rows.shape == want.shape, (width, height)
        assert (rows - want).abs().max().item() <= 1e-4 * scale, (width, height)
