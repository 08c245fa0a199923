"""Two ``visenc serve`` configurations side by side: does a flag or an environment
variable change cold throughput on this machine?

    python bench/bench_ab.py "" "--max-wait-ms 0"
    python bench/bench_ab.py "" "OMP_WAIT_POLICY=PASSIVE" --model /tmp/infinity/tiny-clip
    python bench/bench_ab.py "" ""                                     # A / A: the noise floor
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "service"), str(Path(__file__).resolve().parent)]

import _common as c


def parse_spec(spec: str) -> tuple[dict[str, str], list[str]]:
    """``"NAME=value --flag x"`` -> ({NAME: value}, [--flag, x]): words with ``=`` before any flag set the env."""
    env: dict[str, str] = {}
    args: list[str] = []
    for word in spec.split():
        if "=" in word and not word.startswith("-") and not args:
            name, value = word.split("=", 1)
            env[name] = value
        else:
            args.append(word)
    return env, args


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", help="configuration A: environment assignments, then `visenc serve` flags")
    p.add_argument("b", help="configuration B, the same way")
    p.add_argument("--model", default="tiny-clip")
    p.add_argument("--images", type=int, default=48)
    p.add_argument("--size", default="640x480")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=8)
    args = p.parse_args()

    w, h = (int(x) for x in args.size.split("x"))
    images = [c.jpeg(i, w, h) for i in range(args.images)]
    configs = [parse_spec(args.a), parse_spec(args.b)]
    rates = c.serve_rates(args.model, configs, images, args.rounds, args.concurrency)
    ratios = [b / a for a, b in zip(*rates)]
    print(
        f"A {args.a!r}: {statistics.median(rates[0]):.1f} img/s; B {args.b!r}: {statistics.median(rates[1]):.1f} img/s"
    )
    print(f"B / A {c.spread(ratios)}")


if __name__ == "__main__":
    main()
