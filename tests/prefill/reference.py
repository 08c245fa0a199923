"""Fixtures of the prefill tests: the prompt, its images, and the full model's own answer.

The reference is the full Qwen2-VL model's single forward over the expanded
``input_ids`` with ``pixel_values`` / ``image_grid_thw`` from transformers'
``Qwen2VLImageProcessor``, expanded by ``Qwen2VLProcessor``'s own
placeholder rule: its built-in vision path, no visenc involved.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch
from harness.images import png_bytes
from PIL import Image
from transformers import (
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessor,  # the fast (torchvision) processors: the default backend
)
from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor

from examples.qwen2vl_prefill import IMAGE_TOKEN_ID, demo_prompt

#: (width, height) of the prompt's images, in prompt order: three resolutions, three token counts
IMAGE_SIZES = ((64, 96), (224, 140), (150, 300))
#: fp32 logits of the chunked prefill vs the full model's forward (observed differences are ~1e-6)
ATOL = 1e-4


@dataclass(frozen=True)
class Reference:
    prompt: list[int]  # one placeholder per image
    images: list[bytes]
    input_ids: torch.Tensor  # [1, L], placeholders expanded by the processor's rule
    logits: torch.Tensor  # [L, vocab], the full model's own forward


def prompt_and_images() -> tuple[list[int], list[bytes]]:
    images = [png_bytes(seed, w, h) for seed, (w, h) in enumerate(IMAGE_SIZES, start=11)]
    return demo_prompt(len(images), seed=3), images


def processor_input_ids(prompt: list[int], image_grid_thw: torch.Tensor, merge_size: int) -> torch.Tensor:
    """The prompt with each placeholder expanded by ``Qwen2VLProcessor.replace_image_token`` (called
    unbound: the processor itself needs a tokenizer and torchvision, its expansion rule needs neither)."""
    fake = SimpleNamespace(image_processor=SimpleNamespace(merge_size=merge_size), image_token="x")
    counts = iter(
        len(Qwen2VLProcessor.replace_image_token(fake, {"image_grid_thw": image_grid_thw}, k))
        for k in range(len(image_grid_thw))
    )
    ids: list[int] = []
    for token in prompt:
        ids += [token] * next(counts) if token == IMAGE_TOKEN_ID else [token]
    return torch.tensor([ids])


def full_model_reference(
    model: Qwen2VLForConditionalGeneration, processor: Qwen2VLImageProcessor, prompt: list[int], images: list[bytes]
) -> Reference:
    pixels = processor(images=[Image.open(io.BytesIO(b)) for b in images], return_tensors="pt")
    input_ids = processor_input_ids(prompt, pixels["image_grid_thw"], processor.merge_size)
    with torch.inference_mode():
        logits = model(
            input_ids=input_ids,
            pixel_values=pixels["pixel_values"],
            image_grid_thw=pixels["image_grid_thw"],
            mm_token_type_ids=(input_ids == IMAGE_TOKEN_ID).int(),
        ).logits[0]
    return Reference(prompt, images, input_ids, logits)


def splits_an_image(offsets_and_sizes: list[tuple[int, int]], chunk: int) -> bool:
    """Whether some chunk boundary falls strictly inside an image."""
    return any(off // chunk != (off + n - 1) // chunk for off, n in offsets_and_sizes if n > 1)


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(np.abs(a.numpy() - b.numpy()).max())
