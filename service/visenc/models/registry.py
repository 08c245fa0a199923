"""Built-in towers: real architectures, downsized, with seeded random weights."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from transformers import CLIPVisionModelWithProjection, SiglipVisionModel

from visenc.models.base import VisionTower
from visenc.models.clip import FixedPreprocess, FixedResolutionTower, tiny_clip_config, tiny_siglip_config
from visenc.models.construct import build_seeded, set_attention
from visenc.models.qwen2vl import (
    DEFAULT_MAX_PIXELS,
    Qwen2_5_VisionTransformerPretrainedModel,
    Qwen2VisionTransformerPretrainedModel,
    QwenPreprocess,
    QwenVisionTower,
    tiny_qwen2_5_vl_config,
    tiny_qwen2_vl_config,
)

DEFAULT_TOWER = "tiny-qwen2-vl"


@dataclass(frozen=True)
class _Entry:
    make_config: Callable[[], object]
    model_class: type[torch.nn.Module]
    family: str  # "qwen" | "fixed"


REGISTRY: dict[str, _Entry] = {
    "tiny-qwen2-vl": _Entry(tiny_qwen2_vl_config, Qwen2VisionTransformerPretrainedModel, "qwen"),
    "tiny-qwen2.5-vl": _Entry(tiny_qwen2_5_vl_config, Qwen2_5_VisionTransformerPretrainedModel, "qwen"),
    "tiny-clip": _Entry(tiny_clip_config, CLIPVisionModelWithProjection, "clip"),
    "tiny-siglip": _Entry(tiny_siglip_config, SiglipVisionModel, "siglip"),
}


def build_registered(
    name: str, *, dtype: torch.dtype, device: torch.device, max_pixels: int | None, seed: int, backend: str
) -> VisionTower:
    """A built-in tower by registry name."""
    try:
        entry = REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown tower {name!r}; built-in towers are {sorted(REGISTRY)}") from None
    config = entry.make_config()
    set_attention(config)
    model = build_seeded(lambda: entry.model_class(config), seed)
    source = {"registry": name, "seed": seed}
    if entry.family == "qwen":
        settings = QwenPreprocess(max_pixels=max_pixels or DEFAULT_MAX_PIXELS, backend=backend)
        return QwenVisionTower(name=name, model=model, preprocess=settings, source=source, dtype=dtype, device=device)
    fixed = FixedPreprocess.clip_default() if entry.family == "clip" else FixedPreprocess.siglip_default()
    fixed = replace(fixed, backend=backend)
    return FixedResolutionTower(
        name=name,
        model=model,  # type: ignore[arg-type]
        preprocess=fixed,
        source=source,
        dtype=dtype,
        device=device,
    )
