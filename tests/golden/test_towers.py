"""Tower outputs: batched/packed equals per-image, equals transformers on processor output,
row counts match ``layout()``, weights are the same in every process.

Tolerance: fp32, ``atol=ATOL`` (1e-5) on outputs of magnitude ~0.1-1: packing
changes matmul shapes (and so summation order), never which tokens attend.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from harness.images import make_image, save
from PIL import Image

# the fast (torchvision) processors: the default image backend's reference (torchvision via the test shim)
from transformers import CLIPImageProcessor, Qwen2VLImageProcessor, SiglipImageProcessor

from visenc.models.base import VisionTower
from visenc.models.loading import load_tower
from visenc.models.registry import built_in_names

ATOL = 1e-5
ROOT = Path(__file__).resolve().parents[2]
QWEN = ["tiny-qwen2-vl", "tiny-qwen2.5-vl"]
FIXED = ["tiny-clip", "tiny-siglip"]
#: mixed sizes: two share a bucket (same grid), the others differ; small to stay fast
# (448, 392) has 896 patches: on a CPU the Qwen towers run it in a forward of its own, between packed groups
SIZES = [(64, 64), (130, 90), (448, 392), (64, 64), (57, 200), (224, 224)]


@pytest.fixture(scope="module", params=built_in_names())
def tower(request: pytest.FixtureRequest) -> VisionTower:
    return load_tower(request.param)


def _images() -> list[Image.Image]:
    return [make_image(w, h, seed=i) for i, (w, h) in enumerate(SIZES)]


def test_forward_contract(tower: VisionTower) -> None:
    batch = [tower.preprocess(image) for image in _images()]
    outputs = tower.forward(batch)
    assert len(outputs) == len(batch)
    for prepared, out, (w, h) in zip(batch, outputs, SIZES, strict=True):
        assert prepared.layout == tower.layout(w, h)
        assert out.shape == (prepared.layout.num_tokens, tower.hidden_size)
        assert out.dtype == tower.dtype and out.device.type == "cpu" and out.is_contiguous()
        assert torch.isfinite(out).all()
    assert tower.forward([]) == []


def test_batched_equals_per_image(tower: VisionTower) -> None:
    batch = [tower.preprocess(image) for image in _images()]
    together = tower.forward(batch)
    for prepared, out in zip(batch, together, strict=True):
        alone = tower.forward([prepared])[0]
        torch.testing.assert_close(out, alone, rtol=0, atol=ATOL)
    # distinct images give distinct rows (the split is not off by one image)
    assert not torch.allclose(together[0][:1], together[1][:1], atol=1e-3)


@pytest.mark.parametrize("name", QWEN)
def test_qwen_equals_transformers_on_processor_output(name: str) -> None:
    """Reference: processor ``pixel_values``/``image_grid_thw`` → the transformers vision
    module → ``pooler_output`` split per image, as ``Qwen2VLModel.get_image_features``."""
    tower = load_tower(name)
    images = [Image.open(io.BytesIO(save(img, "PNG"))) for img in _images()]
    processor = Qwen2VLImageProcessor(**tower.settings.processor_kwargs())  # type: ignore[attr-defined]
    inputs = processor(images=images, return_tensors="pt")
    grid = inputs["image_grid_thw"]
    model = tower.model  # type: ignore[attr-defined]
    with torch.inference_mode():
        merged = model(inputs["pixel_values"], grid_thw=grid).pooler_output
    reference = torch.split(merged, (grid.prod(-1) // model.spatial_merge_size**2).tolist())
    ours = tower.forward([tower.preprocess(image) for image in images])
    assert [o.shape[0] for o in ours] == [r.shape[0] for r in reference]
    for o, r in zip(ours, reference, strict=True):
        torch.testing.assert_close(o, r, rtol=0, atol=ATOL)


@pytest.mark.parametrize("name", FIXED)
def test_fixed_equals_transformers_on_processor_output(name: str) -> None:
    tower = load_tower(name)
    images = _images()
    processor_class = CLIPImageProcessor if name == "tiny-clip" else SiglipImageProcessor
    processor = processor_class(**tower.settings.processor_kwargs())  # type: ignore[attr-defined]
    pixels = processor(images=images, return_tensors="pt")["pixel_values"]
    with torch.inference_mode():
        out = tower.model(pixel_values=pixels)  # type: ignore[attr-defined]
    reference = out.image_embeds if name == "tiny-clip" else out.pooler_output
    ours = torch.cat(tower.forward([tower.preprocess(image) for image in images]))
    torch.testing.assert_close(ours, reference, rtol=0, atol=ATOL)


def test_token_counts() -> None:
    qwen = load_tower("tiny-qwen2-vl")
    assert qwen.hidden_size == 256
    assert qwen.layout(1280, 720).num_tokens == 1196  # resized to 1288x728: 92x52 patches / 4
    assert qwen.layout(224, 224).num_tokens == 64  # 16x16 patches / 4
    assert load_tower("tiny-clip").layout(1280, 720).num_tokens == 1


@pytest.mark.parametrize("name", ["tiny-qwen2-vl", "tiny-qwen2.5-vl"])
def test_bfloat16_equals_transformers_at_bfloat16(name, tmp_path) -> None:
    """At bf16 the rows equal transformers' own bf16 model (``from_pretrained(dtype=bfloat16)``, whose
    rotary tables stay float32), bit for bit. Casting the rotary ``inv_freq`` to bf16 (the old
    behaviour) moved outputs by 2-3e-3 at these sizes (outputs ~0.45): the tolerance below catches it."""
    fp32 = load_tower(name)
    bf16 = load_tower(name, dtype="bfloat16")
    assert {n: b.dtype for n, b in bf16.model.named_buffers()} == dict.fromkeys(  # type: ignore[attr-defined]
        ["rotary_pos_emb.inv_freq", "rotary_pos_emb.original_inv_freq"], torch.float32
    )
    fp32.model.save_pretrained(tmp_path)  # type: ignore[attr-defined]
    ref = type(fp32.model).from_pretrained(tmp_path, dtype=torch.bfloat16).eval()  # type: ignore[attr-defined]
    for size in [(96, 80), (448, 448), (1280, 720)]:
        prepared = bf16.preprocess(make_image(*size))
        ours = bf16.forward([prepared])[0]
        with torch.inference_mode():
            pixels = torch.from_numpy(prepared.pixels).to(torch.bfloat16)
            theirs = ref(pixels, grid_thw=torch.tensor([prepared.layout.grid_thw])).pooler_output
        assert ours.dtype == theirs.dtype == torch.bfloat16
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)  # measured: 0.0


def test_bfloat16_forward_runs_and_tracks_fp32() -> None:
    image = make_image(96, 80)
    fp32 = load_tower("tiny-qwen2-vl")
    bf16 = load_tower("tiny-qwen2-vl", dtype="bfloat16")
    assert bf16.fingerprint != fp32.fingerprint
    out = bf16.forward([bf16.preprocess(image)])[0]
    assert out.dtype == torch.bfloat16
    ref = fp32.forward([fp32.preprocess(image)])[0]
    torch.testing.assert_close(out.float(), ref, rtol=0.1, atol=0.05)


_SUBPROCESS = (
    "import json, sys; from tests.golden.test_towers import _checksums; print(json.dumps(_checksums(sys.argv[1:])))"
)


def _checksums(names: list[str]) -> dict[str, tuple[str, str, list[float]]]:
    """name → (sha256 of the state dict, fingerprint, first output values) for a fixed image."""
    result: dict[str, tuple[str, str, list[float]]] = {}
    for name in names:
        tower = load_tower(name)
        h = hashlib.sha256()
        for key, value in sorted(tower.model.state_dict().items()):  # type: ignore[attr-defined]
            h.update(key.encode())
            h.update(value.contiguous().numpy().tobytes())
        out = tower.forward([tower.preprocess(make_image(70, 60))])[0]
        result[name] = (h.hexdigest(), tower.fingerprint, out.flatten()[:512].tolist())
    return result


def test_weights_and_outputs_identical_across_processes() -> None:
    names = built_in_names()
    torch.manual_seed(1234)  # the caller's RNG state must not matter (fork_rng)
    here = _checksums(names)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'service'}{os.pathsep}{ROOT}"}
    proc = subprocess.run(
        [sys.executable, "-c", _SUBPROCESS, *names],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    there = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in names:
        weights, fingerprint, values = there[name]
        # weights: bit-identical; outputs: same kernels, same inputs → equal within ATOL
        assert (weights, fingerprint) == here[name][:2], name
        np.testing.assert_allclose(values, here[name][2], rtol=0, atol=ATOL)


def test_seed_changes_weights_and_fingerprint() -> None:
    a, b = load_tower("tiny-qwen2-vl", seed=0), load_tower("tiny-qwen2-vl", seed=1)
    assert a.fingerprint != b.fingerprint
    wa = a.model.blocks[0].attn.qkv.weight  # type: ignore[attr-defined]
    wb = b.model.blocks[0].attn.qkv.weight  # type: ignore[attr-defined]
    assert not torch.equal(wa, wb)
    assert load_tower("tiny-qwen2-vl", max_pixels=200_000).fingerprint != a.fingerprint
    assert load_tower("tiny-qwen2-vl").fingerprint == a.fingerprint


def test_output_rows_from_pixels_alone() -> None:
    """num_tokens is known before decode: layout() over many sizes equals preprocess rows."""
    qwen = load_tower("tiny-qwen2-vl", max_pixels=300_000)
    rng = np.random.default_rng(0)
    for w, h in rng.integers(8, 1600, size=(40, 2)):
        if max(w, h) / min(w, h) > 200:
            continue
        layout = qwen.layout(int(w), int(h))
        _, gh, gw = layout.grid_thw
        assert gh * gw * 14 * 14 <= 300_000 and gh % 2 == 0 and gw % 2 == 0
        assert layout.num_tokens == gh * gw // 4
