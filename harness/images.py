"""Deterministic test images: content is a pure function of (width, height, mode, seed)."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

MODES = ("RGB", "RGBA", "L", "P", "LA", "CMYK")


def make_array(width: int, height: int, channels: int = 3, seed: int = 0) -> np.ndarray:
    """HWC uint8: per-channel gradients at different angles + seeded noise."""
    rng = np.random.default_rng([seed, width, height, channels])
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    planes = []
    for c in range(channels):
        angle = 0.7 * c + 0.3
        ramp = (np.cos(angle) * x / max(width, 1) + np.sin(angle) * y / max(height, 1)) * 200.0
        planes.append(ramp + 40 * np.sin((x + 3 * c) / 5.0) + rng.normal(0, 18, (height, width)))
    return np.clip(np.stack(planes, axis=-1), 0, 255).astype(np.uint8)


def make_image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """An image of ``mode`` (see ``MODES``); P images are quantised from RGB and
    carry a transparent palette index when ``seed`` is odd."""
    if mode == "L":
        return Image.fromarray(make_array(width, height, 1, seed)[:, :, 0])
    if mode in ("RGBA", "LA"):
        rgba = Image.fromarray(make_array(width, height, 4, seed))
        return rgba if mode == "RGBA" else rgba.convert("LA")
    rgb = Image.fromarray(make_array(width, height, 3, seed))
    if mode == "RGB":
        return rgb
    if mode == "P":
        pal = rgb.quantize(colors=64)
        if seed % 2:
            pal.info["transparency"] = 3
        return pal
    return rgb.convert(mode)


def save(image: Image.Image, fmt: str = "PNG", **options: object) -> bytes:
    """``image`` as a file of ``fmt`` (Pillow's format name), with Pillow's save options."""
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def image_bytes(width: int, height: int, fmt: str = "PNG", mode: str = "RGB", seed: int = 0) -> bytes:
    """Encoded bytes of ``make_image(width, height, mode, seed)``."""
    return save(make_image(width, height, mode, seed), fmt)


def png_bytes(seed: int, width: int, height: int) -> bytes:
    """A distinct RGB PNG per ``seed`` (shorthand used by service and e2e tests)."""
    return image_bytes(width, height, "PNG", seed=seed)


def jpeg_bytes(seed: int, width: int, height: int, quality: int = 90) -> bytes:
    return save(make_image(width, height, seed=seed), "JPEG", quality=quality)


def noise(rng: np.random.Generator, width: int, height: int, channels: int = 3) -> np.ndarray:
    """uint8 pixels, ``[height, width, channels]`` (``[height, width]`` for one channel)."""
    shape = (height, width, channels) if channels > 1 else (height, width)
    return rng.integers(0, 256, shape, dtype=np.uint8)
