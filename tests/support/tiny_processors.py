"""Each tiny family's own transformers ``Processor`` (image processor + a tokenizer), saved beside its
checkpoint, so that transformers' ``AutoProcessor`` and vLLM's multimodal processor both load it.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

#: the image-processor backends, as test parameters (torchvision's skipped where it is not installed)
BACKENDS = [
    "pil",
    pytest.param(
        "torchvision",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("torchvision") is None,
            reason="the torchvision backend needs torchvision installed",
        ),
    ),
]


def byte_tokenizer(specials: list[str], **kwargs: Any) -> Any:
    """A byte-level BPE tokenizer without merges, with ``specials`` as special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=4096, **kwargs)


def hub_siglip_names(file: Path) -> None:
    """Rewrite SigLIP vision tensors' names as Hub checkpoints have them (``vision_tower.vision_model.*``):
    vLLM's loader expects that nesting, which ``save_pretrained`` of transformers 5.x leaves out
    (visenc loads either)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(file)
    fixed = {
        ("vision_tower.vision_model." + k.removeprefix("vision_tower.") if k.startswith("vision_tower.") else k): v
        for k, v in tensors.items()
    }
    save_file({k: v.contiguous() for k, v in fixed.items()}, file, metadata={"format": "pt"})


@dataclass(frozen=True)
class ProcessorSpec:
    """How a family's ``Processor`` is made: its special tokens, the config attributes that name
    their ids, the processor (``make(image_processor, tokenizer)``), and the prompt of one image."""

    specials: list[str]
    token_ids: dict[str, str]
    make: Callable[[Any, Any], Any]
    prompt: str
    image_token: str
    tokenizer_kwargs: dict[str, Any] = field(default_factory=dict)
    #: further config values the engines read (``sub_config.attribute`` -> value)
    config: dict[str, Any] = field(default_factory=dict)


def _specs() -> dict[str, ProcessorSpec]:
    import transformers as t

    qwen = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
    glm = ["<|image|>", "<|begin_of_image|>", "<|end_of_image|>", "<|video|>", "<|begin_of_video|>", "<|end_of_video|>"]
    idefics = ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"]
    gemma = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    internvl = {
        "start_image_token": "<img>",
        "end_image_token": "</img>",
        "context_image_token": "<IMG_CONTEXT>",
        "video_token": "<video>",
    }
    mistral = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]
    gemma4 = {
        "boi_token": "<|image>",
        "eoi_token": "<image|>",
        "image_token": "<|image|>",
        # transformers' Gemma4Processor asks for its audio tokens even without audio
        "audio_token": "<|audio|>",
        "boa_token": "<|audio>",
        "eoa_token": "<audio|>",
    }
    return {
        "qwen3_vl": ProcessorSpec(
            qwen,
            {"image_token_id": qwen[1], "video_token_id": qwen[3]},
            lambda ip, tok: t.Qwen3VLProcessor(
                image_processor=ip, tokenizer=tok, video_processor=t.Qwen3VLVideoProcessor()
            ),
            qwen[0] + qwen[1] + qwen[2],
            qwen[1],
        ),
        "gemma3": ProcessorSpec(
            [*gemma.values(), "\n\n"],
            {"image_token_index": gemma["image_token"], "boi_token_index": gemma["boi_token"]},
            lambda ip, tok: t.Gemma3Processor(image_processor=ip, tokenizer=tok, image_seq_length=16),
            gemma["boi_token"],
            gemma["image_token"],
            {"extra_special_tokens": gemma},
        ),
        "gemma4": ProcessorSpec(
            [*gemma4.values(), "<|video|>", "<pad>"],
            {
                "image_token_id": gemma4["image_token"],
                "boi_token_id": gemma4["boi_token"],
                "eoi_token_id": gemma4["eoi_token"],
                "audio_token_id": gemma4["audio_token"],
                "boa_token_id": gemma4["boa_token"],
                "eoa_token_index": gemma4["eoa_token"],
                "video_token_id": "<|video|>",
            },
            lambda ip, tok: t.Gemma4Processor(
                feature_extractor=t.Gemma4AudioFeatureExtractor(),
                image_processor=ip,
                tokenizer=tok,
                video_processor=t.Gemma4VideoProcessor(),
                image_seq_length=ip.max_soft_tokens,
            ),
            gemma4["image_token"],
            gemma4["image_token"],
            {"extra_special_tokens": gemma4, "pad_token": "<pad>"},
            {"vision_config.default_output_length": 70},  # tiny_families' max_soft_tokens
        ),
        "mistral3": ProcessorSpec(
            mistral,
            {"image_token_index": "[IMG]"},
            lambda ip, tok: t.PixtralProcessor(
                image_processor=ip,
                tokenizer=tok,
                patch_size=14,
                spatial_merge_size=2,
                image_token=mistral[0],
                image_break_token=mistral[1],
                image_end_token=mistral[2],
            ),
            "[IMG]",
            "[IMG]",
        ),
        "llava_onevision": ProcessorSpec(
            ["<image>", "<video>"],
            {"image_token_id": "<image>", "video_token_id": "<video>"},
            lambda ip, tok: t.LlavaOnevisionProcessor(
                image_processor=ip,
                tokenizer=tok,
                video_processor=t.LlavaOnevisionVideoProcessor(),
                num_image_tokens=16,
                vision_feature_select_strategy="full",
                vision_aspect_ratio="anyres_max_4",
            ),
            "<image>",
            "<image>",
        ),
        "glm4v": ProcessorSpec(
            glm,
            {
                "image_token_id": glm[0],
                "image_start_token_id": glm[1],
                "image_end_token_id": glm[2],
                "video_token_id": glm[3],
                "video_start_token_id": glm[4],
                "video_end_token_id": glm[5],
            },
            lambda ip, tok: t.Glm4vProcessor(
                image_processor=ip, tokenizer=tok, video_processor=t.Glm4vVideoProcessor()
            ),
            glm[1] + glm[0] + glm[2],
            glm[0],
            {},
            # vLLM's GLM-4 rotates half of each head (partial_rotary_factor 0.5): the sections split that half
            {
                "text_config.rope_parameters": {
                    "rope_type": "default",
                    "mrope_section": [2, 3, 3],
                    "rope_theta": 1e4,
                    "partial_rotary_factor": 0.5,
                }
            },
        ),
        "idefics3": ProcessorSpec(
            idefics,
            {"image_token_id": "<image>"},
            lambda ip, tok: t.Idefics3Processor(image_processor=ip, tokenizer=tok, image_seq_len=4),
            "<image>",
            "<image>",
        ),
        "smolvlm": ProcessorSpec(
            idefics,
            {"image_token_id": "<image>"},
            lambda ip, tok: t.SmolVLMProcessor(
                image_processor=ip, tokenizer=tok, video_processor=t.SmolVLMVideoProcessor(), image_seq_len=4
            ),
            "<image>",
            "<image>",
        ),
        "internvl": ProcessorSpec(
            list(internvl.values()),
            {"image_token_id": "<IMG_CONTEXT>"},
            lambda ip, tok: t.InternVLProcessor(
                image_processor=ip, tokenizer=tok, video_processor=t.InternVLVideoProcessor(), image_seq_length=4
            ),
            "<IMG_CONTEXT>",
            "<IMG_CONTEXT>",
            {"extra_special_tokens": internvl},
        ),
    }


PROCESSORS = _specs()


def save_with_processor(name: str, outdir: str | Path, seed: int = 0, vision_seed: int | None = None) -> Path:
    """A tiny ``tiny_families`` checkpoint of ``name`` with its tokenizer and ``Processor`` saved beside
    it, whole enough for vLLM to load and run: the config's special-token ids are the tokenizer's and
    the language model's embeddings grow to its vocabulary. ``vision_seed`` redraws the image path
    (everything but the language model): a copy whose own image embeddings are wrong."""
    import torch
    from harness.tiny_families import build_family

    spec = PROCESSORS[name]
    out = Path(outdir)
    model, image_processor = build_family(name, seed)
    if vision_seed is not None and vision_seed != seed:
        other = dict(build_family(name, vision_seed)[0].named_parameters())
        language = {id(p) for m in (model.get_decoder(), model.get_output_embeddings()) for p in m.parameters()}
        with torch.no_grad():
            for key, param in model.named_parameters():
                if id(param) not in language:
                    param.copy_(other[key])
    tok = byte_tokenizer(spec.specials, **spec.tokenizer_kwargs)
    config = model.config
    for attr, special in spec.token_ids.items():
        setattr(config, attr, tok.convert_tokens_to_ids(special))
    for path, value in spec.config.items():
        *parents, attr = path.split(".")
        setattr(functools.reduce(getattr, parents, config), attr, value)
    model.resize_token_embeddings(len(tok))
    model.save_pretrained(out)
    if getattr(config, "vision_config", None) is not None and config.vision_config.model_type == "siglip_vision_model":
        hub_siglip_names(out / "model.safetensors")
    tok.save_pretrained(out)
    spec.make(image_processor, tok).save_pretrained(out)
    return out
