"""Video caching per tube vs per whole video vs none, side by side in one run.

python bench/bench_video.py [--window 16] [--steps 6] [--size 320x240] [--rounds 5]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "service"), str(ROOT / "clients")]

import httpx
from _common import spread
from harness.images import jpeg_bytes
from harness.processes import serve_process
from harness.waits import metric

from visenc_client import Client, Video

_namespaces = itertools.count()


def fresh() -> str:
    return f"bench{next(_namespaces)}"


class Policy:
    """One caching policy: ``ask(frames)`` encodes a clip and says how long it took."""

    def __init__(self, url: str, name: str) -> None:
        self.url, self.name = url, name
        self.tube_ns = fresh()
        self.seen: dict[tuple[bytes, ...], str] = {}  # whole-video policy: clip -> its namespace

    def namespace(self, frames: list[bytes]) -> str:
        if self.name == "tube":
            return self.tube_ns
        if self.name == "whole":
            return self.seen.setdefault(tuple(frames), fresh())
        return fresh()

    def ask(self, frames: list[bytes]) -> float:
        with Client(self.url, namespace=self.namespace(frames)) as vc:
            t0 = time.perf_counter()
            (handle,) = vc.encode([Video(frames)])
            elapsed = time.perf_counter() - t0
        assert handle.status == "ready", handle
        return elapsed


def encoded(url: str) -> float:
    return metric(httpx.get(f"{url}/metrics").text, "visenc_encoded_images_total")


def measure(url: str, policy: Policy, clips: list[list[bytes]]) -> tuple[float, float]:
    """(tubes encoded, median latency in seconds) over ``clips`` asked in order."""
    before = encoded(url)
    latencies = [policy.ask(c) for c in clips]
    return encoded(url) - before, statistics.median(latencies)


def run(url: str, window: int, steps: int, size: tuple[int, int], rounds: int) -> None:
    w, h = size
    stream = [jpeg_bytes(7000 + i, w, h) for i in range(window + 2 * steps + 2)]
    slides = [stream[2 * s : 2 * s + window] for s in range(steps)]
    clip, grown = stream[:window], stream[: window + 2]
    ratios: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        ratios.setdefault(name, []).append(value)

    Policy(url, "none").ask(stream[:2])  # warm the service up
    for _ in range(rounds):
        got = {p: measure(url, Policy(url, p), slides) for p in ("tube", "whole", "none")}
        (tw, tl), (ww, wl), (nw, nl) = got["tube"], got["whole"], got["none"]
        add("window work tube/whole", tw / ww)
        add("window work tube/none", tw / nw)
        add("window latency tube/whole", tl / wl)
        add("window latency tube/none", tl / nl)
        tube = Policy(url, "tube")
        cold = tube.ask(clip)
        hit = tube.ask(clip)
        add("re-asked latency hit/cold", hit / cold)
        whole = Policy(url, "whole")
        whole.ask(clip)
        before = encoded(url)
        grown_whole = whole.ask(grown)
        work_whole = encoded(url) - before
        before = encoded(url)
        grown_tube = tube.ask(grown)
        work_tube = encoded(url) - before
        add("grown work tube/whole", work_tube / work_whole)
        add("grown latency tube/whole", grown_tube / grown_whole)
    tubes = window // 2
    print(f"window {window} frames ({tubes} tubes) of {w}x{h}, advanced by one tube, {steps} requests a round")
    for name, values in ratios.items():
        print(f"  {name:28s} {spread(values)}")
    print(f"  (sliding window: the first request of a round is cold in every policy; the other {steps - 1}")
    print(f"   encode 1 tube of {tubes} with tube caching, all {tubes} with whole-video caching or none)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--window", type=int, default=16, help="frames per request (even)")
    parser.add_argument("--steps", type=int, default=6, help="requests per sliding-window round")
    parser.add_argument("--size", default="320x240", help="frame size WxH")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    w, h = (int(x) for x in args.size.split("x"))
    with serve_process("--max-wait-ms", "1") as url:
        run(url, args.window, args.steps, (w, h), args.rounds)


if __name__ == "__main__":
    main()
