"""Every VLM family, from a saved full-VLM checkpoint: rows equal transformers' placeholder rows.

Per family (tiny seeded checkpoints from ``harness/tiny_families.py``), for images that
need a resize, odd aspect ratios and tiny sizes, in both image-processor backends:

- the service tower's rows equal the rows transformers' own VLM places into ``inputs_embeds``
  at the image's placeholder positions (fp32, within 1e-4 of the largest value; the model's own
  check that placeholders and features agree in number runs on the way, so ``layout``'s
  count from the size alone is checked too);
- a batch of mixed sizes equals each image's single forward (1e-5);
- the span's rows add up to the layout's rows;
- a checkpoint whose vision weights differ gives other rows (the comparison can fail);
- Hub-style tensor names (no ``model.`` prefix) load to the same rows: prefixes are derived.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from harness.tiny_families import (
    BUILDERS,
    build_family,
    placeholder_rows,
    reference_inputs,
    save_family,
)
from PIL import Image
from safetensors.torch import load_file, save_file
from tests.support.tiny_processors import BACKENDS
from transformers import AutoImageProcessor

from visenc.errors import InvalidImage
from visenc.models.base import Rows
from visenc.models.loading import load_tower

SIZES = [(230, 150), (61, 97), (120, 300), (640, 90), (45, 40)]


def _images() -> list[Image.Image]:
    rng = np.random.default_rng(7)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in SIZES]


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Any]:
    name = request.param
    path = save_family(name, tmp_path_factory.mktemp(name))
    model, _ = build_family(name)
    return name, path, model


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_equal_transformers_placeholder_rows(family: tuple[str, Path, Any], backend: str) -> None:
    name, path, model = family
    tower = load_tower(str(path), image_backend=backend)
    proc = AutoImageProcessor.from_pretrained(path, backend=backend)
    assert tower.image_backend == backend
    images = _images()
    prepared = [tower.preprocess(im) for im in images]
    batched = tower.forward(prepared)
    for image, prep, rows in zip(images, prepared, batched, strict=True):
        ref = placeholder_rows(model, reference_inputs(proc, image, tower.call_kwargs), prep.layout.num_tokens)
        assert rows.shape == (prep.layout.num_tokens, tower.hidden_size) == ref.shape, (name, image.size)
        scale = ref.abs().max().item()
        assert scale > 0
        assert (rows - ref).abs().max().item() <= 1e-4 * scale, (name, image.size)
        single = tower.forward([prep])[0]
        torch.testing.assert_close(rows, single, atol=1e-5 * scale, rtol=0)
        span_rows = sum(seg.count for seg in tower.span(*image.size) if isinstance(seg, Rows))
        assert span_rows == prep.layout.num_tokens


def test_other_vision_weights_give_other_rows(family: tuple[str, Path, Any], tmp_path: Path) -> None:
    name, path, _ = family
    other = save_family(name, tmp_path / "other", seed=1)
    image = _images()[0]
    a, b = (load_tower(str(p), image_backend="pil") for p in (path, other))
    assert a.fingerprint != b.fingerprint
    rows_a = a.forward([a.preprocess(image)])[0]
    rows_b = b.forward([b.preprocess(image)])[0]
    assert (rows_a - rows_b).abs().max().item() > 1e-3 * rows_a.abs().max().item()


def test_hub_style_names_load_the_same_rows(family: tuple[str, Path, Any], tmp_path: Path) -> None:
    """Hub checkpoints of these families name vision tensors without the ``model.`` that
    ``save_pretrained`` writes; the loader finds them either way."""
    _name, path, _ = family
    hub = tmp_path / "hub"
    hub.mkdir()
    tensors = load_file(path / "model.safetensors")
    save_file({k.removeprefix("model."): v.contiguous() for k, v in tensors.items()}, hub / "model.safetensors")
    for f in path.iterdir():
        if f.suffix == ".json":
            (hub / f.name).write_text(f.read_text())
    image = _images()[1]
    a, b = (load_tower(str(p), image_backend="pil") for p in (path, hub))
    torch.testing.assert_close(a.forward([a.preprocess(image)])[0], b.forward([b.preprocess(image)])[0])


def test_only_vision_tensors_are_read(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The language model's tensors are never read (spy on safetensors' reader)."""
    import visenc.models.registry as loading

    path = save_family("gemma3", tmp_path / "g")
    read: list[str] = []
    real = loading.safe_open

    class Spy:
        def __init__(self, *a: Any, **k: Any) -> None:
            self.inner = real(*a, **k)

        def __enter__(self) -> Spy:
            self.inner.__enter__()
            return self

        def __exit__(self, *exc: Any) -> None:
            self.inner.__exit__(*exc)

        def get_tensor(self, name: str) -> torch.Tensor:
            read.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(loading, "safe_open", Spy)
    load_tower(str(path), image_backend="pil")
    assert read and all(("vision_tower" in n or "multi_modal_projector" in n) for n in read)
    with real(str(path / "model.safetensors"), framework="pt") as f:
        assert any("language_model" in n for n in f.keys())


def test_layout_refuses_what_the_processor_refuses(tmp_path: Path) -> None:
    tower = load_tower(str(save_family("qwen3_vl", tmp_path / "q")), image_backend="pil")
    with pytest.raises(InvalidImage):
        tower.layout(5000, 10)  # aspect ratio over 200: smart_resize refuses it


def test_a_one_row_image_alone_equals_it_in_a_batch(tmp_path: Path) -> None:
    """Mistral 3 at 20x20 px is one row, which transformers' ``get_image_features`` cannot return
    alone; the tower's rows equal the same image's rows in a batch with another."""
    tower = load_tower(str(save_family("mistral3", tmp_path / "m")), image_backend="pil")
    small, other = (tower.preprocess(im) for im in (Image.new("RGB", (20, 20), (9, 99, 199)), _images()[0]))
    assert small.layout.num_tokens == 1
    alone = tower.forward([small])[0]
    torch.testing.assert_close(alone, tower.forward([other, small])[1], atol=1e-5, rtol=1e-5)


def test_layout_from_the_size_alone_matches_the_forward(family: tuple[str, Path, Any]) -> None:
    """For many sizes (tiny, extreme aspect ratios, large), the row count ``layout`` gives before
    any pixel is seen is the number of rows transformers' forward returns, and the span holds it."""
    name, path, _ = family
    tower = load_tower(str(path), image_backend="pil")
    rng = np.random.default_rng(11)
    sizes = [(1, 1), (2, 700), (700, 2), (13, 17), (1000, 40), (37, 901), (2048, 1536)]
    sizes += [tuple(int(v) for v in rng.integers(1, 1200, 2)) for _ in range(12)]
    for w, h in sizes:
        image = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        try:
            layout = tower.layout(w, h)
        except InvalidImage:  # a per-item 4xx, only for sizes transformers cannot encode either
            try:
                (rows,) = tower.forward([tower.preprocess(image)])
            except (InvalidImage, RuntimeError, ValueError):
                continue
            assert rows.shape[0] == 0, (name, w, h)
            continue
        (rows,) = tower.forward([tower.preprocess(image)])
        assert rows.shape[0] == layout.num_tokens, (name, w, h)
        assert sum(s.count for s in tower.span(w, h) if isinstance(s, Rows)) == layout.num_tokens
