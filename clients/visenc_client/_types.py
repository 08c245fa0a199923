"""Plain data the client hands back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from visenc_client.format import image_hash

__all__ = ["Handle", "RowRange", "image_hash"]


@dataclass(frozen=True, slots=True)
class Handle:
    """One image's embedding handle.

    ``status`` is ``ready`` (fetch now), ``pending`` (being encoded; a fetch
    waits), ``missing`` (not in the index and no bytes were sent) or ``error``
    (``reason`` says why: ``visenc_client.format.Reason``).
    ``num_tokens`` / ``grid_thw`` are known even while pending, so a prompt can
    be laid out before the embeddings exist. ``rows`` holds the embedding
    itself (a read-only ``[num_tokens, hidden]`` array) when the encode asked for
    ``include_rows`` and the image was ready."""

    hash: str
    status: str
    num_tokens: int | None = None
    hidden_size: int | None = None
    dtype: str | None = None
    grid_thw: tuple[int, int, int] | None = None
    error: str | None = None
    rows: np.ndarray | None = field(default=None, compare=False, repr=False)
    reason: str | None = None

    @classmethod
    def from_wire(cls, d: dict[str, Any], rows: np.ndarray | None = None) -> Handle:
        grid = d.get("grid_thw")
        return cls(
            d["hash"],
            d["status"],
            d.get("num_tokens"),
            d.get("hidden_size"),
            d.get("dtype"),
            tuple(grid) if grid else None,
            d.get("error"),
            rows,
            d.get("reason"),
        )  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class RowRange:
    """Token rows ``[start, end)`` of one image (``None``: from the first / to the last row)."""

    hash: str
    start: int | None = None
    end: int | None = None
