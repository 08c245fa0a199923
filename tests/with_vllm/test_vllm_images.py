"""visenc's ``--image-loader vllm`` against vLLM's own code, on odd but valid files.

For every file of a corpus built here (EXIF orientations 1-8, every PNG transparency form, 16-bit,
CMYK, progressive and grayscale JPEG, WebP with and without alpha, animated WebP and GIF, a
transparent GIF, BMP, TIFF, extreme aspect ratios, the smallest image, and files vLLM refuses):

- visenc's decoded RGB equals what vLLM's ``ImageMediaIO.load_bytes`` hands its processor, pixel
  for pixel; where vLLM refuses a file, visenc gives the per-item error, never rows (and visenc
  refuses, where vLLM takes it, only a file whose pixel data Pillow itself reports broken);
- visenc's handle for it (token count and grid, from the header alone) and its preprocessed input
  equal what vLLM's own multimodal processor makes of the image (placeholder count,
  ``image_grid_thw`` where the model has one, ``pixel_values``), for a tiny checkpoint of every
  family visenc serves that vLLM's CPU build runs (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Gemma 3,
  Gemma 4, Mistral 3, LLaVA-OneVision, GLM-4.1V, Idefics3, SmolVLM, InternVL), each with its own transformers
  ``Processor`` as vLLM loads it; the tower's rows for equal inputs are pinned by the token-identity
  tests beside this one.

This runs vLLM's installed code, so it fails when a vLLM upgrade changes how images load: then
``visenc.imaging.decode.LOADERS["vllm"]`` and its version must follow.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment (make vllm)")

import vllm
from PIL import Image
from tests.support.odd_images import LIMIT, assert_engine_inputs, corpus
from tests.support.tiny_processors import PROCESSORS, save_with_processor
from vllm.multimodal.media.image import ImageMediaIO

from visenc.errors import VisencError
from visenc.imaging.decode import LOADERS, decode, probe

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import tiny_vlm  # noqa: E402

CORPUS = corpus()


def vllm_load(data: bytes) -> Image.Image | Exception:
    try:
        return ImageMediaIO().load_bytes(data).media
    except Exception as e:  # vLLM refuses the file
        return e


def visenc_load(data: bytes) -> Image.Image | VisencError:
    try:
        return decode(data, max_pixels=LIMIT, loader="vllm")
    except VisencError as e:
        return e


def test_the_loader_names_the_installed_vllm():
    """The semantics ``--image-loader vllm`` follows are this vLLM's (its version is in the fingerprint)."""
    assert vllm.__version__.startswith(LOADERS["vllm"].version + ".")


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_decode_equals_vllms_loader_pixel_for_pixel(name: str) -> None:
    data = CORPUS[name]
    want, got = vllm_load(data), visenc_load(data)
    if isinstance(want, Exception):
        assert isinstance(got, VisencError), f"vLLM refuses {name} ({want!r}); visenc decoded it"
        return
    if isinstance(got, VisencError):  # only a broken file: vLLM keeps what it decoded, visenc guesses no rows
        with pytest.raises(OSError):
            Image.open(io.BytesIO(data)).load()
        return
    assert isinstance(got, Image.Image), f"vLLM loads {name}; visenc: {got!r}"
    assert want.mode == got.mode == "RGB" and want.size == got.size
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)
    assert probe(data, max_pixels=LIMIT, loader="vllm") == want.size  # the handle's size, from the header


def test_a_rotated_photo_is_encoded_upright():
    """Orientation 6 turns the stored 240x160 picture into 160x240, as vLLM shows it."""
    image = visenc_load(CORPUS["jpeg-exif-orientation-6"])
    assert isinstance(image, Image.Image) and image.size == (160, 240)


def _checkpoints() -> dict[str, tuple[Callable[[Path], Path], str]]:
    """Per architecture: a builder of a tiny checkpoint, and the text a prompt carries for one image
    (vLLM's processor expands it). One per family visenc serves that vLLM's CPU build runs."""
    qwen = "<|vision_start|><|image_pad|><|vision_end|>"
    out: dict[str, tuple[Callable[[Path], Path], str]] = {
        arch: (lambda folder, arch=arch: tiny_vlm.build(folder, seed=0, arch=arch), qwen) for arch in tiny_vlm.ARCHES
    }
    out["gemma3"] = (lambda folder: tiny_vlm.build_gemma3(folder, seed=0), "<start_of_image>")
    for name in ("mistral3", "llava_onevision", "glm4v", "idefics3", "smolvlm", "internvl", "gemma4"):
        out[name] = (lambda folder, name=name: save_with_processor(name, folder), PROCESSORS[name].prompt)
    return out


CHECKPOINTS = _checkpoints()


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def model(request, tmp_path_factory) -> tuple[object, object, str]:
    """(vLLM's own multimodal processor, visenc's tower, the image's prompt) for a tiny checkpoint of ``arch``."""
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    from visenc.models.loading import load_tower

    build, prompt = CHECKPOINTS[request.param]
    path = build(tmp_path_factory.mktemp(request.param))
    # normalisation on the host, as the checkpoint's processor does it: pixel_values comparable
    config = ModelConfig(model=str(path), dtype="float32", mm_device_do_normalize=False)
    return MULTIMODAL_REGISTRY.create_processor(config), load_tower(str(path)), prompt


def vllm_inputs(processor, prompt: str, image: Image.Image) -> tuple[int, tuple[int, ...] | None, np.ndarray]:
    """(placeholder count, image_grid_thw or ``None``, pixel_values) vLLM's processor makes of ``image``."""
    out = processor(prompt, processor.info.parse_mm_data({"image": [image]}))
    (placeholder,) = out["mm_placeholders"]["image"]
    (item,) = out["mm_kwargs"]["image"]
    grid = tuple(int(x) for x in item["image_grid_thw"].data.tolist()) if "image_grid_thw" in item else None
    return int(placeholder.get_num_embeds()), grid, item["pixel_values"].data.float().numpy()


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_handle_and_inputs_equal_vllms_processor(model, name: str) -> None:
    processor, tower, prompt = model
    data = CORPUS[name]
    image = vllm_load(data)
    if isinstance(image, Exception) or isinstance(visenc_load(data), VisencError):
        return  # refused (test_decode_equals_vllms_loader_pixel_for_pixel says by whom and why)
    assert_engine_inputs(tower, data, "vllm", lambda: vllm_inputs(processor, prompt, image))
