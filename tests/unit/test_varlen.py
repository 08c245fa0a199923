"""The packed (varlen) Qwen forward that CUDA runs (``models/varlen.py``), checked on the CPU:

- equal to the model's own per-image path for mixed-size batches (partial windows included);
- ONE attention call per layer for the whole batch (the own sdpa path: one per image per layer);
- no ``.item()`` / ``.tolist()`` inside the forward: every length, index and position is computed
  on the CPU beforehand (the own path calls them, so the check can fail); on a CUDA device the
  same forward runs under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from PIL import Image

from visenc.models import varlen
from visenc.models.loading import load_tower

SIZES = [(224, 224), (300, 200), (97, 131), (448, 336), (61, 500)]


def _batch(tower):
    rng = np.random.default_rng(5)
    return [tower.preprocess(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))) for w, h in SIZES]


@contextlib.contextmanager
def no_host_reads() -> Iterator[None]:
    """Fail on any tensor-to-Python read (what forces a device sync on a GPU)."""

    def refuse(*_a, **_k):
        raise AssertionError("a tensor was read back to the host inside the forward")

    saved = {
        name: getattr(torch.Tensor, name)
        for name in ("item", "tolist", "__int__", "__index__", "__bool__", "__float__")
    }
    try:
        for name in saved:
            setattr(torch.Tensor, name, refuse)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


@pytest.fixture(params=["tiny-qwen2-vl", "tiny-qwen2.5-vl"])
def tower(request):
    t = load_tower(request.param)
    yield t
    t.use_varlen(False)


def test_varlen_equals_the_models_own_path(tower):
    batch = _batch(tower)
    own = tower._forward_packed(batch)
    tower.use_varlen(True)
    packed = tower._forward_packed(batch)
    for a, b in zip(own, packed, strict=True):
        torch.testing.assert_close(b, a, atol=2e-5 * a.abs().max().item(), rtol=0)


def test_one_attention_call_per_layer_and_no_host_reads(tower, monkeypatch):
    batch = _batch(tower)
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    depth = tower.model.config.depth
    tower._forward_packed(batch)
    assert len(calls) > depth  # the own sdpa path: image by image (window by window on 2.5)
    calls.clear()
    tower.use_varlen(True)
    extra = varlen.packed_kwargs(tower.model.config, [p.layout.grid_thw for p in batch], tower.device)
    pixels = torch.from_numpy(np.concatenate([p.pixels for p in batch]))
    grid = torch.tensor([p.layout.grid_thw for p in batch])
    with no_host_reads(), torch.inference_mode():
        tower.model(pixels, grid_thw=grid, **extra)
    varlen.release_masks()
    assert len(calls) == depth


def test_the_own_path_reads_the_host(tower):
    """The check above can fail: the model's own path reads lengths back inside the forward."""
    batch = _batch(tower)
    with pytest.raises(AssertionError, match="read back"), no_host_reads():
        tower._forward_packed(batch)


def test_block_mask():
    mask = varlen.block_mask(torch.tensor([0, 3, 5, 6], dtype=torch.int32), 6)
    want = torch.zeros(6, 6, dtype=torch.bool)
    for a, b in [(0, 3), (3, 5), (5, 6)]:
        want[a:b, a:b] = True
    assert torch.equal(mask, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the path is for GPUs)")
def test_cuda_forward_has_no_sync():
    tower = load_tower("tiny-qwen2.5-vl", device="cuda", dtype="bfloat16")
    batch = _batch(tower)
    tower.forward(batch)  # warm-up (allocator, kernels)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = tower.forward(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [o.shape[0] for o in out] == [p.layout.num_tokens for p in batch]
