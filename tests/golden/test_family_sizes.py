"""Every VLM family at random sizes: the handle's row count from the size alone, and the rows.

For each family (tiny seeded checkpoints, ``harness/tiny_families.py``) and seeded random
sizes (a few pixels up to three times the processor's largest side, aspect ratios up to 40:1, most
not multiples of any patch, merge or tile size), in both image-processor backends:

- ``layout(width, height)`` (what a ``pending`` handle says, before any decode) is the number of
  rows transformers' VLM places at the image's placeholders: the model's own check (placeholder
  tokens == feature rows) runs on that count with the processor's own ``pixel_values``;
- the tower's rows equal those placeholder rows (fp32, within 1e-4 of the largest value).

A size the tower refuses (``InvalidImage``) is one the processor refuses too, or one under the
model's smallest input. Besides the random sizes, every family takes the degenerate ones (1x1, 2x2,
one or three pixels on a side, where transformers' processors guess the channel axis from the
shape, and the tower, handed the same image, follows the same guess; where the processor then
refuses the size, visenc refuses the image when it preprocesses it). transformers' Mistral 3
cannot embed an image of a single row (``get_image_features`` squeezes the one row away): that
one case is checked to be exactly that, and visenc's row for it is the forward without the squeeze.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from harness.tiny_families import (
    BUILDERS,
    build_family,
    placeholder_rows,
    reference_inputs,
    save_family,
)
from PIL import Image
from tests.support.tiny_processors import BACKENDS
from transformers import AutoImageProcessor

from visenc.errors import InvalidImage
from visenc.models.loading import load_tower

SIZES_PER_FAMILY = 16
DEGENERATE = [(1, 1), (2, 2), (57, 1), (1, 57), (100, 3), (3, 100), (640, 1), (1, 640), (28, 28)]


def random_sizes(rng: np.random.Generator, largest: int, n: int) -> list[tuple[int, int]]:
    sizes = []
    while len(sizes) < n:
        side = float(np.exp(rng.uniform(np.log(8), np.log(3 * largest))))
        ratio = float(np.exp(rng.uniform(-np.log(40), np.log(40))))
        w, h = round(side * ratio**0.5), round(side / ratio**0.5)
        if w >= 1 and h >= 1:
            sizes.append((w, h))
    return sizes


def largest_side(proc: Any) -> int:
    size = getattr(proc, "size", None) or {}
    size = size if isinstance(size, dict) else size.__dict__
    candidates = [v for k, v in size.items() if isinstance(v, int) and k in ("longest_edge", "height", "width")]
    pixels = size.get("longest_edge") if "shortest_edge" in size else None  # Qwen-style: a pixel count
    if pixels and pixels > 4096:
        return int(pixels**0.5)
    return max(candidates or [448])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_layout_and_rows_equal_the_vlm_at_random_sizes(name: str, backend: str, tmp_path: Path) -> None:
    path = save_family(name, tmp_path / name)
    model, _ = build_family(name)
    tower = load_tower(str(path), image_backend=backend)
    proc = AutoImageProcessor.from_pretrained(path, backend=backend)
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    checked = 0
    for width, height in DEGENERATE + random_sizes(rng, largest_side(proc), SIZES_PER_FAMILY):
        image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        try:
            layout = tower.layout(width, height)
        except InvalidImage:
            with pytest.raises((InvalidImage, ValueError, RuntimeError)):
                placeholder_rows(model, reference_inputs(proc, image, tower.call_kwargs), 1)
            continue
        try:
            inputs = reference_inputs(proc, image, tower.call_kwargs)
        except ValueError:  # the processor refuses the size it read (its channel-axis guess): visenc too
            with pytest.raises(InvalidImage):
                tower.preprocess(image)
            continue
        try:
            want = placeholder_rows(model, inputs, layout.num_tokens)
        except RuntimeError as e:  # transformers' Mistral 3 squeezes a one-row image's features away
            assert name == "mistral3" and layout.num_tokens == 1 and "split_with_sizes" in str(e), (name, e)
            assert tower.forward([tower.preprocess(image)])[0].shape == (1, tower.hidden_size)
            continue
        rows = tower.forward([tower.preprocess(image)])[0]
        assert rows.shape == want.shape == (layout.num_tokens, tower.hidden_size), (name, width, height)
        scale = want.abs().max().item()
        assert (rows - want).abs().max().item() <= 1e-4 * scale, (name, width, height)
        checked += 1
    assert checked >= (len(DEGENERATE) + SIZES_PER_FAMILY) // 2, f"{name}: too few sizes accepted"
