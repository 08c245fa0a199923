"""Image files for tests: encode a PIL image in a format, and random pixels."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def save(image: Image.Image, fmt: str, **options: object) -> bytes:
    """``image`` as a file of ``fmt`` (Pillow's format name), with Pillow's save options."""
    buf = io.BytesIO()
    image.save(buf, format=fmt, **options)
    return buf.getvalue()


def noise(rng: np.random.Generator, width: int, height: int, channels: int = 3) -> np.ndarray:
    """uint8 pixels, ``[height, width, channels]`` (``[height, width]`` for one channel)."""
    shape = (height, width, channels) if channels > 1 else (height, width)
    return rng.integers(0, 256, shape, dtype=np.uint8)
