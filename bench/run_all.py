"""The quick benchmarks, one after the other (``make bench``). Each prints its own ratios.

    python bench/run_all.py [--infinity DIR]    # DIR: the peer folder from shared/peers/infinity/setup.sh

Longer runs: ``bench_memory.py`` (64 x 1920x1080 at the default resize), ``bench_threads.py``,
``bench_service.py --model tiny-qwen2-vl``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--infinity", default=None, help="Infinity peer folder (skipped with a note if absent)")
    args = p.parse_args()
    runs: list[list[str]] = []
    if (HERE / "bench_preprocess.py").exists():
        runs.append(["bench_preprocess.py"])
    runs += [
        ["bench_batching.py", "--rounds", "3"],
        [
            "bench_service.py",
            "--images",
            "32",
            "--rounds",
            "2",
            *(["--infinity", args.infinity] if args.infinity else []),
        ],
        ["bench_memory.py", "--max-pixels", "200704", "--budget-mib", "128"],
    ]
    failed = 0
    for run in runs:
        print(f"\n=== {' '.join(run)}", flush=True)
        failed += subprocess.run([sys.executable, str(HERE / run[0]), *run[1:]]).returncode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
