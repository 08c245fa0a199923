"""From a memory budget to batch limits: how many tokens one forward may take,
how many bytes its activations may use, how much input may be staged.

The budget is the engine's working memory: the forward's activations (the
tower's ``forward_bytes`` estimate) and, when they share the same memory (CPU),
the preprocessed inputs staged for the next batches. Weights, the index and
the request bodies are outside it. A share (``RESERVE``) is kept back for what
is not itemised: decode buffers of the preprocessing workers, allocator slack.

On CPU, with ``T`` the batch token limit, ``a`` the tower's activation bytes
per token and ``p`` its input bytes per token::

    two batches staged (one on the device, one prepared meanwhile) + one forward
    2·T·p + T·a  ≤  (1 - RESERVE) · budget

so batch N+1 can be preprocessed while batch N runs and the peak stays inside
the budget. On CUDA the staged inputs live in host memory and the budget is
device memory: ``T·a ≤ (1 - RESERVE) · budget``, staging two batches on the host.
A single image larger than the batch limits still runs, alone.

The staging bound (``prefetch_tokens``) is two batches on CUDA, where preprocessing
runs beside the forward for free. On a CPU it is a quarter of a batch (the memory plan
above still holds it): there the preprocessing shares the cores with the forward,
and staging further ahead only slows the forward running now. A prefill blocked on
a request's first images then gets them sooner (``bench/bench_ttfc.py``: 0.16-0.17 ->
0.15 of the whole request), at the same throughput (``bench/bench_ab.py``: 1.00x),
because the scheduler always prepares the device's next image whatever the bound.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from visenc.engine.limits import usable_memory_bytes
from visenc.models.base import VisionTower

log = logging.getLogger(__name__)

#: share of the budget not handed to batches (decode workspace, allocator slack)
RESERVE = 0.2

#: most patch tokens in one packed forward on a CPU. Per-token cost is flat up to a
#: few thousand tokens, then the elementwise ops (rotary mul, activations) fall out
#: of cache: 8 packed 640x480 images (12.5k tokens) ran ~10-30% slower per image
#: than 1-4 (bench/bench_batching.py). Attention is per image, so nothing is lost.
CPU_PACKED_BATCH_TOKENS = 4096


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
) -> BatchBudget:
    """Batch limits for ``tower`` under ``memory_bytes`` (see the module docstring).

    ``max_batch_tokens`` is a cap from the settings (the plan may lower it, never
    raise it; on CPU a packable tower is also capped at ``CPU_PACKED_BATCH_TOKENS``);
    ``prefetch_tokens`` overrides the derived staging bound.
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
    prefetch = prefetch_tokens if prefetch_tokens is not None else tokens // 4 if staged_here else 2 * tokens
    return BatchBudget(memory_bytes, tokens, batch_bytes, max(1, prefetch))
