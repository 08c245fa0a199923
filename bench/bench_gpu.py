"""A Qwen2.5-VL-7B-sized vision tower on a GPU: batched vs per image, and the share of the device's
bf16 FLOP limit it reaches.

The tower is Qwen2.5-VL-7B's vision config (32 blocks, width 1280, window attention, merger to
3584) with seeded random weights in bf16: speed does not depend on the weights. Images are 720p
and 1080p (resized by the processor's rules, ``max_pixels`` 12.8 Mpx), 8 per batch. Rounds
alternate a packed forward of the 8 with 8 single-image forwards; each figure is the median over
rounds, with min and max. FLOPs per image are counted from the config
(``bench/flops.py``, checked against torch's FLOP counter in the tests), and
``images/s x FLOPs per image / peak`` is the model FLOP utilisation.

Prints "no CUDA device" and exits 0 where there is none.

    python bench/bench_gpu.py [--rounds 5] [--peak-tflops 989]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "service"), str(Path(__file__).resolve().parent)]

import _common as c  # noqa: E402

#: Qwen2.5-VL-7B-Instruct's vision_config
QWEN2_5_VL_7B_VISION = {
    "depth": 32,
    "hidden_size": 1280,
    "intermediate_size": 3420,
    "num_heads": 16,
    "out_hidden_size": 3584,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 112,
    "fullatt_block_indexes": [7, 15, 23, 31],
    "in_channels": 3,
    "hidden_act": "silu",
}
#: dense bf16 tensor-core peaks (TFLOP/s), by device name
PEAK_BF16_TFLOPS = {"B200": 2250.0, "H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0}
SIZES = {"720p": (1280, 720), "1080p": (1920, 1080)}


def peak_tflops(device_name: str) -> float | None:
    """The device's dense bf16 peak, from its name (``None`` if unknown: pass ``--peak-tflops``)."""
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in device_name:
            return value
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--peak-tflops", type=float, default=None, help="override the device's bf16 peak")
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device")
        return 0
    from flops import qwen_vision_flops
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    from visenc.imaging.decode import decode
    from visenc.models import varlen
    from visenc.models.building import build_seeded, set_attention
    from visenc.models.qwen2vl import QwenPreprocess, QwenVisionTower

    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    peak = args.peak_tflops or peak_tflops(name)
    config = Qwen2_5_VLVisionConfig(**QWEN2_5_VL_7B_VISION)
    set_attention(config)  # the tower switches CUDA forwards to its packed path (models/varlen.py)
    model = build_seeded(lambda: Qwen2_5_VisionTransformerPretrainedModel(config), 0)
    tower = QwenVisionTower(
        name="qwen2.5-vl-7b-vision",
        model=model,
        preprocess=QwenPreprocess(max_pixels=12845056),
        source={"bench": "random"},
        dtype=torch.bfloat16,
        device=device,
    )
    kernel = "flash-attn varlen" if varlen.HAS_FLASH_ATTN else "SDPA, block-diagonal mask"
    print(f"{name}, one attention call per layer ({kernel}), bf16 peak {peak} TFLOP/s, {args.rounds} rounds")

    def timed(batches: list[list]) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for batch in batches:
            tower.forward(batch)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    for label, (w, h) in SIZES.items():
        prepared = [tower.preprocess(decode(c.jpeg(i, w, h), max_pixels=1 << 30)) for i in range(args.batch)]
        flops = qwen_vision_flops(config, prepared[0].layout.grid_thw)
        packed, single = [prepared], [[x] for x in prepared]
        timed(packed), timed(single)  # warm-up: kernels, allocator
        rates: dict[str, list[float]] = {"batched": [], "per-image": []}
        for r in range(args.rounds):
            for way, batches in (("batched", packed), ("per-image", single))[:: 1 if r % 2 == 0 else -1]:
                rates[way].append(args.batch / timed(batches))
        ratios = [b / s for b, s in zip(rates["batched"], rates["per-image"])]
        line = f"  {label} grid {prepared[0].layout.grid_thw}, {flops / 1e12:.2f} TFLOP/image: "
        line += ", ".join(f"{k} {statistics.median(v):.2f} img/s" for k, v in rates.items())
        line += f"; batched / per-image {c.spread(ratios)}"
        if peak:
            mfu = [x * flops / (peak * 1e12) for x in rates["batched"]]
            line += f"; batched MFU {c.spread(mfu, unit='')}"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
