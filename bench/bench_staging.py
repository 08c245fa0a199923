"""The staging bound on CUDA, two batches (before) against two batches plus one per preprocessing
worker (now): how many 720p-1440p screenshots each lets the pool make at once, and ``visenc serve``'s
cold images/s under each, side by side in one run.

    python bench/bench_staging.py [--device cuda] [--tower 7b] [--images 96] [--rounds 3] [--clients 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "service"), str(Path(__file__).resolve().parent)]

import _common as c
import bench_gpu
from bench_gpu_service import SCREENS

#: one narrow block, windowed attention only, the real 3584-wide rows: a forward that costs little
CHEAP_VISION = {**bench_gpu.TINY_VISION, "depth": 1, "fullatt_block_indexes": [], "hidden_size": 16}
CHEAP_VISION.update(intermediate_size=32, num_heads=1)


def gate_table(prep: Any, workers: int, bounds: dict[str, int]) -> None:
    """Per screen size: cost, staged line, preprocess time and admissions under each bound; then each
    bound's preprocessing ceiling by Little's law on the staging ledger, and the pool's."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as one worker of the pool makes it
    print("  screen     input tokens  staged line  ms (1 thread)  made at once: " + "  ".join(bounds))
    lines, secs = [], []
    for i, (w, h) in enumerate(SCREENS):
        data = c.jpeg(i, w, h)
        _, shot = prep.inspect(data, None)
        assert not isinstance(shot, Exception)
        line = shot.cost + shot.decode_cost
        t0 = time.perf_counter()
        for _ in range(3):
            prep.preprocess(data)
        lines.append(line)
        secs.append((time.perf_counter() - t0) / 3)
        at_once = "  ".join(f"{min(workers, max(1, b // line)):>{len(k)}d}" for k, b in bounds.items())
        print(f"  {w}x{h:<5}  {shot.cost:12d}  {line:11d}  {1e3 * secs[-1]:13.0f}  {'':13s} {at_once}")
    torch.set_num_threads(threads)
    token_s = statistics.mean(x * t for x, t in zip(lines, secs))
    pool = workers / statistics.mean(secs)
    for name, b in bounds.items():
        print(
            f"  preprocessing ceiling, {name}: {min(max(b, max(lines)) / token_s, pool):.1f} img/s ({workers} workers)"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--tower", choices=["7b", "cheap"], default="cheap")
    p.add_argument("--images", type=int, default=24)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--checkpoint", type=Path, default=Path("/tmp/visenc-bench-qwen2.5-vl"))
    args = p.parse_args()
    import torch

    from visenc.config import Settings

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device")
        return 0
    vision = bench_gpu.QWEN2_5_VL_7B_VISION if args.tower == "7b" else CHEAP_VISION
    path = c.write_qwen25_checkpoint(args.checkpoint.with_name(f"{args.checkpoint.name}-{args.tower}"), vision)
    tokens = Settings().max_batch_tokens
    workers = len(os.sched_getaffinity(0))
    old, new = 2 * tokens, (2 + workers) * tokens  # new: the plan's default, unless host memory caps it
    print(f"staging bound: before {old} tokens (two batches), now {new} (two plus one per worker)")
    from visenc.engine.prepare import ImagePrep
    from visenc.models.loading import load_tower

    tower = load_tower(str(path), device="cpu", dtype="bfloat16")  # its processor: the costs charged
    prep = ImagePrep(tower, max_image_bytes=1 << 30, max_image_pixels=1 << 30)
    gate_table(prep, workers, {"before": old, "now": new})
    sixteen = {"before": old, "now": (2 + 16) * tokens}
    print("the same on 16 cores (as the GPU host of bench/RESULTS.md round 16), this host's core speed:")
    gate_table(prep, 16, sixteen)
    del tower, prep
    flags = ["--device", args.device, "--dtype", "bfloat16", "--compile", "on" if args.device == "cuda" else "off"]
    before = {"VISENC_PREFETCH_TOKENS": str(old)}
    now = {} if args.device == "cuda" else {"VISENC_PREFETCH_TOKENS": str(new)}
    images = [c.jpeg(100 + i, *SCREENS[i % len(SCREENS)]) for i in range(args.images)]
    rates = c.serve_rates(str(path), [(before, flags), (now, flags)], images, args.rounds, args.clients, inline=False)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"{name}, tower {args.tower}, {args.images} screenshots 720p-1440p, {args.clients} clients, {workers} cores")
    print(f"  two batches staged:         {c.spread(rates[0], ' img/s')}")
    print(f"  plus one batch per worker:  {c.spread(rates[1], ' img/s')}")
    print(f"  now / before: {c.spread([b / a for a, b in zip(*rates)])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
