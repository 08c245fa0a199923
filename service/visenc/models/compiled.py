"""A compiled tower: each repeated transformer block through ``torch.compile`` with dynamic shapes.

The graphs are bounded. Shapes are symbolic from the first call (``dynamic=True``), so a new image
size or batch size reuses the graph instead of recompiling. The blocks of a tower share one code
object and their weights are graph inputs, so they share graphs too. Dynamo still specialises sizes
0 and 1 (a batch of one image beside a batch of several), which gives one or two graphs for a tower.
Past ``RECOMPILE_LIMIT`` graphs per block, dynamo runs the block eagerly instead of compiling again,
and a block the backend fails to compile (no compiler, an unsupported device) runs eagerly too.

Packed attention stays one custom op inside the graph (``models/varlen.py``), so the norms, rotary
embeddings, casts and activations around it fuse into a few kernels.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch

log = logging.getLogger(__name__)

#: most graphs one block's code may compile (dynamo falls back to eager past it)
RECOMPILE_LIMIT = 8

Compile = Literal["auto", "on", "off"]


def wanted(setting: Compile, device: torch.device) -> bool:
    """``auto``: on for CUDA, off on a CPU (where compiling takes longer than it saves for small towers)."""
    return setting == "on" or (setting == "auto" and device.type == "cuda")


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of ``model``: members of every ``ModuleList`` of two or more modules of one class."""
    found: list[torch.nn.Module] = []
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > 1 and len({type(m) for m in module}) == 1:
            found.extend(module)
    return found


def configure() -> None:
    """Dynamo's settings for the blocks, in the calling thread: torch keeps each setting per thread
    (a context variable), so the thread that runs the forwards calls this too."""
    for name in ("recompile_limit", "cache_size_limit"):  # the name changed in torch 2.6
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, RECOMPILE_LIMIT)
    torch._dynamo.config.suppress_errors = True  # a failed compile costs speed, never a request


def compile_blocks(model: torch.nn.Module) -> int:
    """Compile every repeated block of ``model`` in place; returns how many."""
    configure()
    found = blocks(model)
    for block in found:
        block.compile(dynamic=True)
    log.info("compiled %d blocks of %s (dynamic shapes)", len(found), type(model).__name__)
    return len(found)


def graphs() -> int:
    """Graphs compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
