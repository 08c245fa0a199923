"""Every VLM family: batched vs per-image forward at 8 mixed images, and the service vs the bare forward.

python bench/bench_families.py                       # batched vs per-image, 7 rounds
python bench/bench_families.py --service --rounds 5  # and service vs bare (minutes per family)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "service"), str(ROOT), str(Path(__file__).resolve().parent)]

import _common as c
from bench_batching import MIXED, engine_batches


def batched_vs_loop(folder: Path, rounds: int) -> tuple[int, list[float]]:
    from visenc.imaging.decode import decode
    from visenc.models.loading import load_tower

    tower = load_tower(str(folder))
    prepared = [tower.preprocess(decode(c.jpeg(i, w, h), max_pixels=1 << 30)) for i, (w, h) in enumerate(MIXED)]
    batches = engine_batches(tower, prepared)
    tower.forward(prepared[:2])  # warm-up
    ratios = []
    for r in range(rounds):
        times = {}
        for way in ("loop", "batched") if r % 2 == 0 else ("batched", "loop"):
            t0 = time.perf_counter()
            for chunk in [[p] for p in prepared] if way == "loop" else batches:
                tower.forward(chunk)
            times[way] = time.perf_counter() - t0
        ratios.append(times["loop"] / times["batched"])
    return len(batches), ratios


def service_vs_bare(folder: Path, rounds: int, images: int) -> list[float]:
    out = Path(tempfile.mkdtemp(prefix="visenc-fam-")) / "service.json"
    cmd = [sys.executable, str(ROOT / "bench" / "bench_service.py"), "--model", str(folder), "--no-naive"]
    cmd += ["--rounds", str(rounds), "--images", str(images), "--json", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["rounds"]["visenc / bare (goal >= 0.9)"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--families", default=None, help="comma-separated (default: all)")
    p.add_argument("--service", action="store_true", help="also measure the service vs the bare forward")
    p.add_argument("--images", type=int, default=24, help="images per service round")
    args = p.parse_args()
    import torch
    from harness.tiny_families import BUILDERS, save_family
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    from visenc.engine.threads import default_torch_threads

    torch.set_num_threads(default_torch_threads(torch.device("cpu")))
    names = args.families.split(",") if args.families else sorted(BUILDERS)
    print(f"8 mixed images {MIXED}, {args.rounds} rounds, torch threads {torch.get_num_threads()}")
    work = Path(tempfile.mkdtemp(prefix="visenc-families-"))
    for name in names:
        folder = save_family(name, work / name)
        forwards, ratios = batched_vs_loop(folder, args.rounds)
        line = f"  {name:16s} {forwards} forward(s): batched / per-image {c.spread(ratios)}"
        if args.service:
            line += f"; service / bare {c.spread(service_vs_bare(folder, args.rounds, args.images))}"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
