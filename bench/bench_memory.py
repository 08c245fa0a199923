"""Peak memory of one request carrying many large images, against the memory budget.

python bench/bench_memory.py                                # 64 x 1920x1080, tiny Qwen2-VL, 512 MiB
python bench/bench_memory.py --max-pixels 100352 --json     # quick variant (the test uses it)
python bench/bench_memory.py --queued --images 1000 --width 640 --height 480 --bumps 200
python bench/bench_memory.py --decode --model tiny-clip
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import io
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "service"), str(ROOT / "bench")]

from _common import jpeg

MiB = 1 << 20


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux ``clear_refs`` 5); False if not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


async def queued_with_bumps(encoder: object, images: list[bytes], bumps: int) -> list[object]:
    """Queue every image (``wait=false``, 100 per request), fetch ``bumps`` from the back of the
    queue while the others wait, then wait for all; returns the final handles."""
    from visenc.engine.interface import EncodeItem

    handles = []
    for i in range(0, len(images), 100):
        handles += await encoder.encode([EncodeItem(data=b) for b in images[i : i + 100]], "bench", wait=False)
    picked = [h.hash for h in handles[::-1][:bumps]]
    await asyncio.gather(*(encoder.lookup(h, "bench") for h in picked))
    await asyncio.gather(*(encoder.lookup(h.hash, "bench") for h in handles))
    return await encoder.encode([EncodeItem(hash=h.hash) for h in handles], "bench", wait=True)


#: image kinds for ``--decode``: (Pillow mode of the file, format, save options)
DECODE_KINDS = {
    "jpeg RGB": ("RGB", "JPEG", {}),
    "jpeg L": ("L", "JPEG", {}),
    "png RGB": ("RGB", "PNG", {}),
    "png RGBA": ("RGBA", "PNG", {}),
    "png LA": ("LA", "PNG", {}),
    "png P tRNS": ("P", "PNG", {"transparency": 0}),
    "gif P": ("P", "GIF", {}),
    "bmp RGB": ("RGB", "BMP", {}),
    "tiff RGBA": ("RGBA", "TIFF", {}),
    "webp RGB": ("RGB", "WEBP", {}),
    "webp RGBA": ("RGBA", "WEBP", {}),
}


def encoded(kind: str, width: int, height: int) -> bytes:
    """A noise picture of ``kind`` (``DECODE_KINDS``), ``width x height``."""
    import numpy as np
    from PIL import Image

    mode, fmt, options = DECODE_KINDS[kind]
    noise = np.random.default_rng(width * height).integers(0, 256, (height, width, 4), dtype=np.uint8)
    image = Image.fromarray(noise, "RGBA")
    image = image.convert("RGB").quantize(64) if mode == "P" else image.convert(mode)
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def decode_peaks(args: argparse.Namespace) -> dict[str, object]:
    """``--decode``: per kind and size, the peak bytes per source pixel of decoding and preprocessing
    one image (beyond its tower input) and the charge the header gives it."""
    import torch

    from visenc import heap
    from visenc.engine.prepare import ImagePrep
    from visenc.models.loading import load_tower

    torch.set_num_threads(args.threads)
    heap.hold_freed(1 << 30)  # as `visenc serve` sets it; given back before each measurement
    tower = load_tower(args.model, max_pixels=args.max_pixels)
    prep = ImagePrep(tower, max_image_bytes=1 << 30, max_image_pixels=1 << 30)
    prep.preprocess(jpeg(10_000, 320, 240))  # first-use allocations (thread pools, tables) before any baseline
    rows = []
    for kind in DECODE_KINDS:
        for width, height in ((args.width, args.height), (args.width * 2 // 3, args.height * 2 // 3)):
            data = encoded(kind, width, height)
            gc.collect()
            heap.trim()
            base = rss_bytes()
            reset_peak()
            prepared = prep.preprocess(data)
            pixels = width * height
            measured = (peak_bytes() - base - prepared.pixels.nbytes) / pixels
            _, inspected = prep.inspect(data, None)  # the scheduler's own charge for it, in input tokens
            charged = inspected.decode_cost * tower.input_bytes_per_token() / pixels
            row = {
                "kind": kind,
                "size": f"{width}x{height}",
                "measured": round(measured, 2),
                "charged": round(charged, 2),
            }
            rows.append(row)
            del prepared
    return {
        "model": args.model,
        "peak_reset": reset_peak(),
        "kinds": rows,
        "within_budget": all(r["measured"] <= r["charged"] for r in rows),
    }


async def start_engine(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """The engine ``visenc serve`` would build under the bench's budget, started; with its tower and metrics."""
    import torch

    from visenc import heap
    from visenc.config import Settings
    from visenc.engine.core import Engine
    from visenc.index.memory import MemoryCache
    from visenc.index.tiered import Index
    from visenc.metrics import Metrics
    from visenc.models.loading import load_tower

    torch.set_num_threads(args.threads)
    settings = Settings(
        memory_budget_bytes=args.budget_mib * MiB,
        preprocess_workers=args.workers,
        request_timeout_s=3600,
        max_items=max(512, args.images),
        max_queue_images=max(4096, 2 * args.images),
    )
    heap.hold_freed(settings.heap_keep_bytes)  # as `visenc serve` sets it
    tower = load_tower(args.model, max_pixels=args.max_pixels)
    metrics = Metrics()
    encoder = Engine(tower, Index(MemoryCache(settings.cache_bytes or 1 << 30, metrics)), settings, metrics)
    await encoder.start()
    return encoder, tower, metrics


async def measure(args: argparse.Namespace) -> dict[str, object]:
    from visenc.engine.interface import EncodeItem

    encoder, tower, metrics = await start_engine(args)
    try:
        warm = [EncodeItem(data=jpeg(10_000, 320, 240))]
        await encoder.encode(warm, "warm", wait=True)
        images = [jpeg(i, args.width, args.height) for i in range(args.images)]
        gc.collect()
        await asyncio.sleep(0.2)
        base = rss_bytes()
        can_reset = reset_peak()
        t0 = time.perf_counter()
        if args.queued:
            handles = await queued_with_bumps(encoder, images, args.bumps)
        else:
            handles = await encoder.encode([EncodeItem(data=b) for b in images], "bench", wait=True)
        elapsed = time.perf_counter() - t0
        peak = peak_bytes()
    finally:
        await encoder.stop()
    statuses = {h.status for h in handles}
    out_bytes = sum((h.num_tokens or 0) * (h.hidden_size or 0) * 4 for h in handles)
    largest = tower.forward_bytes([tower.layout(args.width, args.height)])
    budget = args.budget_mib * MiB
    growth = peak - base
    return {
        "model": args.model,
        "images": args.images,
        "size": f"{args.width}x{args.height}",
        "grid": list(tower.layout(args.width, args.height).grid_thw),
        "statuses": sorted(statuses),
        "budget_bytes": budget,
        "batch_plan": {
            "max_batch_tokens": encoder.budget.max_batch_tokens,
            "max_batch_bytes": encoder.budget.max_batch_bytes,
            "prefetch_tokens": encoder.budget.prefetch_tokens,
        },
        "one_image_estimate_bytes": largest,
        "output_bytes": out_bytes,
        "request_bytes": sum(len(b) for b in images),
        "peak_growth_bytes": growth,
        "peak_reset": can_reset,
        "forwards": int(metrics.forwards._value.get()),
        "elapsed_s": round(elapsed, 2),
        "within_budget": growth <= budget + out_bytes,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-qwen2-vl")
    p.add_argument("--images", type=int, default=64)
    p.add_argument("--width", type=int, default=1920)
    p.add_argument("--height", type=int, default=1080)
    p.add_argument("--budget-mib", type=int, default=512)
    p.add_argument("--max-pixels", type=int, default=None, help="Qwen resize ceiling (default: the tower's)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--workers", type=int, default=2, help="preprocessing threads")
    p.add_argument("--queued", action="store_true", help="queue with wait=false, fetch --bumps, then await all")
    p.add_argument("--bumps", type=int, default=100, help="images fetched while queued (with --queued)")
    p.add_argument("--decode", action="store_true", help="peak bytes per pixel of decoding each kind of image")
    p.add_argument("--json", action="store_true", help="print one JSON object only")
    args = p.parse_args()
    if args.decode:
        r = decode_peaks(args)
        for row in [] if args.json else r["kinds"]:
            print(f"{row['kind']:12s} {row['size']:>10s}: {row['measured']:6.2f} B/px, charged {row['charged']:6.2f}")
        print(json.dumps(r) if args.json else f"-> {'WITHIN' if r['within_budget'] else 'OVER'} the charges")
        return 0 if r["within_budget"] else 1
    r = asyncio.run(measure(args))
    if args.json:
        print(json.dumps(r))
        return 0 if r["within_budget"] else 1
    m = lambda b: f"{int(b) / MiB:.0f} MiB"  # noqa: E731
    print(
        f"{r['images']} images {r['size']} ({args.model}, grid {r['grid']}), one request, "
        f"{r['forwards']} forwards, {r['elapsed_s']} s; statuses {r['statuses']}"
    )
    print(f"  budget {m(r['budget_bytes'])}, plan {r['batch_plan']}")
    print(
        f"  peak RSS growth {m(r['peak_growth_bytes'])}  vs  budget + outputs "
        f"{m(r['budget_bytes'] + r['output_bytes'])}  (outputs {m(r['output_bytes'])}; "
        f"request bodies {m(r['request_bytes'])}, held before the baseline)"
    )
    print(
        f"  ratio peak / (budget + outputs) = "
        f"{r['peak_growth_bytes'] / (r['budget_bytes'] + r['output_bytes']):.2f}  "
        f"-> {'WITHIN' if r['within_budget'] else 'OVER'} budget"
    )
    return 0 if r["within_budget"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
