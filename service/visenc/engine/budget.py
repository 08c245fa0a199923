"""From a memory budget to batch limits: tokens per forward, bytes of activations, input staged.

A batch sized by these limits never runs the device out of memory (the arithmetic, and the measurements
behind the staging bound: ``docs/internals.md``); one image over them still runs, alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from visenc.engine.host import usable_memory_bytes
from visenc.models.base import VisionTower

log = logging.getLogger(__name__)

#: share of the budget not handed to batches (decode workspace, allocator slack)
RESERVE = 0.2

#: most patch tokens in one packed forward on a CPU. Per-token cost is flat up to a
#: few thousand tokens, then the elementwise ops (rotary mul, activations) fall out
#: of cache: 8 packed 640x480 images (12.5k tokens) ran ~10-30% slower per image
#: than 1-4 (bench/bench_batching.py). Attention is per image, so nothing is lost.
CPU_PACKED_BATCH_TOKENS = 4096

#: share of the process's memory budget the staged inputs may take on CUDA (where they live on the host)
STAGING_SHARE = 0.125
#: a staged line's bytes per input byte at most: the input, plus its decode while it is made
#: (``prepare.py``: a JPEG screenshot's decode charge is about 1.7 times its input)
STAGED_LINE_FACTOR = 3


@dataclass(frozen=True, slots=True)
class BatchBudget:
    """Limits the scheduler applies; every field is a hard bound except that one
    image over them still runs alone."""

    memory_bytes: int
    max_batch_tokens: int
    #: bound on ``tower.forward_bytes(batch)``
    max_batch_bytes: int
    #: tower-input tokens preprocessed (or being preprocessed) and not yet forwarded
    prefetch_tokens: int


def device_memory_budget(device: torch.device, fraction: float) -> int:
    """``fraction`` of the device's memory: CUDA total memory, but never more than
    what is free now (after the weights are loaded); CPU: physical RAM, or the
    container's memory limit (cgroup v1 or v2) when that is lower."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(min(fraction * total, free))
    return int(fraction * usable_memory_bytes())


def plan_budget(
    tower: VisionTower,
    memory_bytes: int,
    *,
    max_batch_tokens: int,
    prefetch_tokens: int | None = None,
    workers: int = 0,
    process_memory_bytes: int | None = None,
) -> BatchBudget:
    """Batch limits for ``tower`` under ``memory_bytes`` (see the module docstring).

    ``max_batch_tokens`` is a cap from the settings (the plan may lower it, never
    raise it; on CPU a packable tower is also capped at ``CPU_PACKED_BATCH_TOKENS``);
    ``prefetch_tokens`` overrides the derived staging bound. On CUDA that bound is two batches ready
    plus one batch for each of the ``workers`` preprocessing threads (so every one of them can make an
    image while two batches wait), within ``STAGING_SHARE`` of ``process_memory_bytes``, the
    process's memory budget (``process_memory.py``; default: this process's usable memory).
    """
    if memory_bytes <= 0:
        raise ValueError(f"memory budget must be positive, got {memory_bytes}")
    usable = int(memory_bytes * (1 - RESERVE))
    act = max(1, tower.activation_bytes_per_token())
    staged_here = tower.device.type != "cuda"
    inp = tower.input_bytes_per_token() if staged_here else 0
    if staged_here and tower.packable:
        max_batch_tokens = min(max_batch_tokens, CPU_PACKED_BATCH_TOKENS)
    tokens = max(1, min(max_batch_tokens, usable // (act + 2 * inp)))
    batch_bytes = max(tokens * act, usable - 2 * tokens * inp)
    if prefetch_tokens is not None:
        prefetch = prefetch_tokens
    elif staged_here:
        prefetch = tokens // 4
    else:
        host = usable_memory_bytes() if process_memory_bytes is None else process_memory_bytes
        line = STAGED_LINE_FACTOR * max(1, tower.input_bytes_per_token())
        prefetch = max(2 * tokens, min((2 + workers) * tokens, int(STAGING_SHARE * host) // line))
    return BatchBudget(memory_bytes, tokens, batch_bytes, max(1, prefetch))
