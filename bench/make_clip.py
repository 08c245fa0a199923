"""Write a CLIP model folder of a chosen vision size with seeded random weights, for
side-by-side runs of visenc and a peer on a model bigger than the tiny one.

    python bench/make_clip.py /tmp/infinity/clip-b16 --like /tmp/infinity/tiny-clip   # ViT-B/16 sizes
    python bench/bench_service.py --model /tmp/infinity/clip-b16 --infinity /tmp/infinity
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

#: the vision sizes of OpenAI's ViT-B/16 CLIP (``openai/clip-vit-base-patch16``)
BASE = {"hidden": 768, "mlp": 3072, "layers": 12, "heads": 12, "patch": 16, "projection": 512}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--like", type=Path, required=True, help="a CLIP folder to take the processor and tokenizer from")
    for name, default in BASE.items():
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    import torch
    from transformers import CLIPConfig, CLIPModel

    config = CLIPConfig.from_pretrained(args.like)
    vision = config.vision_config
    vision.hidden_size, vision.intermediate_size = args.hidden, args.mlp
    vision.num_hidden_layers, vision.num_attention_heads, vision.patch_size = args.layers, args.heads, args.patch
    config.projection_dim = vision.projection_dim = args.projection
    torch.manual_seed(args.seed)
    model = CLIPModel(config).eval()
    args.out.mkdir(parents=True, exist_ok=True)
    for f in args.like.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith((".safetensors", ".bin")):
            shutil.copy2(f, args.out / f.name)
    model.save_pretrained(args.out)
    params = sum(p.numel() for p in model.vision_model.parameters()) / 1e6
    print(f"wrote {args.out}: vision tower {params:.1f}M parameters, {vision.image_size}px / {args.patch}")


if __name__ == "__main__":
    main()
