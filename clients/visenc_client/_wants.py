"""What the engine will read for an image (``Want``), and the checks visenc's rows must pass to be given to it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from visenc_client._types import Handle
from visenc_client.format import words_tensor


@dataclass(frozen=True, slots=True)
class Want:
    """What the engine will read for one item: its row count and grid."""

    rows: int
    grid: tuple[int, ...] | None


class Absent(Exception):
    """An image's rows cannot be had."""


class Mismatch(Absent):
    """visenc's rows are not what the engine reads for the image (rows, width or grid): never loaded."""


Answers = dict[str, "torch.Tensor | Absent"]


def torch_rows(rows: np.ndarray, dtype: str | None) -> torch.Tensor:
    """The rows as a CPU tensor that owns its memory (a shared-memory view is copied once)."""
    owned = rows if rows.flags.owndata and rows.flags.writeable else np.array(rows, copy=True)
    return words_tensor(owned, dtype or "float32")


def check_handle(handle: Handle, want: Want) -> None:
    """``Mismatch`` unless a ready handle's row count and grid are what the engine reads."""
    if handle.num_tokens != want.rows:
        raise Mismatch(f"visenc has {handle.num_tokens} rows, vLLM reads {want.rows}")
    if want.grid is not None and handle.grid_thw is not None and tuple(handle.grid_thw) != want.grid:
        raise Mismatch(
            f"visenc's grid {tuple(handle.grid_thw)} is not vLLM's {want.grid} "
            "(the two decode or resize this image differently)"
        )


def checked_rows(rows: torch.Tensor, want: Want, hidden: int) -> torch.Tensor:
    if tuple(rows.shape) != (want.rows, hidden):
        raise Mismatch(f"visenc has rows {tuple(rows.shape)}, vLLM reads ({want.rows}, {hidden})")
    return rows
