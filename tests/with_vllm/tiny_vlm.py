"""A tiny random Qwen2-VL checkpoint that transformers and vLLM both load offline.

    python tests/with_vllm/tiny_vlm.py OUTDIR [--seed N] [--vision-seed N]

config.json + model.safetensors (fp32, seeded), a byte-level tokenizer (256 byte tokens + Qwen's
special tokens, no merges: nothing to download), a chat template, and a preprocessor config with
a small pixel range (at most 256 image tokens per image). ``--vision-seed`` redraws only the
vision tower: a copy whose own image path is wrong, to prove that embeddings come from elsewhere.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MIN_PIXELS, MAX_PIXELS = 56 * 56, 448 * 448
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
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", model_max_length=4096
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build(outdir: str | Path, *, seed: int = 0, vision_seed: int | None = None) -> Path:
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer()
    ids = {s: tok.convert_tokens_to_ids(s) for s in SPECIALS}
    config = Qwen2VLConfig(
        vision_config={
            "depth": 2,
            "embed_dim": 64,
            "num_heads": 2,
            "hidden_size": 128,
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
        },
        text_config={
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "vocab_size": len(tok),
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
            "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12], "rope_theta": 1000000.0},
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).eval()
    if vision_seed is not None and vision_seed != seed:
        torch.manual_seed(vision_seed)
        other = Qwen2VLForConditionalGeneration(config).eval()
        model.model.visual.load_state_dict(other.model.visual.state_dict())
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (out / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "Qwen2VLImageProcessor",
                "processor_class": "Qwen2VLProcessor",
                "do_convert_rgb": True,
                "do_resize": True,
                "resample": 3,
                "do_rescale": True,
                "rescale_factor": 1 / 255,
                "do_normalize": True,
                "image_mean": [0.48145466, 0.4578275, 0.40821073],
                "image_std": [0.26862954, 0.26130258, 0.27577711],
                "min_pixels": MIN_PIXELS,
                "max_pixels": MAX_PIXELS,
                "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
                "patch_size": 14,
                "temporal_patch_size": 2,
                "merge_size": 2,
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
    args = parser.parse_args()
    print(build(args.outdir, seed=args.seed, vision_seed=args.vision_seed))
