"""visenc's ``--image-loader sglang`` against SGLang's own code, on odd but valid files.

SGLang as an encode-prefill-decode deployment runs it: its encoder server (``--encoder-only``) loads
an image with ``EncoderPreprocessor._load_single_item`` (``load_image``, then ``convert("RGB")`` for
any other mode: every alpha dropped, no EXIF orientation) and hands it to the checkpoint's
``AutoImageProcessor``. For every file of the shared corpus (``tests/support/odd_images.py``):

- visenc's decoded RGB equals what SGLang's encoder loads, pixel for pixel, and equals what its
  non-disaggregated processors load (``BaseMultimodalProcessor._load_single_item``); where SGLang
  refuses a file, visenc gives the per-item error, never rows;
- visenc's handle (token count and grid, from the header alone) and preprocessed input equal what the
  checkpoint's ``AutoImageProcessor`` (transformers as SGLang pins it) makes of SGLang's image, for
  Qwen2-VL, Qwen2.5-VL and Qwen3-VL checkpoints.

Only the decoding on the CPU is compared: on a CUDA host SGLang decodes a JPEG with nvJPEG unless
``--image-loader``-like settings turn it off (``docs/integration-sglang.md``). The test builds
``EncoderPreprocessor`` without its ``__init__`` (which loads a served model): it sets the two
attributes ``_load_single_item`` reads, as ``__init__`` sets them on a host without a GPU image
processor. This runs SGLang's installed code, so it fails when an SGLang upgrade changes how images
load: then ``visenc.imaging.decode.LOADERS["sglang"]`` and its version must follow.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sglang", reason="needs SGLang in the engines' environment (make sglang)")

import sglang
from PIL import Image
from sglang.srt.disaggregation.encoder.preprocessor import EncoderPreprocessor
from sglang.srt.managers.schedule_batch import Modality
from sglang.srt.multimodal.encoder_preprocessing import EncoderMediaProcessorConfig
from sglang.srt.multimodal.processors.base_processor import BaseMultimodalProcessor
from tests.support.odd_images import LIMIT, assert_engine_inputs, corpus
from transformers.image_transforms import convert_to_rgb

from visenc.errors import VisencError
from visenc.imaging.decode import LOADERS, decode, probe

sys.path.insert(0, str(Path(__file__).parent.parent / "with_vllm"))
import tiny_vlm

CORPUS = corpus()


def encoder() -> EncoderPreprocessor:
    preprocessor = EncoderPreprocessor.__new__(EncoderPreprocessor)
    preprocessor.encoder_media_processor_config = EncoderMediaProcessorConfig()
    preprocessor.use_image_processor_gpu = False
    return preprocessor


ENCODER = encoder()


def sglang_load(data: bytes) -> Image.Image | Exception:
    try:
        return ENCODER._load_single_item(data, Modality.IMAGE)
    except Exception as e:  # SGLang refuses the file
        return e


def visenc_load(data: bytes) -> Image.Image | VisencError:
    try:
        return decode(data, max_pixels=LIMIT, loader="sglang")
    except VisencError as e:
        return e


def test_the_loader_names_the_installed_sglang():
    """The semantics ``--image-loader sglang`` follows are this SGLang's (its version is in the fingerprint)."""
    assert sglang.__version__ == LOADERS["sglang"].version


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_decode_equals_sglangs_encoder_loader_pixel_for_pixel(name: str) -> None:
    data = CORPUS[name]
    loaded, got = sglang_load(data), visenc_load(data)
    if isinstance(loaded, Exception):
        assert isinstance(got, VisencError), f"SGLang refuses {name} ({loaded!r}); visenc decoded it"
        return
    want = convert_to_rgb(loaded)  # the processor's first step (``do_convert_rgb``)
    assert isinstance(got, Image.Image), f"SGLang loads {name}; visenc: {got!r}"
    assert want.mode == got.mode == "RGB" and want.size == got.size
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)
    assert probe(data, max_pixels=LIMIT, loader="sglang") == want.size  # the handle's size, from the header
    # SGLang's processors without disaggregation load it the same way (the default RGB conversion)
    aggregated = BaseMultimodalProcessor._load_single_item(data, Modality.IMAGE)
    np.testing.assert_array_equal(np.asarray(aggregated), np.asarray(loaded), err_msg=name)


def test_a_rotated_photo_is_encoded_as_stored():
    """SGLang applies no EXIF orientation: orientation 6 stays the stored 240x160."""
    image = visenc_load(CORPUS["jpeg-exif-orientation-6"])
    assert isinstance(image, Image.Image) and image.size == (240, 160)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def model(request, tmp_path_factory) -> tuple[object, object]:
    """(the checkpoint's ``AutoImageProcessor`` as SGLang's encoder loads it, visenc's tower)."""
    from transformers import AutoImageProcessor

    from visenc.models.loading import load_tower

    path = tiny_vlm.build(tmp_path_factory.mktemp(request.param), seed=0, arch=request.param)
    return AutoImageProcessor.from_pretrained(str(path)), load_tower(str(path), image_loader="sglang")


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_handle_and_inputs_equal_sglangs_processor(model, name: str) -> None:
    processor, tower = model
    data = CORPUS[name]
    image = sglang_load(data)
    if isinstance(image, Exception):
        return  # refused (test_decode_equals_sglangs_encoder_loader_pixel_for_pixel checks visenc refuses it)

    def engine_inputs() -> tuple[int, tuple[int, ...], np.ndarray]:
        out = processor(images=[image], return_tensors="pt")
        grid = tuple(int(x) for x in out["image_grid_thw"][0].tolist())
        tokens = int(np.prod(grid)) // processor.merge_size**2  # SGLang's placeholder count per image
        return tokens, grid, out["pixel_values"].float().numpy()

    assert_engine_inputs(tower, data, "sglang", engine_inputs)
