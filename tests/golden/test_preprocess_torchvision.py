"""The default image backend equals transformers' fast (torchvision) image processors, the ones vLLM
and SGLang run, bit for bit, without torchvision in the service: ``resize`` reproduces torchvision's
CPU resize with the same torch call, and the lookup table its fused rescale-and-normalise.

Reference: ``Qwen2VLImageProcessor``, ``CLIPImageProcessor``, ``SiglipImageProcessor`` (transformers
5.x, torchvision backend; torchvision loads through ``tests/support/torchvision_cpu_shim.py``), given
the RGB image vLLM's loader makes of the file, as vLLM gives it. Tolerance ``TOL`` = 1e-6 in float32;
measured 0.0. The PIL backend differs from it by up to ~0.2 on resized images: the test that this
backend is not the PIL one is below, so a silent fallback cannot pass."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from harness.images import image_bytes
from tests.golden.test_preprocess import CASES, LIMIT, _source

from visenc.imaging import preprocess as pp
from visenc.imaging.decode import decode
from visenc.models.loading import load_tower
from visenc.models.qwen2vl import QwenVisionTower

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
pytest.importorskip("torchvision", reason="the reference needs torchvision (make install-test installs it)")
from transformers import CLIPImageProcessor, Qwen2VLImageProcessor, SiglipImageProcessor  # noqa: E402

TOL = 1e-6
IDS = [f"{c[0]}x{c[1]}-{c[2]}-{c[3]}" for c in CASES]


def _max_diff(ours: np.ndarray, ref: torch.Tensor) -> float:
    ref_np = ref.numpy()
    assert ours.shape == ref_np.shape and ours.dtype == np.float32, (ours.shape, ref_np.shape)
    return float(np.abs(ours - ref_np).max())


def test_the_reference_is_the_torchvision_backend():
    assert Qwen2VLImageProcessor.__mro__[1].__name__ == "TorchvisionBackend"


def test_fused_table_is_the_fast_processors_arithmetic_bit_for_bit():
    proc = CLIPImageProcessor()
    values = torch.arange(256, dtype=torch.uint8).reshape(1, 1, 1, 256).expand(1, 3, 1, 256)
    ref = proc.rescale_and_normalize(values, True, 1 / 255, True, pp.OPENAI_CLIP_MEAN, pp.OPENAI_CLIP_STD)
    table = pp.Normalizer(1 / 255, pp.OPENAI_CLIP_MEAN, pp.OPENAI_CLIP_STD, fused=True).lut
    np.testing.assert_array_equal(table, ref[0, :, 0, :].numpy())


@pytest.fixture(scope="module")
def qwen() -> QwenVisionTower:
    tower = load_tower("tiny-qwen2-vl")
    assert isinstance(tower, QwenVisionTower) and tower.settings.backend == "torchvision"
    return tower


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("max_pixels", [128 * 28 * 28, 20_000])
def test_qwen_equals_the_fast_processor(qwen, case, max_pixels):
    image = decode(_source(case), max_pixels=LIMIT)  # vLLM's loader: what vLLM hands the processor
    settings = replace(qwen.settings, max_pixels=max_pixels)
    tower = QwenVisionTower(
        name="t", model=qwen.model, preprocess=settings, source={}, dtype=qwen.dtype, device=qwen.device
    )
    ref = Qwen2VLImageProcessor(**settings.processor_kwargs())(images=[image], return_tensors="pt")
    prepared = tower.preprocess(image)
    assert list(ref["image_grid_thw"][0]) == list(prepared.layout.grid_thw)
    assert _max_diff(prepared.pixels, ref["pixel_values"]) <= TOL


@pytest.mark.parametrize("name", ["tiny-clip", "tiny-siglip"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_fixed_towers_equal_the_fast_processor(name, case):
    tower = load_tower(name)
    processor_class = CLIPImageProcessor if name == "tiny-clip" else SiglipImageProcessor
    image = decode(_source(case), max_pixels=LIMIT)
    ref = processor_class(**tower.settings.processor_kwargs())(images=[image], return_tensors="pt")
    assert _max_diff(tower.preprocess(image).pixels, ref["pixel_values"][0]) <= TOL


@pytest.mark.parametrize("size", [(640, 480), (1280, 720), (333, 517), (56, 56), (2000, 31)])
def test_qwen_at_common_sizes_and_the_two_backends_differ(qwen, size):
    image = decode(image_bytes(*size, "JPEG", seed=3), max_pixels=LIMIT)
    ref = Qwen2VLImageProcessor(**qwen.settings.processor_kwargs())(images=[image], return_tensors="pt")
    ours = qwen.preprocess(image).pixels
    assert _max_diff(ours, ref["pixel_values"]) <= TOL
    pil = load_tower("tiny-qwen2-vl", image_backend="pil").preprocess(image).pixels
    _, grid_h, grid_w = qwen.layout(*size).grid_thw
    resized = (grid_h * 14, grid_w * 14) != (size[1], size[0])
    if resized:  # the backends disagree wherever the image is resized: serving the wrong one is visible
        assert float(np.abs(pil - ours).max()) > 1e-3
    else:
        assert float(np.abs(pil - ours).max()) <= 1e-6


def test_the_backend_is_part_of_the_fingerprint():
    assert load_tower("tiny-clip").fingerprint != load_tower("tiny-clip", image_backend="pil").fingerprint
