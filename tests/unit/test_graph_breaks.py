"""Mistral 3's compiled blocks run without a graph break (``models/families/mistral3.py``).

Transformers' Pixtral records the hidden state ``vision_feature_layer`` selects through a forward
hook on every block; the hook reads a ``ContextVar``, which dynamo cannot trace, so each compiled
block breaks its graph on every forward. The tower runs the blocks itself and keeps the state it
needs: its forward under ``torch.compile`` (inductor, on the CPU) breaks no graph, while
transformers' own ``get_image_features`` on the same compiled blocks breaks at least once a block.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tests.support.tiny_families import save_family
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
