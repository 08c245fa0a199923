"""Time to first chunk: a 32-image request, lazy per-chunk fetch vs waiting for the whole request.

python bench/bench_ttfc.py [--rounds 3] [--chunk 512] [--text 16] [--serve-args '...']
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "service"), str(ROOT / "clients"), str(ROOT / "bench")]

import _common as c
import httpx
from harness.images import png_bytes
from harness.processes import serve_process

from visenc_client import Client, ImagePlacement

#: mixed resolutions (width, height): 64 .. ~390 tokens each on the tiny Qwen tower
SIZES = [(224, 224), (448, 336), (320, 480), (640, 480), (256, 256), (512, 384), (300, 200), (480, 640)]
N_IMAGES = 32


def images(round_no: int, kind: int) -> list[bytes]:
    """32 images nobody has sent before (seeds unique per round and client kind)."""
    base = 10_000 + 1_000 * round_no + 100 * kind
    return [png_bytes(base + i, *SIZES[i % len(SIZES)]) for i in range(N_IMAGES)]


def layout(handles, text: int) -> list[ImagePlacement]:
    placements, at = [], 0
    for h in handles:
        at += text
        placements.append(ImagePlacement.of(h, at))
        at += h.num_tokens
    return placements


def forwards(url: str) -> int:
    m = re.search(r"^visenc_forwards_total (\S+)$", httpx.get(f"{url}/metrics").text, re.M)
    return int(float(m.group(1))) if m else 0


def prefill(vc: Client, datas: list[bytes], *, lazy: bool, chunk: int, text: int) -> tuple[float, float, int, int]:
    """(s to chunk 1's rows, s to the last chunk's rows, images chunk 1 overlaps, image tokens)."""
    t0 = time.perf_counter()
    handles = vc.encode(datas, wait=not lazy)
    placements = layout(handles, text)
    total = placements[-1].end
    first = 0.0
    for start in range(0, total, chunk):
        vc.fetch_chunk(placements, start, min(total, start + chunk))
        if start == 0:
            first = time.perf_counter() - t0
    overlapping = sum(1 for p in placements if p.offset < chunk)
    return first, time.perf_counter() - t0, overlapping, sum(p.num_tokens for p in placements)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk, prompt positions")
    ap.add_argument("--text", type=int, default=16, help="text tokens before each image")
    ap.add_argument("--serve-args", default="", help="extra `visenc serve` flags, e.g. '--prefetch-tokens 2048'")
    args = ap.parse_args()

    results: dict[str, list[tuple[float, float]]] = {"lazy": [], "naive": []}
    batches: dict[str, list[int]] = {"lazy": [], "naive": []}
    alone: list[float] = []
    with serve_process(*args.serve_args.split()) as url, Client(url) as vc:
        vc.encode([png_bytes(9_999, 224, 224)])  # warm the tower and the connection
        for r in range(args.rounds):
            order = ["lazy", "naive"] if r % 2 == 0 else ["naive", "lazy"]
            for kind in order:
                before = forwards(url)
                first, every, k, tokens = prefill(
                    vc, images(r, kind == "naive"), lazy=kind == "lazy", chunk=args.chunk, text=args.text
                )
                results[kind].append((first, every))
                batches[kind].append(forwards(url) - before)
            solo = images(r, 2)[:k]  # only chunk 1's images, new copies (made before the clock starts)
            t0 = time.perf_counter()
            vc.encode(solo)
            alone.append(time.perf_counter() - t0)

    print(
        f"32 new images (~{tokens} image tokens), chunk {args.chunk} positions, chunk 1 overlaps {k} images; "
        f"median of {args.rounds} rounds"
    )
    print(f"{'client':8} {'chunk 1 (s)':>12} {'all 32 (s)':>11} {'forwards':>9}  first / all, per round")
    for kind in ("lazy", "naive"):
        first = statistics.median(f for f, _ in results[kind])
        every = statistics.median(a for _, a in results[kind])
        ratios = [f / a for f, a in results[kind]]
        print(f"{kind:8} {first:12.3f} {every:11.3f} {statistics.median(batches[kind]):9.0f}  {c.spread(ratios, '')}")
    lazy_first = statistics.median(f for f, _ in results["lazy"])
    print(
        f"encoding chunk 1's {k} images alone: {statistics.median(alone):.3f} s "
        f"(lazy chunk 1 / that = {lazy_first / statistics.median(alone):.2f})"
    )
    # the floor of first / all: chunk 1 can be no faster than encoding the images it overlaps
    floor = [a / every for a, (_, every) in zip(alone, results["lazy"])]
    print(f"floor of first / all (chunk 1's images alone / lazy all 32): {c.spread(floor, '')}")


if __name__ == "__main__":
    main()
