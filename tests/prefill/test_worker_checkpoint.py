"""``visenc serve --model PATH`` on a saved tiny Qwen2-VL: visenc serves the checkpoint's own vision
weights, and a prefill worker holding only the language model reproduces the full model's logits."""

from __future__ import annotations

import pytest
import torch
from harness.processes import serve_process
from tests.prefill.reference import ATOL, full_model_reference, max_abs_diff, prompt_and_images, splits_an_image
from transformers import (
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessor,  # the fast (torchvision) processors: the default backend
)

from examples.qwen2vl_prefill import (
    IMAGE_TOKEN_ID,
    NoVisionTower,
    build_tiny_vlm,
    chunked_prefill,
    load_language_model,
    save_tiny_vlm,
)
from visenc.models.qwen2vl import tiny_qwen2_vl_config
from visenc_client import Client
from visenc_client.prefill import VisencPrefill


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny VLM saved with ``save_pretrained``: tiny-qwen2-vl's architecture, its own random weights."""
    path = tmp_path_factory.mktemp("tiny-vlm")
    save_tiny_vlm(build_tiny_vlm(tiny_qwen2_vl_config().to_dict(), seed=7), path)
    return path


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-ckpt") / "serve.log"
    with serve_process("--model", str(checkpoint), "--max-wait-ms", "2", log=log) as url:
        yield url


@pytest.fixture(scope="module")
def reference(checkpoint):
    full = Qwen2VLForConditionalGeneration.from_pretrained(checkpoint).eval()
    return full_model_reference(full, Qwen2VLImageProcessor.from_pretrained(checkpoint), *prompt_and_images())


def test_worker_holds_only_the_language_model(checkpoint):
    model = load_language_model(checkpoint)
    assert isinstance(model.model.visual, NoVisionTower)
    names = [n for n, _ in model.named_parameters()]
    assert names and not [n for n in names if "visual" in n]
    with pytest.raises(RuntimeError, match="no vision tower"):
        model.model.visual(torch.zeros(4, 1176), grid_thw=torch.tensor([[1, 2, 2]]))


def test_checkpoint_served_by_visenc_reproduces_the_full_model(checkpoint, server, reference, tiny_tower):
    model = load_language_model(checkpoint)
    with Client(server) as vc:
        served = vc.model()
        assert served["name"] == str(checkpoint)
        assert served["fingerprint"] != tiny_tower.fingerprint  # the checkpoint's weights, not the default's
        prefill = VisencPrefill(vc, image_token_id=IMAGE_TOKEN_ID, merge_size=2)
        layout = prefill.prepare(reference.prompt, reference.images)
        assert torch.equal(torch.from_numpy(layout.input_ids), reference.input_ids[0])
        for chunk in (5, 33, layout.num_positions):
            assert chunk == layout.num_positions or splits_an_image(
                [(p.offset, p.num_tokens) for p in layout.placements], chunk
            )
            logits = chunked_prefill(model, prefill, layout, chunk)
            assert max_abs_diff(logits, reference.logits) <= ATOL, chunk
