"""Plain data the client hands back."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from visenc_client.format import Handle, image_hash, video_hash

__all__ = ["Handle", "RowRange", "Video", "image_hash", "video_hash"]

#: an encoded image: its bytes, or a path to read them from
ImageInput = bytes | bytearray | memoryview | str | os.PathLike[str]


@dataclass(frozen=True, slots=True)
class Video:
    """A video as the frames the caller sampled, in order (encoded images of one size); tubes pair frames
    (0, 1), (2, 3), ..., so clips that start at even offsets share tubes."""

    frames: Sequence[ImageInput]


@dataclass(frozen=True, slots=True)
class RowRange:
    """Token rows ``[start, end)`` of one image; ``lease``: the handle's (reading the last row unpins it)."""

    hash: str
    start: int | None = None
    end: int | None = None
    lease: str | None = None

    @classmethod
    def of(cls, image: str | Handle, start: int | None = None, end: int | None = None) -> RowRange:
        if isinstance(image, Handle):
            return cls(image.hash, start, end, image.lease)
        return cls(image, start, end)
