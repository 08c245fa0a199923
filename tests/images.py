"""Deterministic test images, encoded to bytes."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def rgb_array(seed: int, width: int, height: int) -> np.ndarray:
    """Smooth gradients plus noise: compresses like a photo, differs per seed."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([(xx * (seed % 7 + 1) * 0.9) % 256, (yy * (seed % 5 + 2) * 0.7) % 256,
                     ((xx + yy) * (seed % 3 + 1)) % 256], axis=-1)
    return np.clip(base + rng.normal(0, 20, (height, width, 3)), 0, 255).astype(np.uint8)


def png_bytes(seed: int, width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rgb_array(seed, width, height), "RGB").save(buf, format="PNG")
    return buf.getvalue()


def jpeg_bytes(seed: int, width: int, height: int, quality: int = 90) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rgb_array(seed, width, height), "RGB").save(buf, format="JPEG", quality=quality)
    return buf.getvalue()
