"""Tiny seeded full-VLM checkpoints of each served family, and transformers' own placeholder rows."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

IMAGE_TOKEN = 5  # every tiny family's image placeholder id; vocab 64
TEXT_HIDDEN = 64

_TEXT = {
    "hidden_size": TEXT_HIDDEN,
    "intermediate_size": 96,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "vocab_size": 64,
}
_SIGLIP = {
    "hidden_size": 48,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "patch_size": 14,
}


def _qwen3_vl() -> tuple[Any, Any]:
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    vision = {
        "depth": 3,
        "hidden_size": 48,
        "intermediate_size": 96,
        "num_heads": 2,
        "out_hidden_size": TEXT_HIDDEN,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 144,
        "deepstack_visual_indexes": [0, 2],
    }
    text = {**_TEXT, "rope_parameters": {"rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 1e4}}
    config = Qwen3VLConfig(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN)
    proc = Qwen2VLImageProcessorPil(
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
        size={"shortest_edge": 64 * 64, "longest_edge": 320 * 320},
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
    )
    return Qwen3VLForConditionalGeneration(config), proc


def _grid_family(names: tuple[str, str, str], **vision: Any) -> tuple[Any, Any]:
    """A Qwen-style grid family (transformers' ``{config, model, PIL image processor}`` class ``names``):
    a 2-block tower at 14 px patches merged 2x2 into rows as wide as the text model, plus ``vision``."""
    import transformers

    config_class, model_class, proc_class = (getattr(transformers, n) for n in names)
    vision = {
        "depth": 2,
        "hidden_size": 48,
        "intermediate_size": 96,
        "num_heads": 2,
        "out_hidden_size": TEXT_HIDDEN,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        **vision,
    }
    text = {**_TEXT, "rope_parameters": {"rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 1e4}}
    config = config_class(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN)
    proc = proc_class(
        patch_size=14, merge_size=2, temporal_patch_size=2, size={"shortest_edge": 56 * 56, "longest_edge": 280 * 280}
    )
    return model_class(config), proc


def _glm4v() -> tuple[Any, Any]:
    return _grid_family(("Glm4vConfig", "Glm4vForConditionalGeneration", "Glm4vImageProcessorPil"), image_size=112)


def _gemma3() -> tuple[Any, Any]:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil

    vision = {**_SIGLIP, "image_size": 112, "model_type": "siglip_vision_model"}
    config = Gemma3Config(
        vision_config=vision,
        text_config={**_TEXT, "model_type": "gemma3_text"},
        mm_tokens_per_image=16,
        image_token_index=IMAGE_TOKEN,
    )
    proc = Gemma3ImageProcessorPil(size={"height": 112, "width": 112})
    return Gemma3ForConditionalGeneration(config), proc


def _internvl() -> tuple[Any, Any]:
    from transformers import GotOcr2ImageProcessorPil, InternVLConfig, InternVLForConditionalGeneration

    vision = {
        "hidden_size": 48,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": [56, 56],
        "patch_size": [14, 14],
    }
    config = InternVLConfig(
        vision_config=vision, text_config={**_TEXT, "model_type": "qwen2"}, image_token_id=IMAGE_TOKEN
    )
    proc = GotOcr2ImageProcessorPil(size={"height": 56, "width": 56}, max_patches=6, crop_to_patches=True)
    return InternVLForConditionalGeneration(config), proc


def _llava_onevision() -> tuple[Any, Any]:
    from transformers import (
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        LlavaOnevisionImageProcessorPil,
    )

    pinpoints = [[56, 56], [56, 112], [112, 56], [112, 112], [56, 168], [168, 56]]
    config = LlavaOnevisionConfig(
        vision_config={**_SIGLIP, "image_size": 56, "model_type": "siglip_vision_model"},
        text_config={**_TEXT, "model_type": "qwen2"},
        image_token_id=IMAGE_TOKEN,
        image_grid_pinpoints=pinpoints,
        vision_aspect_ratio="anyres_max_4",
    )
    proc = LlavaOnevisionImageProcessorPil(
        size={"height": 56, "width": 56}, image_grid_pinpoints=pinpoints, crop_size={"height": 56, "width": 56}
    )
    return LlavaOnevisionForConditionalGeneration(config), proc


def _mistral3() -> tuple[Any, Any]:
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, PixtralImageProcessorPil

    vision = {
        "hidden_size": 48,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "head_dim": 24,
        "image_size": 224,
        "patch_size": 14,
        "model_type": "pixtral",
    }
    config = Mistral3Config(
        vision_config=vision,
        text_config={**_TEXT, "model_type": "mistral"},
        image_token_index=IMAGE_TOKEN,
        spatial_merge_size=2,
        vision_feature_layer=-1,
    )
    proc = PixtralImageProcessorPil(size={"longest_edge": 224}, patch_size=14)
    return Mistral3ForConditionalGeneration(config), proc


def _idefics3_like(kind: str) -> tuple[Any, Any]:
    import transformers

    prefix = "Idefics3" if kind == "idefics3" else "SmolVLM"
    config_class = getattr(transformers, f"{prefix}Config")
    model_class = getattr(transformers, f"{prefix}ForConditionalGeneration")
    proc_class = getattr(transformers, f"{prefix}ImageProcessorPil")
    vision = {**_SIGLIP, "image_size": 56, "patch_size": 14}
    config = config_class(
        vision_config=vision, text_config={**_TEXT, "model_type": "llama"}, image_token_id=IMAGE_TOKEN, scale_factor=2
    )
    proc = proc_class(size={"longest_edge": 112}, max_image_size={"longest_edge": 56}, do_image_splitting=True)
    return model_class(config), proc


def _gemma4() -> tuple[Any, Any]:
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4ImageProcessorPil

    vision = {
        "hidden_size": 48,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 24,
        "patch_size": 8,
        "pooling_kernel_size": 2,
        "position_embedding_size": 256,
    }
    text = {
        **_TEXT,
        "model_type": "gemma4_text",
        "hidden_size_per_layer_input": 8,
        "vocab_size_per_layer_input": 64,
        "num_kv_shared_layers": 0,
        "layer_types": ["full_attention"],
    }
    config = Gemma4Config(vision_config=vision, text_config=text, audio_config=None, image_token_id=IMAGE_TOKEN)
    proc = Gemma4ImageProcessorPil(patch_size=8, pooling_kernel_size=2, max_soft_tokens=70)
    return Gemma4ForConditionalGeneration(config), proc


BUILDERS: dict[str, Callable[[], tuple[Any, Any]]] = {
    "qwen3_vl": _qwen3_vl,
    "glm4v": _glm4v,
    "gemma3": _gemma3,
    "gemma4": _gemma4,
    "internvl": _internvl,
    "llava_onevision": _llava_onevision,
    "mistral3": _mistral3,
    "idefics3": lambda: _idefics3_like("idefics3"),
    "smolvlm": lambda: _idefics3_like("smolvlm"),
}


def _qwen2_5_vl() -> tuple[Any, Any]:
    names = ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", "Qwen2VLImageProcessorPil")
    return _grid_family(names, window_size=56, fullatt_block_indexes=[1])


#: checkpoints visenc serves through its own tower classes (not ``FamilyTower``): built and saved the
#: same way, but not part of the family suites that iterate over ``BUILDERS``
OTHER_BUILDERS: dict[str, Callable[[], tuple[Any, Any]]] = {"qwen2_5_vl": _qwen2_5_vl}


def build_family(name: str, seed: int = 0) -> tuple[Any, Any]:
    """(full VLM in eval mode with seeded weights, its PIL image processor)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model, proc = {**BUILDERS, **OTHER_BUILDERS}[name]()
        with torch.no_grad():
            # constant initialisations (zero projections, unit norms) would hide a wrong weight
            for param in model.parameters():
                if param.numel() > 1 and bool((param == param.flatten()[0]).all()):
                    param.add_(0.05 * torch.randn_like(param))
    return model.eval(), proc


def save_family(name: str, outdir: str | Path, seed: int = 0) -> Path:
    """Write a checkpoint folder of the tiny family ``name`` (or of ``OTHER_BUILDERS``) and return it."""
    out = Path(outdir)
    model, proc = build_family(name, seed)
    model.save_pretrained(out)
    proc.save_pretrained(out)
    return out


def reference_inputs(proc: Any, image: Any, call_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The image processor's outputs the VLM's forward takes, for one image."""
    out = proc(images=[image], return_tensors="pt", **call_kwargs)
    keep = ("pixel_values", "image_grid_thw", "image_sizes", "pixel_attention_mask", "image_position_ids")
    return {k: out[k] for k in keep if k in out}


def language_model_inputs(model: Any, inputs: dict[str, Any], ids: torch.Tensor) -> tuple[torch.Tensor, list[Any]]:
    """Run the whole VLM on ``ids`` (``[1, L]``) with the image ``inputs``; return the
    ``inputs_embeds`` (``[L, hidden]``) and deepstack features its language model receives. The
    model's own placeholder check (image tokens == feature rows) runs on the way."""
    captured: dict[str, Any] = {}

    def grab(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        captured.update(kwargs)

    lm = model.model.language_model if hasattr(model.model, "language_model") else model.model.text_model
    handle = lm.register_forward_pre_hook(grab, with_kwargs=True)
    extra: dict[str, Any] = {}
    if "image_grid_thw" in inputs or type(model).__name__.startswith("Gemma4"):
        extra["mm_token_type_ids"] = (ids == IMAGE_TOKEN).long()
    try:
        with torch.inference_mode():
            model(input_ids=ids, attention_mask=torch.ones_like(ids), **inputs, **extra)
    finally:
        handle.remove()
    return captured["inputs_embeds"][0], list(captured.get("deepstack_visual_embeds") or [])


def placeholder_rows(model: Any, inputs: dict[str, Any], num_rows: int) -> torch.Tensor:
    """The rows the VLM places at the image's ``num_rows`` placeholder positions (a prompt of one
    text token, the placeholders, one text token), deepstack levels appended along the hidden axis."""
    ids = torch.tensor([[1] + [IMAGE_TOKEN] * num_rows + [2]])
    embeds, deepstack = language_model_inputs(model, inputs, ids)
    rows = embeds[ids[0] == IMAGE_TOKEN]
    return torch.cat([rows, *deepstack], dim=-1) if deepstack else rows
