"""How the CPU cores are split between the pipeline's stages.

On a CPU device the forward and the preprocessing pool run at the same time on
the same cores (that is the overlap). Giving each all the cores oversubscribes
them: torch's OpenMP workers wait at barriers for threads the OS has parked
while a preprocessing thread runs, and a 2-core host measured 3x slower
forwards with 2 torch threads + 2 preprocessing threads than with 1 + 1
(``bench/bench_threads.py``). So the cores are *split*: half (rounded up)
to preprocessing, the rest to torch, at least one each.

On CUDA the forward barely uses the CPU: every core preprocesses, and torch
keeps 1 intra-op thread (the host side of a GPU forward is launch-bound).
"""

from __future__ import annotations

import os

import torch


def available_cores() -> int:
    """Cores this process may run on (CPU affinity, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_preprocess_workers(device: torch.device, cores: int | None = None) -> int:
    cores = cores or available_cores()
    return cores if device.type == "cuda" else max(1, (cores + 1) // 2)


def default_torch_threads(device: torch.device, cores: int | None = None) -> int:
    cores = cores or available_cores()
    return 1 if device.type == "cuda" else max(1, cores - default_preprocess_workers(device, cores))
