"""Plain data the client hands back."""

from __future__ import annotations

from dataclasses import dataclass

from visenc_client.format import Handle, image_hash

__all__ = ["Handle", "RowRange", "image_hash"]


@dataclass(frozen=True, slots=True)
class RowRange:
    """Token rows ``[start, end)`` of one image (``None``: from the first / to the last row)."""

    hash: str
    start: int | None = None
    end: int | None = None
