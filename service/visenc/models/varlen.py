"""Packed attention: each segment of a packed sequence attends to itself alone, through a varlen kernel."""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from visenc import devices

log = logging.getLogger(__name__)

VARLEN = "visenc_flash_varlen"
#: the kernels, in the order they are preferred when their speed is not measured
KERNELS = ("torch-varlen", "flash-attn", "per-segment")
HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]


def segment_bounds(cu_seqlens: torch.Tensor) -> list[int]:
    return [int(x) for x in cu_seqlens.tolist()]


def _per_segment(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, _max: int, scale: float):
    """``[total, heads, dim]`` in, same out; a run of equal-length segments is one batched SDPA call."""
    out = q.new_empty(q.shape)
    bounds = segment_bounds(cu)
    i = 0
    while i < len(bounds) - 1:
        length = bounds[i + 1] - bounds[i]
        j = i + 1
        while j < len(bounds) - 1 and bounds[j + 1] - bounds[j] == length:
            j += 1
        s, e = bounds[i], bounds[j]
        if length:
            qs, ks, vs = (t[s:e].unflatten(0, (j - i, length)).transpose(1, 2) for t in (q, k, v))
            att = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, scale=scale)
            out[s:e] = att.transpose(1, 2).flatten(0, 1)
        i = j
    return out


def _torch_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float):
    from torch.nn.attention.varlen import varlen_attn

    cu = cu.to(torch.int32)
    if _takes_scale(varlen_attn):
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale)
    default = q.shape[-1] ** -0.5  # older torch: always this scale
    if scale != default:
        q = q * (scale / default)
    return varlen_attn(q, k, v, cu, cu, max_len, max_len)


@functools.cache
def _takes_scale(fn: Callable[..., Any]) -> bool:
    return "scale" in inspect.signature(fn).parameters


def _flash_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float):
    from flash_attn import flash_attn_varlen_func

    cu = cu.to(torch.int32)
    return flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, softmax_scale=scale)


IMPLEMENTATIONS: dict[str, Kernel] = {
    "torch-varlen": _torch_varlen,
    "flash-attn": _flash_attn,
    "per-segment": _per_segment,
}


def _sample(device: torch.device, dtype: torch.dtype, head_dim: int, lengths: list[int], heads: int = 4):
    gen = torch.Generator().manual_seed(0)
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, head_dim, generator=gen).to(device, dtype) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return q, k, v, cu, max(lengths), head_dim**-0.5


def works(kernel: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether ``kernel`` runs here and agrees with the per-segment result on a small packed sample."""
    if kernel == "flash-attn" and not HAS_FLASH_ATTN:
        return False
    args = _sample(device, dtype, head_dim, [5, 64, 17, 64])
    try:
        got = IMPLEMENTATIONS[kernel](*args).float()
    except Exception as e:  # unsupported device, dtype or head size
        log.info("varlen kernel %s is not usable on %s %s: %s", kernel, device, dtype, e)
        return False
    want = _per_segment(*args).float()
    return bool(torch.allclose(got, want, atol=2e-2, rtol=2e-2))


def _seconds(kernel: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> float:
    """Median time of ``kernel`` on a Qwen-shaped packed sequence: a 1080p image's windows and itself."""
    args = _sample(device, dtype, head_dim, [64] * 160 + [10304], heads=16)
    times, runtime = [], devices.for_device(device)
    for _ in range(7):
        runtime.synchronize()
        t0 = time.perf_counter()
        IMPLEMENTATIONS[kernel](*args)
        runtime.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


@functools.cache
def kernel_for(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """The kernel packed attention runs on ``device`` in ``dtype`` (decided once, logged)."""
    if not devices.for_device(device).fused_attention:
        return "per-segment"
    usable = [k for k in KERNELS[:-1] if works(k, device, dtype, head_dim)]
    if len(usable) > 1:
        timed = {k: _seconds(k, device, dtype, head_dim) for k in usable}
        usable.sort(key=timed.__getitem__)
        log.info("varlen kernels timed on %s: %s", device, {k: f"{s * 1e3:.2f} ms" for k, s in timed.items()})
    chosen = usable[0] if usable else "per-segment"
    log.info("packed attention on %s %s, head size %d: %s", device, dtype, head_dim, chosen)
    return chosen


def device_key(device: torch.device) -> torch.device:
    return devices.for_device(device).current()


@torch.library.custom_op("visenc::varlen_attention", mutates_args=())
def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float
) -> torch.Tensor:
    """Packed attention: ``q``, ``k``, ``v`` ``[total, heads, dim]``, segments cut at ``cu_seqlens``."""
    kernel = kernel_for(device_key(q.device), q.dtype, q.shape[-1])
    return IMPLEMENTATIONS[kernel](q, k, v, cu_seqlens, max_seqlen, scale)


@varlen_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float):
    return q.new_empty(q.shape)


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``[1, heads, total, dim]`` in, ``[1, total, heads, dim]`` out."""
    if cu_seq_lens_q is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    max_len = max_length_q if max_length_q is not None else q.shape[0]
    return varlen_attention(q, k, v, cu_seq_lens_q, max_len, scale).unsqueeze(0), None


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN, attention)


def use_varlen(model: torch.nn.Module) -> None:
    """Switch every config of ``model``'s submodules to ``VARLEN`` (modules read it at each forward)."""
    from transformers import PreTrainedConfig

    register()
    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(config, PreTrainedConfig):
            config._attn_implementation = VARLEN
            for name in getattr(config, "sub_configs", {}):
                sub = getattr(config, name, None)
                if isinstance(sub, PreTrainedConfig):
                    sub._attn_implementation = VARLEN


def packed_kwargs(config: Any, grid: list[tuple[int, int, int]] | torch.Tensor, device: torch.device) -> dict[str, Any]:
    """What a Qwen-style vision forward derives from ``grid_thw``, computed on the CPU and moved to ``device``."""
    from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids, get_vision_window_index

    grid_thw = torch.as_tensor(grid, dtype=torch.long)
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
    return {k: to_device(v, device) for k, v in out.items()}


def to_device(value: Any, device: torch.device) -> Any:
    if not isinstance(value, torch.Tensor) or value.device == device:
        return value
    return devices.for_device(device).to_device(value, value.dtype)
