"""Where a cold request spends its time: decode, preprocess, queue, forward, device-to-host +
pack, index and the rest, per image, as a text bar chart.

    python bench/bench_breakdown.py [--model tiny-qwen2-vl] [--images 64] [--size 640x480]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "service"), str(ROOT / "bench")]

import _common as c

STAGES = ("decode", "preprocess", "queue", "forward", "d2h + pack", "index + rest")
#: a compiled tower's warm-up on a slow GPU host takes minutes; past this the bench gives up
WARM_UP_TIMEOUT_S = 900.0


def sample(metrics: object, name: str) -> float:
    return metrics.registry.get_sample_value(name) or 0.0  # type: ignore[attr-defined]


async def one_round(engine: object, metrics: object, images: list[bytes], ns: str, concurrency: int) -> dict:
    from visenc.engine.interface import EncodeItem

    names = ("preprocess", "queue_wait", "forward", "output")
    before = {k: sample(metrics, f"visenc_{k}_seconds_sum") for k in names}
    forwards0, encoded0 = sample(metrics, "visenc_forwards_total"), sample(metrics, "visenc_encoded_images_total")
    queue = list(images)
    walls: list[float] = []

    async def client() -> None:
        while queue:
            data = queue.pop()
            t0 = time.perf_counter()
            (h,) = await engine.encode([EncodeItem(data=data)], ns, wait=True)  # type: ignore[attr-defined]
            walls.append(time.perf_counter() - t0)
            assert h.status == "ready", h

    await asyncio.gather(*(client() for _ in range(concurrency)))
    spent = {k: sample(metrics, f"visenc_{k}_seconds_sum") - before[k] for k in names}
    forwards = sample(metrics, "visenc_forwards_total") - forwards0
    n = sample(metrics, "visenc_encoded_images_total") - encoded0
    per_batch = n / max(forwards, 1)
    return {
        "prep": spent["preprocess"] / n,
        "queue_wait": spent["queue_wait"] / n,
        "forward": spent["forward"] / forwards,  # each image waits for its whole batch
        "output": spent["output"] / forwards,
        "wall": statistics.mean(walls),
        "batch": per_batch,
    }


async def measure(args: argparse.Namespace) -> dict[str, list[float]]:
    from visenc.bootstrap import load_tower
    from visenc.config import Settings
    from visenc.engine.core import Engine
    from visenc.imaging.decode import decode
    from visenc.index.memory import MemoryCache
    from visenc.index.tiered import Index
    from visenc.metrics import Metrics

    w, h = (int(x) for x in args.size.split("x"))
    settings = Settings(model=args.model)  # device, dtype and compile as VISENC_* say, as the service does
    tower = load_tower(settings)
    metrics = Metrics()
    engine = Engine(tower, Index(MemoryCache(settings.cache_bytes or 1 << 30, metrics)), settings, metrics)
    await engine.start()
    deadline = time.monotonic() + WARM_UP_TIMEOUT_S
    while (why := engine.not_ready_reason()) is not None:  # a compiled tower warms up first
        if "warming" not in why:
            raise RuntimeError(why)
        if time.monotonic() > deadline:
            raise TimeoutError(f"not ready within {WARM_UP_TIMEOUT_S:.0f} s: {why}")
        await asyncio.sleep(0.5)
    out: dict[str, list[float]] = {s: [] for s in (*STAGES, "wall", "batch")}
    try:
        await one_round(engine, metrics, [c.jpeg(90_000 + i, w, h) for i in range(8)], "warm", args.concurrency)
        for r in range(args.rounds):
            images = [c.jpeg(1000 * r + i, w, h) for i in range(args.images)]
            t0 = time.perf_counter()
            for data in images:
                decode(data, max_pixels=1 << 30, loader=tower.image_loader)
            dec = (time.perf_counter() - t0) / len(images)
            got = await one_round(engine, metrics, images, f"round{r}", args.concurrency)
            parts = {
                "decode": dec,
                "preprocess": max(got["prep"] - dec, 0.0),
                "queue": max(got["queue_wait"] - got["prep"], 0.0),
                "forward": got["forward"],
                "d2h + pack": got["output"],
            }
            parts["index + rest"] = max(got["wall"] - sum(parts.values()), 0.0)
            for k, v in parts.items():
                out[k].append(v * 1e3)
            out["wall"].append(got["wall"] * 1e3)
            out["batch"].append(got["batch"])
    finally:
        await engine.stop()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-qwen2-vl")
    p.add_argument("--images", type=int, default=64)
    p.add_argument("--size", default="640x480")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    out = asyncio.run(measure(args))
    wall = statistics.median(out["wall"])
    print(
        f"{args.model}, {args.images} cold {args.size} JPEGs per round, {args.concurrency} concurrent clients, "
        f"{args.rounds} rounds; request wall time {c.spread(out['wall'], ' ms')}, "
        f"images per forward {statistics.median(out['batch']):.1f}"
    )
    scale = 50 / max(statistics.median(out[s]) for s in STAGES)
    for stage in STAGES:
        med = statistics.median(out[stage])
        bar = "█" * max(1, round(med * scale)) if med > 0 else ""
        print(f"  {stage:13s} {bar:50s} {c.spread(out[stage], ' ms')}  {100 * med / wall:4.0f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
