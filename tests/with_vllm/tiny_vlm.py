"""A tiny random Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint that transformers and vLLM both load offline.

    python tests/with_vllm/tiny_vlm.py OUTDIR [--seed N] [--vision-seed N] [--arch qwen2_vl|qwen2_5_vl|qwen3_vl]

config.json + model.safetensors (fp32, seeded), a byte-level tokenizer (256 byte tokens + Qwen's
special tokens, no merges: nothing to download), a chat template, and a preprocessor config with
a small pixel range (at most 256 image tokens per image). ``--vision-seed`` redraws only the
vision tower: a copy whose own image path is wrong, to prove that embeddings come from elsewhere.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if str(ROOT := Path(__file__).resolve().parents[2]) not in sys.path:  # run as a script: tests.support
    sys.path.insert(0, str(ROOT))

SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] in ('video', 'video_url') %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


#: Gemma's vocabulary has newline runs as single tokens; vLLM's Gemma 3 processing looks them up
GEMMA_SPECIALS = ["<pad>", "<bos>", "<eos>", "<start_of_image>", "<end_of_image>", "<image_soft_token>"] + [
    "\n" * n for n in range(1, 5)
]


def _tokenizer(specials: list[str] | None = None, **kwargs):
    from tests.support.tiny_processors import byte_tokenizer

    names = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"} if specials is None else {}
    fast = byte_tokenizer(specials or SPECIALS, **names, **kwargs)
    fast.chat_template = CHAT_TEMPLATE
    return fast


#: vision config per architecture (merger output = the text hidden size, 128)
VISION = {
    "qwen2_vl": {"depth": 2, "embed_dim": 64, "num_heads": 2, "hidden_size": 128, "mlp_ratio": 2, "patch_size": 14},
    "qwen2_5_vl": {
        "depth": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 2,
        "out_hidden_size": 128,
        "patch_size": 14,
        "window_size": 56,
        "fullatt_block_indexes": [1],
    },
    "qwen3_vl": {
        "depth": 3,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 2,
        "out_hidden_size": 128,
        "patch_size": 16,
        "num_position_embeddings": 256,
        "deepstack_visual_indexes": [0, 2],
    },
}
ARCHES = tuple(VISION)


def _text_config(vocab: int, *, bos: int, eos: int, pad: int) -> dict:
    """The tiny language model every checkpoint here shares: 2 layers, width 128."""
    return {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
    }


def _wide(row_width: int) -> dict:
    """The language model ``row_width`` wide: vLLM's Qwen2 reads a head's width as the model's width
    over its heads (``hidden_size // num_attention_heads``), so the heads grow with it and stay 64
    wide, as the rotary sections (8 + 12 + 12 = 64 / 2) need."""
    if row_width % 64:
        raise ValueError(f"row_width must be a multiple of 64, not {row_width}")
    return {"hidden_size": row_width, "num_attention_heads": row_width // 64}


def _classes(arch: str) -> tuple[type, type]:
    import transformers

    prefix = {"qwen2_vl": "Qwen2VL", "qwen2_5_vl": "Qwen2_5_VL", "qwen3_vl": "Qwen3VL"}[arch]
    return getattr(transformers, f"{prefix}Config"), getattr(transformers, f"{prefix}ForConditionalGeneration")


#: vision towers of real sizes for the Qwen2-VL architecture (random weights; rows still 128 wide)
TOWERS = {
    "tiny": {},
    "vit-b": {"depth": 12, "embed_dim": 768, "num_heads": 12, "mlp_ratio": 4},
    "vit-l": {"depth": 24, "embed_dim": 1024, "num_heads": 16, "mlp_ratio": 4},
}


def build(
    outdir: str | Path,
    *,
    seed: int = 0,
    vision_seed: int | None = None,
    arch: str = "qwen2_vl",
    vision: dict | None = None,
    row_width: int | None = None,
    max_image_tokens: int = 256,
    max_positions: int = 4096,
) -> Path:
    """``vision``: overrides of the vision config (``TOWERS`` for Qwen2-VL towers of real sizes);
    ``row_width``: the language model's width, and so the rows' (a 7B model's: 3584; default 128);
    ``max_image_tokens``: the processor's resize ceiling, in image tokens; ``max_positions``: the
    longest sequence the language model takes (vLLM refuses a longer ``--max-model-len``)."""
    import torch

    config_class, model_class = _classes(arch)
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer()
    ids = {s: tok.convert_tokens_to_ids(s) for s in SPECIALS}
    patch = VISION[arch]["patch_size"]
    rope = {"rope_type": "default", "mrope_section": [8, 12, 12], "rope_theta": 1000000.0}
    if arch == "qwen3_vl":
        rope = {**rope, "mrope_section": [8, 12, 12], "mrope_interleaved": True}
    width = (
        {}
        if row_width is None
        else {"out_hidden_size" if "out_hidden_size" in VISION[arch] else "hidden_size": row_width}
    )
    config = config_class(
        vision_config={
            **VISION[arch],
            **(vision or {}),
            **width,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
        },
        text_config={
            **_text_config(len(tok), bos=ids["<|endoftext|>"], eos=ids["<|im_end|>"], pad=ids["<|endoftext|>"]),
            **({} if row_width is None else _wide(row_width)),
            "max_position_embeddings": max_positions,
            "rms_norm_eps": 1e-6,
            "rope_parameters": rope,
            "rope_scaling": rope,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = model_class(config).eval()
    if vision_seed is not None and vision_seed != seed:
        torch.manual_seed(vision_seed)
        other = model_class(config).eval()
        model.model.visual.load_state_dict(other.model.visual.state_dict())
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    factor = (patch * 2) ** 2
    min_pixels, max_pixels = 4 * factor, max_image_tokens * factor  # at most this many image tokens per image
    (out / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "Qwen2VLImageProcessor",
                "processor_class": f"{_classes(arch)[0].__name__.removesuffix('Config')}Processor",
                "do_convert_rgb": True,
                "do_resize": True,
                "resample": 3,
                "do_rescale": True,
                "rescale_factor": 1 / 255,
                "do_normalize": True,
                "image_mean": [0.48145466, 0.4578275, 0.40821073],
                "image_std": [0.26862954, 0.26130258, 0.27577711],
                "min_pixels": min_pixels,
                "max_pixels": max_pixels,
                "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
                "patch_size": patch,
                "temporal_patch_size": 2,
                "merge_size": 2,
            },
            indent=2,
        )
    )
    return out


def build_gemma3(outdir: str | Path, *, seed: int = 0, vision_seed: int | None = None) -> Path:
    """A tiny Gemma 3: SigLIP at 112 px (8x8 patches, pooled to 16 image tokens), a 2-layer text model."""
    import torch
    from tests.support.tiny_processors import hub_siglip_names
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(
        GEMMA_SPECIALS,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        extra_special_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
    )
    ids = {s: tok.convert_tokens_to_ids(s) for s in GEMMA_SPECIALS}
    config = Gemma3Config(
        vision_config={
            "model_type": "siglip_vision_model",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": 112,
            "patch_size": 14,
        },
        text_config={
            **_text_config(len(tok), bos=ids["<bos>"], eos=ids["<eos>"], pad=ids["<pad>"]),
            "model_type": "gemma3_text",
            "sliding_window": 512,
            "layer_types": ["sliding_attention", "full_attention"],
        },
        mm_tokens_per_image=16,
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # the projector starts at zero: give the image path weight to matter
        for param in model.model.multi_modal_projector.parameters():
            param.normal_(0.0, 0.5)
    if vision_seed is not None and vision_seed != seed:
        torch.manual_seed(vision_seed)
        other = Gemma3ForConditionalGeneration(config).eval()
        model.model.vision_tower.load_state_dict(other.model.vision_tower.state_dict())
    model.save_pretrained(out)
    hub_siglip_names(out / "model.safetensors")
    tok.save_pretrained(out)
    (out / "processor_config.json").write_text(
        json.dumps({"processor_class": "Gemma3Processor", "image_seq_length": 16}, indent=2)
    )
    (out / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "Gemma3ImageProcessor",
                "processor_class": "Gemma3Processor",
                "size": {"height": 112, "width": 112},
                "do_resize": True,
                "resample": 2,
                "do_rescale": True,
                "rescale_factor": 1 / 255,
                "do_normalize": True,
                "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5],
                "do_convert_rgb": None,
                "do_pan_and_scan": None,
            },
            indent=2,
        )
    )
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outdir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vision-seed", type=int, default=None)
    parser.add_argument("--arch", choices=[*ARCHES, "gemma3"], default="qwen2_vl")
    args = parser.parse_args()
    if args.arch == "gemma3":
        print(build_gemma3(args.outdir, seed=args.seed, vision_seed=args.vision_seed))
    else:
        print(build(args.outdir, seed=args.seed, vision_seed=args.vision_seed, arch=args.arch))
