"""Byte streams read whole under a size limit: request bodies (``api/codec.py``) and fetched images
(``media.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable


async def read_capped(chunks: AsyncIterator[bytes], limit: int, too_big: Callable[[], Exception]) -> bytes:
    """The stream's bytes joined, raising ``too_big()`` as soon as they pass ``limit``."""
    parts, size = [], 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise too_big()
        parts.append(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)
