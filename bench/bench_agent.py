"""Multi-turn agent replay: forwards per turn and encode latency, turn 8 vs turn 1.

python bench/bench_agent.py [--turns 8] [--conversations 9] [--size 448x448]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "service"), str(ROOT / "clients")]

from harness.images import png_bytes
from harness.processes import serve_process

from visenc_client import Client


def counter(url: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", httpx.get(f"{url}/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--conversations", type=int, default=9)
    ap.add_argument("--size", default="448x448", help="WxH of every screenshot")
    args = ap.parse_args()
    width, height = (int(x) for x in args.size.split("x"))

    latency: list[list[float]] = [[] for _ in range(args.turns)]
    forwards: list[list[int]] = [[] for _ in range(args.turns)]
    with serve_process() as url, Client(url) as vc:
        vc.encode([png_bytes(1, width, height)])  # warm the tower and the connection
        for c in range(args.conversations):
            screenshots: list[bytes] = []
            for turn in range(args.turns):
                screenshots.append(png_bytes(50_000 + 100 * c + turn, width, height))
                before = counter(url, "visenc_forwards_total")
                t0 = time.perf_counter()
                handles = vc.encode(screenshots)
                latency[turn].append(time.perf_counter() - t0)
                assert [h.status for h in handles] == ["ready"] * len(screenshots)
                forwards[turn].append(int(counter(url, "visenc_forwards_total") - before))
        # the part of a turn that grows with the conversation: resending earlier screenshots by hash
        resend = {}
        for n in (1, args.turns):
            t0 = time.perf_counter()
            for _ in range(20):
                vc.encode(screenshots[:n])
            resend[n] = (time.perf_counter() - t0) / 20

    print(
        f"{args.conversations} conversations x {args.turns} turns, one new {args.size} screenshot per turn, "
        "earlier ones resent by hash"
    )
    print(f"{'turn':>4} {'images sent':>11} {'forwards':>9} {'encode latency (ms, median)':>28}")
    for turn in range(args.turns):
        fw = sorted(set(forwards[turn]))
        print(f"{turn + 1:4} {turn + 1:11} {'/'.join(map(str, fw)):>9} {1000 * statistics.median(latency[turn]):28.1f}")
    first, last = statistics.median(latency[0]), statistics.median(latency[-1])
    print(f"forwards per turn: {sorted({f for fs in forwards for f in fs})} (must be [1])")
    print(f"latency turn {args.turns} / turn 1: {last / first:.2f} (goal <= 1.5)")
    print(
        f"hash-only resend (all hits, client hashing included): {1000 * resend[1]:.1f} ms for 1 image, "
        f"{1000 * resend[args.turns]:.1f} ms for {args.turns}"
    )


if __name__ == "__main__":
    main()
