"""Our preprocessing equals transformers' PIL image processors.

Reference: ``Qwen2VLImageProcessorPil``, ``CLIPImageProcessorPil``,
``SiglipImageProcessorPil`` (transformers 5.x) given the *original* decoded
image (any mode), ours given ``decode(..., loader="transformers")``'s RGB image (what a bare
processor sees; the engines' loaders are tested in ``test_odd_images.py``).

Tolerance: max abs diff ≤ ``TOL`` = 1e-6 in float32. In practice the outputs
are bit-identical (0.0): same PIL resize, and the lookup table reproduces
transformers' float64-rescale / float32-normalise arithmetic exactly.
"""

from __future__ import annotations

import io
from dataclasses import replace

import numpy as np
import pytest
from harness.images import make_image, save
from PIL import Image
from transformers.image_transforms import normalize, rescale
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

from visenc.imaging import preprocess as pp
from visenc.imaging.decode import decode
from visenc.models.clip import FixedPreprocess, FixedResolutionTower
from visenc.models.loading import load_tower
from visenc.models.qwen2vl import QwenPreprocess, QwenVisionTower

TOL = 1e-6
LIMIT = 10_000_000

# (width, height, mode, format): odd sizes, extreme aspect ratios, tiny (upscaled) images
CASES = [
    (64, 64, "RGB", "PNG"),
    (97, 131, "RGB", "JPEG"),
    (300, 41, "RGBA", "PNG"),
    (33, 250, "L", "PNG"),
    (123, 77, "P", "PNG"),
    (211, 189, "P", "GIF"),
    (20, 17, "LA", "PNG"),
    (299, 300, "CMYK", "JPEG"),
]


def _source(case: tuple[int, int, str, str], seed: int = 1) -> bytes:
    width, height, mode, fmt = case
    return save(make_image(width, height, mode=mode, seed=seed), fmt)


def _max_diff(ours: np.ndarray, ref: np.ndarray) -> float:
    assert ours.shape == ref.shape and ours.dtype == np.float32
    return float(np.abs(ours - ref).max())


@pytest.fixture(scope="module")
def qwen() -> QwenVisionTower:
    tower = load_tower("tiny-qwen2-vl", image_backend="pil")
    assert isinstance(tower, QwenVisionTower)
    return tower


@pytest.fixture(scope="module")
def clip() -> FixedResolutionTower:
    tower = load_tower("tiny-clip", image_backend="pil")
    assert isinstance(tower, FixedResolutionTower)
    return tower


@pytest.fixture(scope="module")
def siglip() -> FixedResolutionTower:
    tower = load_tower("tiny-siglip", image_backend="pil")
    assert isinstance(tower, FixedResolutionTower)
    return tower


def test_lookup_table_is_transformers_arithmetic_bit_for_bit() -> None:
    values = np.arange(256, dtype=np.uint8).reshape(1, 1, 256).repeat(3, axis=0)  # CHW
    ref = normalize(rescale(values, 1 / 255), pp.OPENAI_CLIP_MEAN, pp.OPENAI_CLIP_STD)
    table = pp.Normalizer(1 / 255, pp.OPENAI_CLIP_MEAN, pp.OPENAI_CLIP_STD).lut
    np.testing.assert_array_equal(table, ref[:, 0, :])


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}-{c[3]}")
@pytest.mark.parametrize("max_pixels", [128 * 28 * 28, 20_000])
def test_qwen_equals_processor(qwen: QwenVisionTower, case: tuple, max_pixels: int) -> None:
    data = _source(case)
    tower_settings = replace(qwen.settings, max_pixels=max_pixels)
    tower = QwenVisionTower(
        name="t", model=qwen.model, preprocess=tower_settings, source={}, dtype=qwen.dtype, device=qwen.device
    )
    processor = Qwen2VLImageProcessorPil(**tower_settings.processor_kwargs())
    ref = processor(images=[Image.open(io.BytesIO(data))], return_tensors="np")
    prepared = tower.preprocess(decode(data, max_pixels=LIMIT, loader="transformers"))
    assert prepared.layout.grid_thw == tuple(ref["image_grid_thw"][0])
    assert _max_diff(prepared.pixels, ref["pixel_values"]) <= TOL
    # layout() from the size alone agrees with what preprocess produced
    assert tower.layout(case[0], case[1]) == prepared.layout


def test_qwen_equals_processor_at_1280x720(qwen: QwenVisionTower) -> None:
    data = save(make_image(1280, 720, seed=3), "JPEG", quality=92)
    processor = Qwen2VLImageProcessorPil(**qwen.settings.processor_kwargs())
    ref = processor(images=[Image.open(io.BytesIO(data))], return_tensors="np")
    prepared = qwen.preprocess(decode(data, max_pixels=LIMIT, loader="transformers"))
    assert prepared.pixels.shape == (52 * 92, 3 * 2 * 14 * 14)
    assert _max_diff(prepared.pixels, ref["pixel_values"]) <= TOL


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}-{c[3]}")
def test_clip_equals_processor(clip: FixedResolutionTower, case: tuple) -> None:
    data = _source(case)
    processor = CLIPImageProcessorPil(**clip.settings.processor_kwargs())
    ref = processor(images=[Image.open(io.BytesIO(data))], return_tensors="np")["pixel_values"]
    prepared = clip.preprocess(decode(data, max_pixels=LIMIT, loader="transformers"))
    assert _max_diff(prepared.pixels, ref[0]) <= TOL


def test_clip_center_crop_pads_like_processor(clip: FixedResolutionTower) -> None:
    # short side 200 < crop 224: transformers zero-pads (in uint8 space, before normalising)
    settings = replace(clip.settings, shortest_edge=200)
    tower = FixedResolutionTower(
        name="t", model=clip.model, preprocess=settings, source={}, dtype=clip.dtype, device=clip.device
    )
    data = _source((150, 97, "RGB", "PNG"))
    processor = CLIPImageProcessorPil(**settings.processor_kwargs())
    ref = processor(images=[Image.open(io.BytesIO(data))], return_tensors="np")["pixel_values"]
    assert _max_diff(tower.preprocess(decode(data, max_pixels=LIMIT, loader="transformers")).pixels, ref[0]) <= TOL


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}-{c[3]}")
def test_siglip_equals_processor(siglip: FixedResolutionTower, case: tuple) -> None:
    data = _source(case)
    processor = SiglipImageProcessorPil(**siglip.settings.processor_kwargs())
    ref = processor(images=[Image.open(io.BytesIO(data))], return_tensors="np")["pixel_values"]
    prepared = siglip.preprocess(decode(data, max_pixels=LIMIT, loader="transformers"))
    assert _max_diff(prepared.pixels, ref[0]) <= TOL


def test_processor_config_round_trip(qwen: QwenVisionTower, clip: FixedResolutionTower) -> None:
    """Settings parsed from a processor's own ``to_dict()`` are the settings it was built with."""
    q = replace(qwen.settings, max_pixels=300_000, min_pixels=10_000, backend="torchvision")
    saved = Qwen2VLImageProcessorPil(**q.processor_kwargs()).to_dict()
    assert QwenPreprocess.from_processor_config(saved) == q
    saved = CLIPImageProcessorPil(**clip.settings.processor_kwargs()).to_dict()
    assert FixedPreprocess.clip_default().with_processor_config(saved) == replace(clip.settings, backend="torchvision")
    legacy = {"min_pixels": 3136, "max_pixels": 12845056, "size": {"min_pixels": 3136}}
    assert QwenPreprocess.from_processor_config(legacy).max_pixels == 12845056
