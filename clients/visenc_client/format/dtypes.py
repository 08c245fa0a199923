"""The wire's dtypes, defined once, and their conversions to and from torch without a copy."""

from __future__ import annotations

from typing import Any

import numpy as np

#: wire dtype -> the numpy dtype that carries its raw values
NUMPY_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),  # numpy has no bfloat16: carried as raw 16-bit words
}
#: wire dtype -> the name torch gives it (``str(tensor.dtype)``)
TORCH_NAMES: dict[str, str] = {name: f"torch.{name}" for name in NUMPY_DTYPES}


def bfloat16_as_float32(words: np.ndarray) -> np.ndarray:
    """bfloat16 values carried as their 16-bit words, as float32 (exact: the words are the high halves)."""
    return (words.astype(np.uint32) << 16).view(np.float32)


def tensor_words(t: Any) -> np.ndarray:
    """A CPU torch tensor's values as numpy without a copy, as the wire carries them."""
    import torch

    t = t.detach()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def words_tensor(rows: np.ndarray, dtype: str) -> Any:
    import torch

    if dtype == "bfloat16":
        return torch.from_numpy(rows.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(rows)
