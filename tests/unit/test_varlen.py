"""Packed attention (``models/varlen.py``), checked on the CPU:

- the packed Qwen forward equals the model's own per-image path for mixed-size batches;
- one attention call per layer, and no host read in the forward but the CPU kernel's own boundaries;
- no tensor near total x total positions anywhere in a packed forward, for every family that packs
  (Qwen2/2.5-VL, Qwen3-VL, GLM-4.1V, Mistral 3); Pixtral's own path builds one, so the check can fail;
- the per-segment kernel equals attention segment by segment;
- which kernel runs where, and that a kernel that fails its probe is never used;
- the memory charge is linear in the patches (no phantom mask).
The CUDA checks run where a device exists (a forward with no device sync: ``test_device_reads.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from harness.tiny_families import save_family
from PIL import Image
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from visenc.models import varlen
from visenc.models.loading import load_tower

SIZES = [(224, 224), (300, 200), (97, 131), (448, 336), (61, 500)]


def _images(sizes: list[tuple[int, int]], seed: int = 5) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]


def _batch(tower: Any, sizes: list[tuple[int, int]] = SIZES) -> list[Any]:
    return [tower.preprocess(im) for im in _images(sizes)]


@contextlib.contextmanager
def no_host_reads() -> Iterator[list[int]]:
    """Fail on any tensor-to-Python read (what forces a device sync on a GPU), except the per-segment
    kernel's read of its boundaries, which is counted (yielded list: one entry per read)."""

    def refuse(*_a: Any, **_k: Any) -> None:
        raise AssertionError("a tensor was read back to the host inside the forward")

    names = ("item", "tolist", "__int__", "__index__", "__bool__", "__float__")
    saved = {name: getattr(torch.Tensor, name) for name in names}
    reads: list[int] = []
    real_bounds = varlen.segment_bounds

    def counted_bounds(cu: torch.Tensor) -> list[int]:
        reads.append(1)
        return [int(x) for x in saved["tolist"](cu)]

    try:
        varlen.segment_bounds = counted_bounds  # type: ignore[assignment]
        for name in saved:
            setattr(torch.Tensor, name, refuse)
        yield reads
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
        varlen.segment_bounds = real_bounds  # type: ignore[assignment]


@pytest.fixture(params=["tiny-qwen2-vl", "tiny-qwen2.5-vl"])
def tower(request: pytest.FixtureRequest) -> Any:
    return load_tower(request.param)


def test_packed_is_the_default_and_equals_the_models_own_path(tower: Any) -> None:
    assert tower.varlen
    batch = _batch(tower)
    packed = tower._forward_packed(batch)
    tower.use_varlen(False)
    own = tower._forward_packed(batch)
    for a, b in zip(own, packed, strict=True):
        torch.testing.assert_close(b, a, atol=2e-5 * a.abs().max().item(), rtol=0)


def _op_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Calls of the packed attention op (one entry each)."""
    calls: list[int] = []
    real = varlen.varlen_attention

    def counting(*a: Any, **k: Any) -> torch.Tensor:
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(varlen, "varlen_attention", counting)
    return calls


def test_one_attention_call_per_layer_and_no_host_reads(tower: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    batch = _batch(tower)
    calls = _op_calls(monkeypatch)
    extra = varlen.packed_kwargs(tower.model.config, [p.layout.grid_thw for p in batch], tower.device)
    pixels = torch.from_numpy(np.concatenate([p.pixels for p in batch]))
    grid = torch.tensor([p.layout.grid_thw for p in batch])
    with no_host_reads() as reads, torch.inference_mode():
        tower.model(pixels, grid_thw=grid, **extra)
    depth = tower.model.config.depth
    assert len(calls) == depth
    assert len(reads) == depth  # the CPU kernel's boundaries; the CUDA kernels read none


def test_the_own_path_reads_the_host(tower: Any) -> None:
    """The check above can fail: the model's own path reads lengths back inside the forward."""
    tower.use_varlen(False)
    with pytest.raises(AssertionError, match="read back"), no_host_reads():
        tower._forward_packed(_batch(tower))


class Largest(TorchDispatchMode):
    """The most elements of any tensor an op returned while active."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def _sdpa_spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bool]]:
    """Every SDPA call's key length and whether it had a mask."""
    seen: list[tuple[int, bool]] = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None, **kw: Any) -> torch.Tensor:
        seen.append((k.shape[-2], attn_mask is not None))
        return real(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return seen


def _largest(tower: Any, images: int) -> tuple[int, int]:
    """(most elements of a tensor in a forward of ``images`` equal-size images, positions per image)."""
    batch = _batch(tower, [(224, 224)] * images)
    with Largest() as largest:
        rows = tower.forward(batch)
    assert len(rows) == images
    return largest.numel, int(np.prod(batch[0].layout.grid_thw))


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: save_family(name, tmp_path_factory.mktemp(name)) for name in ("qwen3_vl", "glm4v", "mistral3")}


@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "qwen3_vl", "glm4v", "mistral3"])
def test_no_total_by_total_tensor_in_a_packed_forward(
    name: str, families: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Twice the images in one forward (equal sizes: every family batches them) at most doubles the
    largest tensor of the forward (a mask over the batch would quadruple it), and attention only ever
    sees one image's positions, unmasked."""
    tower = load_tower(str(families[name]) if name in families else name)
    seen = _sdpa_spy(monkeypatch)
    calls = _op_calls(monkeypatch)
    half, per_image = _largest(tower, 12)
    full, _ = _largest(tower, 24)
    assert full <= 2 * half, (name, half, full)
    assert calls, "the packed attention op was not used"
    assert seen and all(not masked and length <= per_image for length, masked in seen), seen[:3]


def test_the_check_finds_pixtrals_own_block_mask(families: dict[str, Path]) -> None:
    """transformers' own Pixtral forward, under SDPA, masks the whole batch with one block mask."""
    tower = load_tower(str(families["mistral3"]))
    for module in tower.model.modules():
        if getattr(module, "config", None) is not None:
            module.config._attn_implementation = "sdpa"
    own = tower.model.get_image_features
    tower.image_features = lambda inputs: torch.cat(own(**inputs).pooler_output)
    half, per_image = _largest(tower, 12)
    full, _ = _largest(tower, 24)
    assert full >= 3 * half and full >= (24 * per_image) ** 2


@pytest.mark.parametrize("lengths", [[5, 64, 64, 64, 17], [1], [64] * 6, [3, 0, 9]])
def test_per_segment_kernel_equals_attention_segment_by_segment(lengths: list[int]) -> None:
    gen = torch.Generator().manual_seed(1)
    total, heads, dim = sum(lengths), 3, 8
    q, k, v = (torch.randn(total, heads, dim, generator=gen) for _ in range(3))
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32)
    out = varlen.varlen_attention(q, k, v, cu, max(lengths), 0.3)
    at = 0
    for n in lengths:
        if n:
            s = slice(at, at + n)
            scores = torch.einsum("qhd,khd->hqk", q[s], k[s]) * 0.3
            want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[s])
            torch.testing.assert_close(out[s], want, atol=1e-5, rtol=1e-5)
        at += n


def test_the_cpu_runs_the_per_segment_kernel_and_torch_varlen_fails_its_probe_there() -> None:
    cpu = torch.device("cpu")
    assert varlen.kernel_for(cpu, torch.float32, 32) == "per-segment"
    assert not varlen.works("torch-varlen", cpu, torch.float32, 32)  # torch's flash varlen is CUDA-only


@pytest.mark.parametrize(
    ("usable", "seconds", "chosen"),
    [
        ({"torch-varlen", "flash-attn"}, {"torch-varlen": 2.0, "flash-attn": 1.0}, "flash-attn"),
        ({"torch-varlen", "flash-attn"}, {"torch-varlen": 1.0, "flash-attn": 2.0}, "torch-varlen"),
        ({"torch-varlen"}, {}, "torch-varlen"),
        ({"flash-attn"}, {}, "flash-attn"),
        (set(), {}, "per-segment"),
    ],
)
def test_a_cuda_device_gets_the_fastest_kernel_that_passes_its_probe(
    usable: set[str], seconds: dict[str, float], chosen: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    timed: list[str] = []
    monkeypatch.setattr(varlen, "works", lambda kernel, *_: kernel in usable)
    monkeypatch.setattr(varlen, "_seconds", lambda kernel, *_: timed.append(kernel) or seconds[kernel])
    pick = varlen.kernel_for.__wrapped__  # type: ignore[attr-defined]
    assert pick(torch.device("cuda", 0), torch.bfloat16, 80) == chosen
    assert sorted(timed) == (sorted(usable) if len(usable) > 1 else [])  # timed only to break a tie


def test_the_memory_charge_is_linear_in_the_patches(tower: Any) -> None:
    layouts = [tower.layout(1920, 1080), tower.layout(1280, 720), tower.layout(640, 480)]
    one_by_one = sum(tower.forward_bytes([lay]) for lay in layouts)
    assert tower.forward_bytes(layouts) == one_by_one
    assert tower.forward_bytes(layouts * 8) == 8 * one_by_one


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the path is for GPUs)")


@cuda
@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-qwen2.5-vl"])
def test_cuda_packed_rows_equal_the_models_own_path_in_bf16(name: str) -> None:
    tower = load_tower(name, device="cuda", dtype="bfloat16")
    batch = _batch(tower)
    packed = [o.float() for o in tower.forward(batch)]
    tower.use_varlen(False)
    own = [o.float() for p in batch for o in tower.forward([p])]
    for a, b in zip(own, packed, strict=True):
        torch.testing.assert_close(b, a, atol=2e-2 * a.abs().max().item(), rtol=0)
