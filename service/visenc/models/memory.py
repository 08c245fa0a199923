"""Activation-memory arithmetic for ViT towers: bytes a forward allocates, from the config."""

from __future__ import annotations

from typing import Any

#: headroom over the counted tensors (allocator rounding, temporaries we do not list)
SAFETY = 1.5


def block_bytes_per_position(embed_dim: int, mlp_dim: int, itemsize: int, *, gated: bool = False) -> int:
    """Live bytes per position at the widest point of a pre-norm transformer block."""
    # attention 10e (residual, normed, qkv 3e, rotated q/k 2e, output, projection, residual); MLP 2m, gated 3m
    return itemsize * (10 * embed_dim + (3 if gated else 2) * mlp_dim)


def attention_score_bytes(heads: int, seq: int, itemsize: int, *, materialised: bool) -> int:
    """Bytes of one attention call's score matrices over ``seq`` positions (eager: ``2 * heads * seq²``; fused: 0)."""
    return 2 * heads * seq * seq * itemsize if materialised else 0


def materialises_scores(config: Any) -> bool:
    return getattr(config, "_attn_implementation", None) in (None, "eager")


def cast_bytes(itemsize: int) -> int:
    """Extra bytes per float32 input value when the forward casts it to the compute dtype."""
    return 0 if itemsize == 4 else itemsize
