"""Batched forward vs a per-image loop, 8 images, same resolution and mixed, every built-in tower.

python bench/bench_batching.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "service"), str(Path(__file__).resolve().parent)]

import _common as c

SAME = [(640, 480)] * 8
MIXED = [(640, 480), (448, 448), (800, 600), (336, 560), (1024, 576), (512, 512), (600, 400), (720, 720)]


def engine_batches(tower: Any, prepared: list[Any]) -> list[list[Any]]:
    """The images cut into batches as the engine's plan would: per bucket where the tower cannot pack
    buckets together, each batch under the token cap."""
    from visenc.engine.budget import plan_budget

    cap = plan_budget(tower, 1 << 34, max_batch_tokens=16384).max_batch_tokens
    groups: dict[Any, list[Any]] = {}
    for pr in prepared:
        groups.setdefault(None if tower.packable else pr.layout.bucket, []).append(pr)
    batches: list[list[Any]] = []
    for group in groups.values():
        batches.append([])
        tokens = 0
        for pr in group:
            cost = tower.input_tokens(pr.layout)
            if batches[-1] and tokens + cost > cap:
                batches.append([])
                tokens = 0
            batches[-1].append(pr)
            tokens += cost
    return batches


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--towers", default="tiny-qwen2-vl,tiny-qwen2.5-vl,tiny-clip,tiny-siglip")
    args = p.parse_args()
    import torch

    from visenc.engine.threads import default_torch_threads
    from visenc.imaging.decode import decode
    from visenc.models.loading import load_tower

    torch.set_num_threads(default_torch_threads(torch.device("cpu")))
    print(f"8 images per batch, forward only, torch threads {torch.get_num_threads()}, {args.rounds} rounds")
    for name in args.towers.split(","):
        tower = load_tower(name)
        for label, sizes in (("same", SAME), ("mixed", MIXED)):
            prepared = [tower.preprocess(decode(c.jpeg(i, w, h), max_pixels=1 << 30)) for i, (w, h) in enumerate(sizes)]
            tower.forward(prepared[:2])  # warm-up
            batches = engine_batches(tower, prepared)
            ways: dict[str, tuple[Any, list[list[Any]]]] = {
                "loop": (tower.forward, [[pr] for pr in prepared]),
                "batched": (tower.forward, batches),
            }
            if hasattr(tower, "_forward_packed"):
                ways["packed"] = (tower._forward_packed, batches)
            times: dict[str, list[float]] = {k: [] for k in ways}
            for r in range(args.rounds):
                for way in list(ways)[:: 1 if r % 2 == 0 else -1]:
                    run, calls = ways[way]
                    t0 = time.perf_counter()
                    for chunk in calls:
                        run(chunk)
                    times[way].append(time.perf_counter() - t0)
            rate = 8 / statistics.median(times["batched"])
            line = f"  {name:16s} {label:5s}: {len(batches)} forward(s), batched {rate:6.1f} img/s"
            for way in ways:
                if way != "loop":
                    ratios = [lp / t for lp, t in zip(times["loop"], times[way])]
                    line += f", {way} / per-image {c.spread(ratios)}"
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
