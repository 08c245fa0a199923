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
    """A video as the frames the caller sampled, in order (each an encoded image, all one size).

    Sample on a fixed timeline and start clips at even frame offsets: tubes pair frames (0, 1),
    (2, 3), ... from a clip's first frame, so two clips share the tubes they share pairs of."""

    frames: Sequence[ImageInput]


@dataclass(frozen=True, slots=True)
class RowRange:
    """Token rows ``[start, end)`` of one image (``None``: from the first / to the last row); ``lease``:
    the handle's, so that the read renews (or, reaching the last row, releases) its pin."""

    hash: str
    start: int | None = None
    end: int | None = None
    lease: str | None = None

    @classmethod
    def of(cls, image: str | Handle, start: int | None = None, end: int | None = None) -> RowRange:
        """The range of ``image``, a hash or a handle (whose lease it carries)."""
        if isinstance(image, Handle):
            return cls(image.hash, start, end, image.lease)
        return cls(image, start, end)
