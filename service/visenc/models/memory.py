"""Activation-memory arithmetic for ViT towers: bytes a forward allocates, from the config.

Used to turn a memory budget into batch limits (``engine/budget.py``). The
estimates are deliberately on the high side (``SAFETY``): a batch sized by
them must never run the device out of memory. Calibrated on the tiny towers
on CPU (fp32, sdpa): peak RSS growth of a forward was 0.6-0.75x of the
estimate (``bench/bench_memory.py`` prints both).

Units: bytes; ``seq`` is the number of positions attention runs over.
"""

from __future__ import annotations

from typing import Any

#: headroom over the counted tensors (allocator rounding, temporaries we do not list)
SAFETY = 1.5


def block_bytes_per_position(embed_dim: int, mlp_dim: int, itemsize: int, *, gated: bool = False) -> int:
    """Live bytes per position at the widest point of a pre-norm transformer block.

    Attention half: residual, normed input, qkv (3e), rotated q/k (2e), attention
    output, projection, new residual → 10e. MLP half: fc1 output and its
    activation (2m; a gated MLP holds gate, up and their product: 3m).
    """
    return itemsize * (10 * embed_dim + (3 if gated else 2) * mlp_dim)


def attention_score_bytes(heads: int, seq: int, itemsize: int, *, materialised: bool) -> int:
    """Bytes of one attention call's score matrices over ``seq`` positions.

    An eager implementation holds the scores and the softmax probabilities
    (``2 * heads * seq²``); fused kernels (sdpa flash / memory-efficient, flash-attn)
    work in tiles and hold no ``seq²`` tensor (their linear workspace is in the
    per-position term).
    """
    return 2 * heads * seq * seq * itemsize if materialised else 0


def materialises_scores(config: Any) -> bool:
    """Whether the configured attention implementation builds ``[heads, seq, seq]`` scores."""
    return getattr(config, "_attn_implementation", None) in (None, "eager")


def cast_bytes(itemsize: int) -> int:
    """Extra bytes per float32 input value when the forward casts it to the compute dtype."""
    return 0 if itemsize == 4 else itemsize
