"""Every VLM family at random sizes: the handle's row count from the size alone, and the rows.

For each family (tiny seeded checkpoints, ``tests/support/tiny_families.py``) and seeded random
sizes (a few pixels up to three times the processor's largest side, aspect ratios up to 40:1, most
not multiples of any patch, merge or tile size), in both image-processor backends:

- ``layout(width, height)`` (what a ``pending`` handle says, before any decode) is the number of
  rows transformers' VLM places at the image's placeholders: the model's own check (placeholder
  tokens == feature rows) runs on that count with the processor's own ``pixel_values``;
- the tower's rows equal those placeholder rows (fp32, within 1e-4 of the largest value).

A size the tower refuses (``InvalidImage``) is one the processor refuses too, or one under the
model's smallest input. Heights of 1 and 3 pixels are left out: transformers' processors read an
array that short as channels-first (they guess the channel axis from the shape).
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from tests.support.tiny_families import (
    BACKENDS,
    BUILDERS,
    build_family,
    placeholder_rows,
    reference_inputs,
    save_family,
)
from transformers import AutoImageProcessor

from visenc.errors import InvalidImage
from visenc.models.loading import load_tower

SIZES_PER_FAMILY = 16


def random_sizes(rng: np.random.Generator, largest: int, n: int) -> list[tuple[int, int]]:
    sizes = []
    while len(sizes) < n:
        side = float(np.exp(rng.uniform(np.log(8), np.log(3 * largest))))
        ratio = float(np.exp(rng.uniform(-np.log(40), np.log(40))))
        w, h = round(side * ratio**0.5), round(side / ratio**0.5)
        if w >= 2 and h >= 4 and h != 3:
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
    for width, height in random_sizes(rng, largest_side(proc), SIZES_PER_FAMILY):
        image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        try:
            layout = tower.layout(width, height)
        except InvalidImage:
            with pytest.raises((InvalidImage, ValueError, RuntimeError)):
                placeholder_rows(model, reference_inputs(proc, image, tower.call_kwargs), 1)
            continue
        want = placeholder_rows(model, reference_inputs(proc, image, tower.call_kwargs), layout.num_tokens)
        rows = tower.forward([tower.preprocess(image)])[0]
        assert rows.shape == want.shape == (layout.num_tokens, tower.hidden_size), (name, width, height)
        scale = want.abs().max().item()
        assert (rows - want).abs().max().item() <= 1e-4 * scale, (name, width, height)
        checked += 1
    assert checked >= SIZES_PER_FAMILY // 2, f"{name}: too few sizes accepted"
