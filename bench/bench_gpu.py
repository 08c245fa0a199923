"""A Qwen2.5-VL-7B-sized vision tower on a GPU: transformers' own path, visenc eager and visenc
compiled, side by side, with the share of the device's bf16 FLOP limit each reaches.

    python bench/bench_gpu.py [--rounds 5] [--peak-tflops 989] [--profile] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "service"), str(Path(__file__).resolve().parent)]

import _common as c

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
#: a few blocks of the same shape: what ``--tower tiny`` runs (a smoke test of the bench itself)
TINY_VISION = {**QWEN2_5_VL_7B_VISION, "depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2}
TINY_VISION["fullatt_block_indexes"] = [1]
#: dense bf16 tensor-core peaks (TFLOP/s), by device name
PEAK_BF16_TFLOPS = {"B200": 2250.0, "H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0}
SCENARIOS: dict[str, list[tuple[int, int]]] = {
    "720p x8": [(1280, 720)] * 8,
    "1080p x1": [(1920, 1080)],
    "1080p x4": [(1920, 1080)] * 4,
    "mixed x6": [(1280, 720), (1920, 1080), (2560, 1440), (1366, 768), (800, 600), (1440, 900)],
}
PATHS = ("transformers", "visenc eager", "visenc compiled", "compiled per-image")


def peak_tflops(device_name: str) -> float | None:
    """The device's dense bf16 peak, from its name (``None`` if unknown: pass ``--peak-tflops``)."""
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in device_name:
            return value
    return None


def build_towers(vision: dict[str, Any], device: Any, dtype: Any) -> dict[str, Any]:
    """The three towers of the paths, with the same seeded weights."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    from visenc.models.construct import build_seeded, set_attention
    from visenc.models.qwen2vl import QwenPreprocess, QwenVisionTower

    def tower() -> Any:
        config = Qwen2_5_VLVisionConfig(**vision)
        set_attention(config)
        model = build_seeded(lambda: Qwen2_5_VisionTransformerPretrainedModel(config), 0)
        settings = QwenPreprocess(max_pixels=12845056)
        return QwenVisionTower(
            name="qwen2.5-vl-7b-vision", model=model, preprocess=settings, source={}, dtype=dtype, device=device
        )

    from visenc.models import compiled

    own, eager, fast = tower(), tower(), tower()
    own.use_varlen(False)
    missing = compiled.toolchain_problem(device)
    fast.compile()
    t0 = time.perf_counter()
    with compiled.backend_failures() as failures:
        fast.warm_up()
    print(f"compiled tower warmed up in {time.perf_counter() - t0:.1f} s ({compiled.graphs()} graphs)")
    if missing or failures:  # the "compiled" path would then be eager: its figures would not be the compiled ones
        print(f"COMPILE DID NOT WORK: {missing or ''} {failures[:1]}")
    return {"transformers": own, "visenc eager": eager, "visenc compiled": fast, "compiled per-image": fast}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--peak-tflops", type=float, default=None, help="override the device's bf16 peak")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (with --tower tiny: a smoke run)")
    p.add_argument("--tower", choices=["7b", "tiny"], default="7b")
    p.add_argument("--scenarios", nargs="*", default=list(SCENARIOS), choices=list(SCENARIOS))
    p.add_argument("--profile", action="store_true", help="print the top kernels of compiled 1080p x1")
    p.add_argument("--json", action="store_true", help="also print one JSON line of every figure")
    return p.parse_args()


class Runner:
    """Forwards a batch on each path's tower, synchronised with the device."""

    def __init__(self, towers: dict[str, Any], device: Any) -> None:
        self.towers, self.device, self.cuda = towers, device, device.type == "cuda"

    def sync(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize(self.device)

    def run(self, path: str, batch: list[Any]) -> None:
        tower = self.towers[path]
        for part in [[x] for x in batch] if path == "compiled per-image" else [batch]:
            tower.forward(part)
        self.sync()

    def timed(self, path: str, batch: list[Any]) -> float:
        self.sync()
        t0 = time.perf_counter()
        self.run(path, batch)
        return len(batch) / (time.perf_counter() - t0)

    def peak_bytes(self, path: str, batch: list[Any]) -> float | None:
        import torch

        if not self.cuda:
            return None
        self.sync()
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        self.run(path, batch)
        return float(torch.cuda.max_memory_allocated(self.device) - base)


def scenario(label: str, rounds: int, runner: Runner, config: Any, peak: float | None) -> dict[str, Any]:
    """Every path's rate, MFU and peak memory on ``label``'s images, printed; and their ratios."""
    from flops import qwen_vision_flops

    from visenc.imaging.decode import decode

    sizes = SCENARIOS[label]
    prepared = [
        runner.towers["visenc eager"].preprocess(decode(c.jpeg(i, w, h), max_pixels=1 << 30))
        for i, (w, h) in enumerate(sizes)
    ]
    flops = sum(qwen_vision_flops(config, x.layout.grid_thw) for x in prepared) / len(prepared)
    for path in PATHS:
        runner.run(path, prepared)  # warm-up: kernels, allocator, the compiled graphs' shapes
    memory = {path: runner.peak_bytes(path, prepared) for path in PATHS}
    rates: dict[str, list[float]] = {path: [] for path in PATHS}
    for r in range(rounds):
        for path in PATHS if r % 2 == 0 else reversed(PATHS):
            rates[path].append(runner.timed(path, prepared))
    print(f"  {label}: grids {sorted({x.layout.grid_thw for x in prepared})}, {flops / 1e12:.3f} TFLOP/image")
    figures: dict[str, Any] = {}
    for path in PATHS:
        rate = statistics.median(rates[path])
        mfu = rate * flops / (peak * 1e12) if peak else None
        gib = None if memory[path] is None else memory[path] / 2**30
        figures[path] = {"img_s": rate, "mfu": mfu, "peak_gib": gib}
        line = f"    {path:<20} {rate:8.2f} img/s"
        line += f"  MFU {mfu:.3f}" if mfu is not None else ""
        line += f"  peak {gib:.2f} GiB" if gib is not None else ""
        print(line)
    ratios = {
        "compiled / transformers": [a / b for a, b in zip(rates["visenc compiled"], rates["transformers"])],
        "eager / transformers": [a / b for a, b in zip(rates["visenc eager"], rates["transformers"])],
        "compiled / eager": [a / b for a, b in zip(rates["visenc compiled"], rates["visenc eager"])],
        "batched / per-image (compiled)": [
            a / b for a, b in zip(rates["visenc compiled"], rates["compiled per-image"])
        ],
    }
    for what, values in ratios.items():
        print(f"    {what}: {c.spread(values)}")
    return {"paths": figures, "ratios": {k: statistics.median(v) for k, v in ratios.items()}}


def main() -> int:
    args = parse_args()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device")
        return 0
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig

    from visenc.imaging.decode import decode
    from visenc.models import varlen

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    vision = QWEN2_5_VL_7B_VISION if args.tower == "7b" else TINY_VISION
    config = Qwen2_5_VLVisionConfig(**vision)
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    peak = args.peak_tflops or peak_tflops(name)
    towers = build_towers(vision, device, dtype)
    head_dim = config.hidden_size // config.num_heads
    kernel = varlen.kernel_for(varlen.device_key(device), dtype, head_dim)
    print(f"{name}, {dtype}, packed attention: {kernel}, bf16 peak {peak} TFLOP/s, {args.rounds} rounds")
    runner = Runner(towers, device)
    report: dict[str, Any] = {"device": name, "kernel": kernel, "rounds": args.rounds, "scenarios": {}}
    for label in args.scenarios:
        report["scenarios"][label] = scenario(label, args.rounds, runner, config, peak)
    if args.profile:
        profile(
            towers["visenc compiled"],
            [towers["visenc eager"].preprocess(decode(c.jpeg(0, 1920, 1080), max_pixels=1 << 30))],
        )
    if args.json:
        print(json.dumps(report))
    return 0


def profile(tower: Any, batch: list[Any]) -> None:
    """The kernels of one forward, by total time (what to cut next): CUDA kernels on a GPU, operators
    on a CPU (a smoke run)."""
    import torch
    from torch.profiler import ProfilerActivity

    cuda = tower.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    tower.forward(batch)
    sync()
    with torch.profiler.profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        tower.forward(batch)
        sync()
    print(prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=15))


if __name__ == "__main__":
    raise SystemExit(main())
