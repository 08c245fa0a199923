"""Forward FLOPs of the Qwen2-VL / Qwen2.5-VL vision towers, counted from the config and the grid."""

from __future__ import annotations

from typing import Any


def _window_sq_sum(grid_h: int, grid_w: int, merge: int, cells: int) -> int:
    """Σ (patches in window)² over Qwen2.5-VL's attention windows of one image."""

    def sides(n: int) -> list[int]:
        full, rest = divmod(n, cells)
        return [cells] * full + ([rest] if rest else [])

    hs, ws = sides(grid_h // merge), sides(grid_w // merge)
    return sum((a * b * merge * merge) ** 2 for a in hs for b in ws)


def qwen_vision_flops(config: Any, grid_thw: tuple[int, int, int]) -> int:
    """FLOPs of one image's forward through a Qwen2-VL or Qwen2.5-VL vision config."""
    t, h, w = grid_thw
    n = t * h * w
    merge = int(config.spatial_merge_size)
    windowed = hasattr(config, "window_size")  # Qwen2.5-VL
    d = int(config.hidden_size if windowed else config.embed_dim)
    out = int(config.out_hidden_size if windowed else config.hidden_size)
    patch_in = int(getattr(config, "in_channels", 3)) * config.temporal_patch_size * config.patch_size**2
    flops = 2 * n * patch_in * d  # patch embedding (a conv with stride = kernel: one matmul)
    mlp = 3 * 2 * n * d * int(config.intermediate_size) if windowed else 2 * 2 * n * d * int(d * config.mlp_ratio)
    per_block = 2 * n * d * 3 * d + 2 * n * d * d + mlp
    full_attention = 2 * 2 * t * (h * w) ** 2 * d  # QKᵀ and PV over every pair of one frame
    flops += config.depth * per_block
    if windowed:
        cells = config.window_size // (config.patch_size * merge)
        window_attention = 2 * 2 * t * _window_sq_sum(h, w, merge, cells) * d
        full_blocks = len(config.fullatt_block_indexes)
        flops += full_blocks * full_attention + (config.depth - full_blocks) * window_attention
    else:
        flops += config.depth * full_attention
    merged, width = n // (merge * merge), d * merge * merge
    return flops + 2 * merged * width * width + 2 * merged * width * out
