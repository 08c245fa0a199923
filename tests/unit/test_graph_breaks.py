"""Mistral 3's compiled blocks run without a graph break (``models/families/mistral3.py``).

Transformers' Pixtral records the hidden state ``vision_feature_layer`` selects through a forward
hook on every block; the hook reads a ``ContextVar``, which dynamo cannot trace, so each compiled
block breaks its graph on every forward. The tower runs the blocks itself and keeps the state it
needs: its forward under ``torch.compile`` (inductor, on the CPU) breaks no graph, while
transformers' own ``get_image_features`` on the same compiled blocks breaks at least once a block.
Like transformers' selection, it keeps only the hidden states it selects: each block's input is
freed once the next block has it (a state per block would be kept for the whole forward otherwise),
and whichever state ``vision_feature_layer`` names, its rows equal transformers' own.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from harness.tiny_families import build_family, save_family
from PIL import Image
from torch._dynamo.utils import counters

from visenc.models import compiled
from visenc.models.loading import load_tower

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_family("mistral3", tmp_path_factory.mktemp("mistral3"))


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """Dynamo's caches empty, so the forward below traces (and counts) every block again; emptied
    again after it."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _breaks() -> int:
    return sum(counters["graph_break"].values())


def _batch(tower: object) -> list[object]:
    rng = np.random.default_rng(2)
    return [
        tower.preprocess(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)))  # type: ignore[attr-defined]
        for w, h in [(224, 224), (300, 200)]
    ]


def test_the_compiled_blocks_break_no_graph(checkpoint: Path, fresh_dynamo: None) -> None:
    tower = load_tower(str(checkpoint), image_backend="pil")
    assert tower.compile() >= 2
    breaks, graphs = _breaks(), compiled.graphs()
    for batch in (_batch(tower)[:1], _batch(tower)):
        tower.forward(batch)
    assert compiled.graphs() > graphs  # the blocks compiled
    assert _breaks() == breaks, dict(counters["graph_break"])


def test_transformers_own_path_breaks_each_block(checkpoint: Path, fresh_dynamo: None) -> None:
    """The check can fail: the hook's graph break shows up on the model's own path (blocks compiled
    with dynamo's eager backend: the break is dynamo's, whatever the backend)."""
    tower = load_tower(str(checkpoint), image_backend="pil")
    blocks = compiled.blocks(tower.model)
    for block in blocks:
        block.compile(backend="eager", dynamic=True)
    inputs = tower.collate([p.pixels for p in _batch(tower)[:1]])  # type: ignore[attr-defined]
    breaks = _breaks()
    with torch.inference_mode():
        tower.model.get_image_features(**inputs)
    assert _breaks() - breaks >= len(blocks)


def test_only_the_selected_hidden_states_stay_alive(checkpoint: Path) -> None:
    """When the last block runs, of the earlier blocks' inputs and outputs only its own input is
    alive: ``vision_feature_layer=-1`` selects the last block's output alone."""
    tower = load_tower(str(checkpoint), image_backend="pil")
    vision = tower.model.vision_tower
    assert tower.config.vision_feature_layer == -1 and len(vision.transformer.layers) >= 2
    states: list[weakref.ref[torch.Tensor]] = []
    alive: list[list[bool]] = []

    def made(module: Any, args: Any, output: torch.Tensor) -> None:
        states.append(weakref.ref(output))

    def last_block(module: Any, args: Any) -> None:
        alive.append([ref() is not None and ref() is not args[0] for ref in states])

    hooks = [vision.ln_pre.register_forward_hook(made)]
    hooks += [layer.register_forward_hook(made) for layer in vision.transformer.layers[:-1]]
    hooks.append(vision.transformer.layers[-1].register_forward_pre_hook(last_block))
    try:
        tower.forward(_batch(tower))
    finally:
        for hook in hooks:
            hook.remove()
    assert alive == [[False] * len(vision.transformer.layers)], alive


@pytest.mark.parametrize("chosen", [-1, [0], [-2]], ids=["last", "blocks-input", "middle"])
def test_each_selection_gives_transformers_rows(chosen: int | list[int], tmp_path: Path) -> None:
    """Whichever hidden state ``vision_feature_layer`` names (the last block's output, the blocks'
    input, a middle block's output; a list as the config allows it), the rows equal transformers'
    own ``get_image_features`` on the same weights. (A list of more than one layer fails in
    transformers' own projector, whose norm is one layer wide.)"""
    model, proc = build_family("mistral3")
    model.config.vision_feature_layer = chosen
    model.save_pretrained(tmp_path)
    proc.save_pretrained(tmp_path)
    tower = load_tower(str(tmp_path), image_backend="pil")
    prepared = _batch(tower)
    for prep, rows in zip(prepared, tower.forward(prepared), strict=True):
        inputs = tower.collate([prep.pixels])  # type: ignore[attr-defined]
        with torch.inference_mode():
            ref = model.model.get_image_features(**inputs, vision_feature_layer=chosen).pooler_output[0]
        scale = ref.abs().max().item()
        assert rows.shape == ref.shape and scale > 0
        torch.testing.assert_close(rows, ref, atol=1e-5 * scale, rtol=0)
