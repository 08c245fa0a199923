"""The C heap under a CPU forward: glibc's defaults against visenc's setting (``visenc/heap.py``).

python bench/bench_heap.py                                   # tiny CLIP, batch 8
python bench/bench_heap.py --model /tmp/infinity/clip-b16 --forwards 5
python bench/bench_heap.py --model tiny-qwen2-vl --batch 4
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "service"), str(Path(__file__).resolve().parent)]

import _common as c


def child(model: str, keep: int, batch: int, forwards: int) -> None:
    """One measurement, in this process: ms an image of ``forwards`` forwards of ``batch`` images."""
    import threading
    import time

    import torch

    from visenc import heap
    from visenc.imaging.decode import decode
    from visenc.models.loading import load_tower

    held = heap.hold_freed(keep)
    torch.set_num_threads(2)
    tower = load_tower(model)
    prepared = [tower.preprocess(decode(c.jpeg(i), max_pixels=1 << 30)) for i in range(batch)]
    out: dict[str, float] = {}

    def run() -> None:
        for _ in range(3):
            tower.forward(prepared)
        t0 = time.perf_counter()
        for _ in range(forwards):
            tower.forward(prepared)
        out["ms"] = (time.perf_counter() - t0) / (forwards * batch) * 1e3

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    print(json.dumps({"held": held, "ms_per_image": out["ms"]}))


def measure(model: str, keep: int, batch: int, forwards: int) -> float:
    args = [c.PYTHON, __file__, "--child", "--model", model, "--keep", str(keep)]
    args += ["--batch", str(batch), "--forwards", str(forwards)]
    done = subprocess.run(args, capture_output=True, text=True, check=True, env=c.service_env())
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result["held"] != (keep > 0):
        raise SystemExit(f"the heap setting did not take effect as asked (keep={keep}): {result}")
    return float(result["ms_per_image"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-clip")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--forwards", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--keep", type=int, default=1 << 30, help="bytes kept (the service's --heap-keep-bytes)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.model, args.keep, args.batch, args.forwards)
        return 0
    print(f"{args.model}, batch {args.batch}, {args.forwards} forwards a process, {args.rounds} rounds")
    defaults: list[float] = []
    kept: list[float] = []
    for r in range(args.rounds):
        order = [(0, defaults), (args.keep, kept)]
        for keep, into in order if r % 2 == 0 else reversed(order):
            into.append(measure(args.model, keep, args.batch, args.forwards))
        print(f"round {r}: glibc defaults {defaults[-1]:.1f} ms/img, kept {kept[-1]:.1f} ms/img")
    print(f"forward speed, kept / glibc defaults: {c.spread([d / k for d, k in zip(defaults, kept)])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
