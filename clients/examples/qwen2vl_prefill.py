"""A reference prefill worker: Qwen2-VL chunked prefill, its vision tower replaced by image rows from visenc.
The logits equal the full model's single forward (tests/prefill). Run it against a server::

    python clients/examples/qwen2vl_prefill.py save-tiny /tmp/tiny-vlm
    visenc serve --model /tmp/tiny-vlm --image-backend pil --port 8001 &
    python clients/examples/qwen2vl_prefill.py run --model /tmp/tiny-vlm --url http://127.0.0.1:8001 --chunk 16 --check

``--check`` builds the full model's pixels with the processor of the backend the service reports (the
torchvision one needs torchvision) and exits 1 where the logits differ by more than ``--tolerance``.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import io
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from safetensors import safe_open
from transformers import DynamicCache, Qwen2VLConfig, Qwen2VLForConditionalGeneration
from transformers.initialization import no_init_weights
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from visenc_client import Client
from visenc_client.prefill import PromptLayout, VisencPrefill

#: token ids of the tiny model's specials (a 512-token vocabulary; Qwen2-VL's real ids are 151652-151656)
IMAGE_TOKEN_ID = 500
VIDEO_TOKEN_ID = 501
VISION_START_TOKEN_ID = 502
VISION_END_TOKEN_ID = 503
VOCAB_SIZE = 512


def tiny_vlm_config(vision_config: dict[str, Any]) -> Qwen2VLConfig:
    """A Qwen2-VL config with a tiny text model (hidden 256 = the merger's output width) around ``vision_config``."""
    config = Qwen2VLConfig(
        vision_config=vision_config,
        text_config={
            "vocab_size": VOCAB_SIZE,
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]},
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=VIDEO_TOKEN_ID,
        vision_start_token_id=VISION_START_TOKEN_ID,
        vision_end_token_id=VISION_END_TOKEN_ID,
    )
    config._attn_implementation = "sdpa"
    return config


def build_tiny_vlm(vision_config: dict[str, Any], seed: int) -> Qwen2VLForConditionalGeneration:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(tiny_vlm_config(vision_config))
    return model.eval()


def save_tiny_vlm(
    model: Qwen2VLForConditionalGeneration, path: Path, processor_kwargs: dict[str, Any] | None = None
) -> None:
    """``save_pretrained`` plus the ``preprocessor_config.json`` visenc reads its resize settings from."""
    model.save_pretrained(path)
    Qwen2VLImageProcessorPil(**(processor_kwargs or {})).save_pretrained(path)


class NoVisionTower(torch.nn.Module):
    """Stands in for ``model.visual``: no weights, never runs."""

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("this prefill worker has no vision tower: image embeddings come from visenc")


def _language_model_names(names: Sequence[str]) -> dict[str, str]:
    out = {}
    for name in names:
        if name.startswith(("visual.", "model.visual.")):
            continue
        if name.startswith("model.language_model.") or name.startswith("lm_head."):
            out[name] = name
        elif name.startswith("model."):
            out[name] = "model.language_model." + name.removeprefix("model.")
        else:
            raise ValueError(f"unexpected tensor {name!r} in a Qwen2-VL checkpoint")
    return out


def load_language_model(path: Path) -> Qwen2VLForConditionalGeneration:
    """The language model of a Qwen2-VL checkpoint, loaded ``strict``; no vision weight is read."""
    config = Qwen2VLConfig.from_pretrained(path)
    config._attn_implementation = "sdpa"
    with no_init_weights():
        model = Qwen2VLForConditionalGeneration(config)
    model.model.visual = NoVisionTower()
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    else:
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            weight_map = {name: "model.safetensors" for name in f.keys()}
    renames = _language_model_names(list(weight_map))
    state: dict[str, torch.Tensor] = {}
    for filename in sorted({weight_map[n] for n in renames}):
        with safe_open(str(path / filename), framework="pt") as f:
            for name in (n for n in renames if weight_map[n] == filename):
                state[renames[name]] = f.get_tensor(name)
    if config.tie_word_embeddings and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.language_model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    return model.eval()


def rope_positions(model: Qwen2VLForConditionalGeneration, layout: PromptLayout) -> torch.Tensor:
    """``[3, 1, L]`` M-RoPE position ids of the whole prompt, from its token ids and the handles' grids."""
    input_ids = torch.from_numpy(layout.input_ids)[None]
    grid = torch.tensor(layout.image_grid_thw, dtype=torch.long) if layout.placements else None
    mm_token_type_ids = (input_ids == layout.image_token_id).to(torch.int)
    positions, _ = model.model.get_rope_index(input_ids, mm_token_type_ids, image_grid_thw=grid)
    return positions


def chunked_prefill(
    model: Qwen2VLForConditionalGeneration, prefill: VisencPrefill, layout: PromptLayout, chunk_size: int
) -> torch.Tensor:
    """Prefill the prompt ``chunk_size`` positions at a time; returns the ``[L, vocab]`` logits (fp32 on CPU)."""
    if chunk_size < 1:
        raise ValueError("chunk_size must be >= 1")
    positions = rope_positions(model, layout)
    input_ids = torch.from_numpy(layout.input_ids)[None]
    embed = model.get_input_embeddings()
    cache = DynamicCache(config=model.config)
    # transformers 5.x renames the forward's ``past_key_values`` to ``cache`` (the old name warns)
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    logits = []
    with torch.inference_mode():
        for start in range(0, layout.num_positions, chunk_size):
            end = min(start + chunk_size, layout.num_positions)
            inputs_embeds = embed(input_ids[:, start:end])
            prefill.fill_chunk(layout, start, end, inputs_embeds[0])
            out = model(
                inputs_embeds=inputs_embeds,
                position_ids=positions[:, :, start:end],
                use_cache=True,
                **{cache_arg: cache},
            )
            logits.append(out.logits[0].float())
    return torch.cat(logits)


def demo_prompt(images: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    ids: list[int] = []
    for _ in range(images):
        ids += rng.integers(3, 400, int(rng.integers(3, 9))).tolist()
        ids += [VISION_START_TOKEN_ID, IMAGE_TOKEN_ID, VISION_END_TOKEN_ID]
    return ids + rng.integers(3, 400, 6).tolist()


def demo_images(seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    out = []
    for width, height in ((64, 96), (224, 140), (150, 300)):
        pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels, "RGB").save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def wait_ready(url: str, timeout_s: float = 600.0) -> None:
    """Until the service answers ``/readyz`` (it loads the model first); ``SystemExit`` past ``timeout_s``."""
    import httpx

    deadline, said = time.monotonic() + timeout_s, False
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if not said:
            print(f"waiting for visenc at {url} to be ready ...", file=sys.stderr)
            said = True
        time.sleep(0.5)
    raise SystemExit(f"visenc at {url} was not ready within {timeout_s:.0f} s")


def reference_processor(model: Path, backend: str) -> Any:
    """The transformers processor of the backend the service reproduces; ``SystemExit`` (one line) where it
    cannot be had here: without torchvision transformers would quietly fall back to its PIL processor."""
    if backend == "pil":
        return Qwen2VLImageProcessorPil.from_pretrained(model)
    if backend != "torchvision":
        raise SystemExit(f"--check: no reference for the service's image backend {backend!r}")
    if importlib.util.find_spec("torchvision") is None:
        raise SystemExit(
            "--check: the service preprocesses as transformers' torchvision processor does, which needs the "
            "package torchvision, not installed here (docs/integration-prefill.md): install it, or serve with "
            "--image-backend pil"
        )
    from transformers import Qwen2VLImageProcessor

    return Qwen2VLImageProcessor.from_pretrained(model)


def full_model_logits(model: Path, processor: Any, layout: PromptLayout, images: list[bytes]) -> torch.Tensor:
    """The full model's own forward (its vision tower included) over the same prompt and images."""
    full = Qwen2VLForConditionalGeneration.from_pretrained(model).eval()
    pixels = processor(images=[Image.open(io.BytesIO(b)) for b in images], return_tensors="pt")
    input_ids = torch.from_numpy(layout.input_ids)[None]
    with torch.inference_mode():
        return full(
            input_ids=input_ids,
            pixel_values=pixels["pixel_values"],
            image_grid_thw=pixels["image_grid_thw"],
            mm_token_type_ids=(input_ids == IMAGE_TOKEN_ID).int(),
        ).logits[0]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    save = sub.add_parser("save-tiny", help="save a tiny Qwen2-VL (random weights) for `visenc serve --model`")
    save.add_argument("path", type=Path)
    save.add_argument("--seed", type=int, default=0)
    run = sub.add_parser("run", help="chunked prefill of a 3-image prompt with embeddings from visenc")
    run.add_argument("--model", type=Path, required=True, help="the folder visenc serves with --model")
    run.add_argument("--url", default="http://127.0.0.1:8000")
    run.add_argument("--chunk", type=int, default=32)
    run.add_argument("--check", action="store_true", help="compare with the full model's own forward")
    run.add_argument("--tolerance", type=float, default=1e-4, help="--check: the largest |difference| accepted")
    return parser


def _main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "save-tiny":
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig

        vision = Qwen2VLVisionConfig(depth=4, embed_dim=128, hidden_size=256, num_heads=4).to_dict()
        save_tiny_vlm(build_tiny_vlm(vision, args.seed), args.path)
        print(f"saved to {args.path}")
        return 0
    wait_ready(args.url)
    images = demo_images()
    with Client(args.url) as client:
        info = client.model()
        if Path(str(info.get("name"))).resolve() != args.model.resolve():
            raise SystemExit(
                f"visenc at {args.url} serves {info.get('name')!r}, not {str(args.model)!r}: "
                f"start `visenc serve --model {args.model}` (on another port: --url)"
            )
        processor = reference_processor(args.model, info.get("image_backend", "")) if args.check else None
        model = load_language_model(args.model)
        prefill = VisencPrefill(
            client, image_token_id=IMAGE_TOKEN_ID, merge_size=model.config.vision_config.spatial_merge_size
        )
        layout = prefill.prepare(demo_prompt(len(images)), images)
        logits = chunked_prefill(model, prefill, layout, args.chunk)
    print(f"prompt {layout.num_positions} positions, images at {[(p.offset, p.num_tokens) for p in layout.placements]}")
    print(f"next token: {int(logits[-1].argmax())}")
    if processor is not None:
        diff = float((logits - full_model_logits(args.model, processor, layout, images)).abs().max())
        print(f"max |logits - full model's| = {diff:.3g} (bound {args.tolerance:g})")
        if not diff <= args.tolerance:
            print(
                f"--check failed: {diff:.3g} > {args.tolerance:g}: the rows are not the full model's", file=sys.stderr
            )
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main())
