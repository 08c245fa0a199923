"""Qwen2-VL and Qwen2.5-VL: their vision transformers read from a checkpoint, and the tiny built-ins."""

from __future__ import annotations

from dataclasses import replace

import torch
from transformers import AutoConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

from visenc.models.base import VisionTower
from visenc.models.construct import build_empty, build_seeded, set_attention
from visenc.models.qwen2vl import (
    DEFAULT_MAX_PIXELS,
    QwenPreprocess,
    QwenVisionTower,
    tiny_qwen2_5_vl_config,
    tiny_qwen2_vl_config,
)
from visenc.models.registry import Family, TowerOptions, read_json, read_vision_weights
from visenc.models.weights import Checkpoint

#: ``model_type`` → the vision transformer class
ARCHITECTURES: dict[str, type[torch.nn.Module]] = {
    "qwen2_vl": Qwen2VisionTransformerPretrainedModel,
    "qwen2_5_vl": Qwen2_5_VisionTransformerPretrainedModel,
}
_TINY = {"tiny-qwen2-vl": tiny_qwen2_vl_config, "tiny-qwen2.5-vl": tiny_qwen2_5_vl_config}


def load(checkpoint: Checkpoint, model_type: str, options: TowerOptions) -> VisionTower:
    config = AutoConfig.from_pretrained(checkpoint.folder).vision_config
    set_attention(config)
    model = build_empty(lambda: ARCHITECTURES[model_type](config))
    digest = read_vision_weights(model, checkpoint.weights)
    geometry = {
        "patch_size": config.patch_size,
        "merge_size": config.spatial_merge_size,
        "temporal_patch_size": config.temporal_patch_size,
    }
    settings = QwenPreprocess.from_processor_config(
        {**geometry, **read_json(checkpoint.folder / "preprocessor_config.json")}
    )
    settings = replace(settings, backend=options.backend)
    if options.max_pixels is not None:
        settings = replace(settings, max_pixels=options.max_pixels)
    source = {"checkpoint": model_type, "weights": digest}
    return _tower(checkpoint.name, model, settings, source, options)


def build(name: str, options: TowerOptions) -> VisionTower:
    config = _TINY[name]()
    set_attention(config)
    model_type = "qwen2_vl" if name == "tiny-qwen2-vl" else "qwen2_5_vl"
    model = build_seeded(lambda: ARCHITECTURES[model_type](config), options.seed)
    settings = QwenPreprocess(max_pixels=options.max_pixels or DEFAULT_MAX_PIXELS, backend=options.backend)
    return _tower(name, model, settings, {"registry": name, "seed": options.seed}, options)


def _tower(
    name: str, model: torch.nn.Module, settings: QwenPreprocess, source: dict, options: TowerOptions
) -> VisionTower:
    return QwenVisionTower(
        name=name, model=model, preprocess=settings, source=source, dtype=options.dtype, device=options.device
    )


FAMILIES = (Family(tuple(ARCHITECTURES), load, dict.fromkeys(_TINY, build)),)
