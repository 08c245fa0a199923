"""CLIP and SigLIP image embeddings (one row per image): read from a checkpoint, and the tiny built-ins."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from transformers import AutoConfig, CLIPVisionModelWithProjection, SiglipVisionModel

from visenc.models.base import VisionTower
from visenc.models.clip import FixedPreprocess, FixedResolutionTower, tiny_clip_config, tiny_siglip_config
from visenc.models.construct import build_empty, build_seeded, set_attention
from visenc.models.registry import Family, TowerOptions, read_json, read_vision_weights
from visenc.models.weights import Checkpoint

#: ``model_type`` → (the vision model class, its processor's defaults)
KINDS: dict[str, tuple[type, Any]] = {
    "clip": (CLIPVisionModelWithProjection, FixedPreprocess.clip_default),
    "siglip": (SiglipVisionModel, FixedPreprocess.siglip_default),
}
_TINY = {"tiny-clip": ("clip", tiny_clip_config), "tiny-siglip": ("siglip", tiny_siglip_config)}


def load(checkpoint: Checkpoint, model_type: str, options: TowerOptions) -> VisionTower:
    full = AutoConfig.from_pretrained(checkpoint.folder)
    config = full.vision_config
    set_attention(config)
    if model_type == "clip":  # CLIPModel projects with the top-level projection_dim, not the vision config's
        config.projection_dim = full.projection_dim
    model_class, defaults = KINDS[model_type]
    model = build_empty(lambda: model_class(config))
    digest = read_vision_weights(model, checkpoint.weights)
    preprocess = defaults().with_processor_config(read_json(checkpoint.folder / "preprocessor_config.json"))
    return _tower(checkpoint.name, model, preprocess, {"checkpoint": model_type, "weights": digest}, options)


def build(name: str, options: TowerOptions) -> VisionTower:
    model_type, make_config = _TINY[name]
    config = make_config()
    set_attention(config)
    model_class, defaults = KINDS[model_type]
    model = build_seeded(lambda: model_class(config), options.seed)
    return _tower(name, model, defaults(), {"registry": name, "seed": options.seed}, options)


def _tower(name: str, model: Any, preprocess: FixedPreprocess, source: dict, options: TowerOptions) -> VisionTower:
    return FixedResolutionTower(
        name=name,
        model=model,
        preprocess=replace(preprocess, backend=options.backend),
        source=source,
        dtype=options.dtype,
        device=options.device,
    )


FAMILIES = (Family(tuple(KINDS), load, dict.fromkeys(_TINY, build)),)
