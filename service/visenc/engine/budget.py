"""From a memory budget to batch limits: tokens per forward, activation bytes, input staged (``docs/internals.md``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from visenc.devices import Device
from visenc.engine.host import usable_memory_bytes
from visenc.models.base import VisionTower

log = logging.getLogger(__name__)

#: share of the budget not handed to batches (decode workspace, allocator slack, rows not yet copied out)
RESERVE = 0.2
#: share of the budget, out of ``RESERVE``, the rows made and not yet copied out may hold (then the device waits)
OUTPUT_SHARE = 0.1

#: most patch tokens in one packed CPU forward: past it elementwise ops fall out of cache (bench_batching.py)
CPU_PACKED_BATCH_TOKENS = 4096

#: share of the process's memory budget the staged inputs may take on a GPU (where they live on the host)
STAGING_SHARE = 0.125
#: a staged line's bytes per input byte at most (a screenshot's input and decode charge: 2.8-3.0 times its input)
STAGED_LINE_FACTOR = 3


@dataclass(frozen=True, slots=True)
class BatchBudget:
    """Limits the scheduler applies: hard bounds, except that one image over them runs alone.
    Immutable, planned once at start-up; read from the loop and the device thread."""

    memory_bytes: int
    max_batch_tokens: int
    max_batch_bytes: int
    prefetch_tokens: int

    @property
    def max_output_bytes(self) -> int:
        """Rows made on the device and not yet copied out, at most (one forward's always fits)."""
        return int(OUTPUT_SHARE * self.memory_bytes)


def device_memory_budget(device: Device, fraction: float) -> int:
    """``fraction`` of the device's memory: a GPU's total (at most what is free), or the host's usable memory."""
    return device.memory_bytes(fraction)


def plan_budget(
    tower: VisionTower,
    memory_bytes: int,
    *,
    max_batch_tokens: int,
    prefetch_tokens: int | None = None,
    workers: int = 0,
    process_memory_bytes: int | None = None,
) -> BatchBudget:
    """Batch limits for ``tower`` under ``memory_bytes``; ``max_batch_tokens`` is only lowered."""
    if memory_bytes <= 0:
        raise ValueError(f"memory budget must be positive, got {memory_bytes}")
    usable = int(memory_bytes * (1 - RESERVE))
    act = max(1, tower.activation_bytes_per_token())
    staged_here = not tower.runtime.separate_memory
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
