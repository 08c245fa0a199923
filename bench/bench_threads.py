"""How to split a small host's cores between torch and the preprocessing pool.

python bench/bench_threads.py                      # tiny-clip, 640x480
python bench/bench_threads.py --model tiny-qwen2-vl
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "service"), str(Path(__file__).resolve().parent)]

import _common as c


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-clip")
    p.add_argument("--images", type=int, default=48)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    import torch

    from visenc.engine.threads import available_cores, default_preprocess_workers, default_torch_threads

    cores = available_cores()
    cpu = torch.device("cpu")
    default = (default_torch_threads(cpu, cores), default_preprocess_workers(cpu, cores))
    splits = sorted({default, (cores, cores), (cores, 1), (1, cores), (1, 1)})
    images = [c.jpeg(i) for i in range(args.images)]
    configs = [({}, ["--torch-threads", str(t), "--preprocess-workers", str(w)]) for t, w in splits]
    rates = dict(zip(splits, c.serve_rates(args.model, configs, images, args.rounds)))
    base = statistics.median(rates[default])
    print(
        f"{args.model}, {cores} cores, 8 concurrent single-image clients, {args.images} cold images x "
        f"{args.rounds} rounds"
    )
    for s in splits:
        m = statistics.median(rates[s])
        tag = "  (default)" if s == default else ""
        print(f"  torch threads {s[0]}, preprocess workers {s[1]}: {m:6.1f} img/s  {m / base:5.2f}x{tag}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
