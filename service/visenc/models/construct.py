"""How a tower is constructed: dtype names, attention kernel, seeded or empty init, casting, config fields."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from transformers.initialization import no_init_weights

from visenc_client.format import TORCH_NAMES

M = TypeVar("M", bound=torch.nn.Module)

#: config keys that never change a vision tower's output (bookkeeping, output flags)
_NOISE_KEYS = {
    "transformers_version",
    "architectures",
    "output_hidden_states",
    "output_attentions",
    "return_dict",
    "id2label",
    "label2id",
    "problem_type",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "dtype",
    "torch_dtype",
}


def resolve_dtype(name: str) -> torch.dtype:
    try:
        torch_name = TORCH_NAMES[name.removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; expected one of {sorted(TORCH_NAMES)}") from None
    dtype: torch.dtype = getattr(torch, torch_name.removeprefix("torch."))
    return dtype


def config_fields(config: Any) -> dict[str, Any]:
    """A transformers config as a JSON-able dict of the fields that define the model."""
    fields = config.to_dict()
    return {k: v for k, v in sorted(fields.items()) if k not in _NOISE_KEYS and not k.startswith("_")}


def set_attention(config: Any, implementation: str = "sdpa") -> None:
    """Pick the attention kernel before building (sdpa: the faster of eager and sdpa on CPU)."""
    config._attn_implementation = implementation


def build_seeded(factory: Callable[[], M], seed: int) -> M:
    """Build a module with weights from ``torch.manual_seed(seed)`` (bit-identical per torch version), RNG untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = factory()
    return module.eval()


def build_empty(factory: Callable[[], M]) -> M:
    """Build a module for a checkpoint to fill: no random init, ``__init__``'s buffers kept."""
    with no_init_weights():
        module = factory()
    return module.eval()


#: rotary frequency buffers: transformers keeps them float32 whatever the weights' dtype
FP32_BUFFERS = ("inv_freq", "original_inv_freq")


def cast_module(model: torch.nn.Module, *, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """``model.to(device, dtype)``, rotary frequency tables kept float32 as transformers loads them."""
    keep = {
        name: buf.detach().clone()
        for name, buf in model.named_buffers()
        if name.rpartition(".")[2] in FP32_BUFFERS and buf.dtype == torch.float32
    }
    model = model.to(device=device, dtype=dtype)
    for name, buf in keep.items():
        owner, _, attr = name.rpartition(".")
        model.get_submodule(owner)._buffers[attr] = buf.to(device)
    return model
