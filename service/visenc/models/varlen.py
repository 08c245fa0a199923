"""One attention launch per layer for a packed Qwen batch, with no host sync in the forward.

transformers' Qwen vision towers derive ``cu_seqlens``, rotary position ids and (Qwen2.5-VL)
window indices from ``grid_thw`` inside the forward; with ``grid_thw`` on the GPU that is a
chain of device-to-host syncs (``.tolist()``, ``.item()``), and without flash-attn the sdpa
path splits the packed sequence and attends image by image (one launch per image per layer).

Here the batch's metadata is computed on the CPU from the images' grids (plain integers known
since preprocessing) with transformers' own helpers, copied to the device without blocking,
and handed to the forward as the precomputed kwargs transformers accepts (``position_ids``,
``cu_seqlens``, ``max_seqlen``, ``window_index``, ``cu_window_seqlens``, ``max_window_seqlen``).
Attention runs through ``VARLEN``, registered with transformers' attention functions: flash-attn's
varlen kernel when it is installed, else one SDPA call over the whole packed sequence with a
block-diagonal mask (built on the device from ``cu_seqlens``, once per distinct ``cu_seqlens``
of the forward). The name contains "flash" so that transformers hands it ``cu_seqlens`` and
the precomputed maximum lengths instead of splitting.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

#: the attention implementation name the packed path sets on the vision config
VARLEN = "visenc_flash_varlen"
#: whether flash-attn's varlen kernel can serve CUDA batches (looked up once, not per layer)
HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None


def packed_kwargs(config: Any, grid: list[tuple[int, int, int]], device: torch.device) -> dict[str, Any]:
    """Everything the Qwen vision forward would derive from ``grid_thw``, computed on the CPU
    and moved to ``device`` without blocking (pinned when the device is CUDA)."""
    from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids, get_vision_window_index

    grid_thw = torch.tensor(grid, dtype=torch.long)
    merge = int(config.spatial_merge_size)
    cu = get_vision_cu_seqlens(grid_thw)
    out: dict[str, Any] = {
        "position_ids": get_vision_position_ids(grid_thw, merge),
        "cu_seqlens": cu,
        "max_seqlen": int((cu[1:] - cu[:-1]).max()),
    }
    if hasattr(config, "window_size"):  # Qwen2.5-VL
        index, cu_window = get_vision_window_index(
            grid_thw, spatial_merge_size=merge, window_size=config.window_size, patch_size=config.patch_size
        )
        cu_window = torch.as_tensor(cu_window, dtype=torch.int32)
        out.update(
            window_index=index,
            cu_window_seqlens=cu_window,
            max_window_seqlen=int((cu_window[1:] - cu_window[:-1]).max()),
        )
    return {k: _to(v, device) for k, v in out.items()}


def _to(value: Any, device: torch.device) -> Any:
    if not isinstance(value, torch.Tensor) or device.type == "cpu":
        return value
    return value.pin_memory().to(device, non_blocking=True)


def block_mask(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``[total, total]`` bool mask, true where two positions belong to the same segment;
    computed on ``cu_seqlens``' device (no host sync)."""
    positions = torch.arange(total, device=cu_seqlens.device)
    segment = torch.searchsorted(cu_seqlens[1:].to(torch.long), positions, right=True)
    return segment[:, None] == segment[None, :]


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor,
    max_length_q: int,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over a packed ``[1, heads, total, dim]`` sequence, each segment of
    ``cu_seq_lens_q`` attending only to itself, in one kernel call. Returns
    ``[1, total, heads, dim]`` as transformers' attention functions do."""
    if query.is_cuda and HAS_FLASH_ATTN:
        from flash_attn import flash_attn_varlen_func

        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [total, heads, dim]
        cu = cu_seq_lens_q.to(torch.int32)
        out = flash_attn_varlen_func(q, k, v, cu, cu, max_length_q, max_length_q, softmax_scale=scaling)
        return out.unsqueeze(0), None
    mask = _mask_for(cu_seq_lens_q, query.shape[2])
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


#: the masks of the forward in progress, by the very ``cu_seqlens`` tensor they were built from
#: (held, so its storage cannot be reused meanwhile): the full and the windowed one of Qwen2.5-VL
_MASKS: list[tuple[torch.Tensor, torch.Tensor]] = []


def _mask_for(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    for source, mask in _MASKS:
        if source is cu_seqlens:
            return mask
    mask = block_mask(cu_seqlens, total)
    _MASKS.append((cu_seqlens, mask))
    del _MASKS[:-2]
    return mask


def release_masks() -> None:
    """Drop the cached masks (after each packed forward)."""
    _MASKS.clear()


def register() -> None:
    """Make ``VARLEN`` an attention implementation transformers can dispatch to."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN, varlen_attention)


def mask_bytes(total_tokens: int, distinct_masks: int) -> int:
    """Device bytes of the block masks one packed forward keeps (bool, ``total²`` each)."""
    return distinct_masks * total_tokens * total_tokens
