"""A corpus of odd but valid image files (and a few an engine refuses), for the differential tests
that compare visenc's loaders with each engine's own code (``tests/with_vllm``, ``tests/with_sglang``,
``tests/golden/test_odd_images.py``): EXIF orientations 1-8, every PNG transparency form, 16-bit,
CMYK, progressive and grayscale JPEG, WebP with and without alpha, animated WebP and GIF, a
transparent GIF, BMP, TIFF, extreme aspect ratios, the smallest image and a large one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from harness.images import noise as random_pixels
from harness.images import save
from PIL import Image


def corpus(seed: int = 11) -> dict[str, bytes]:
    """name -> file bytes, the same for a given seed."""
    rng = np.random.default_rng(seed)

    def noise(width: int, height: int, channels: int = 3) -> np.ndarray:
        return random_pixels(rng, width, height, channels)

    def oriented(orientation: int) -> bytes:
        """A 240x160 JPEG (blocky, so the orientation shows) whose EXIF says ``orientation``."""
        image = Image.fromarray(np.kron(noise(24, 16), np.ones((10, 10, 1), np.uint8)), "RGB")
        exif = Image.Exif()
        exif[0x0112] = orientation
        return save(image, "JPEG", quality=95, exif=exif.tobytes())

    def with_alpha(mode: str, width: int = 61, height: int = 45) -> Image.Image:
        bands = noise(width, height, len(mode))
        bands[: height // 3, :, -1] = 0  # a transparent band
        bands[height // 3 : 2 * height // 3, :, -1] = 128  # a half transparent band
        return Image.fromarray(bands, mode)

    def palette(width: int = 50, height: int = 38) -> Image.Image:
        p = Image.fromarray(noise(width, height, 1) % 16, "L").convert("P")
        p.putpalette([v for i in range(16) for v in (i * 15, 255 - i * 15, (i * 40) % 256)])
        return p

    def animation(fmt: str, **options: object) -> bytes:
        frames = [Image.fromarray(noise(40, 30), "RGB"), Image.new("RGB", (40, 30), (20, 20, 200))]
        return save(frames[0], fmt, save_all=True, append_images=frames[1:], duration=100, loop=0, **options)

    def keyed(image: Image.Image, colour: tuple[int, int, int]) -> Image.Image:
        """``image`` with a block of ``colour`` (the colour a tRNS chunk makes transparent)."""
        keyed = image.copy()
        keyed.paste(colour, (8, 8, 30, 24))
        return keyed

    def corrupt(png: bytes) -> bytes:
        """The PNG with bytes of its compressed stream overwritten (CRC and zlib errors)."""
        return png[:60] + b"\xff" * 20 + png[80:]

    rgb = Image.fromarray(noise(64, 48), "RGB")
    gray = Image.fromarray(noise(50, 30, 1), "L")
    files = {f"jpeg-exif-orientation-{o}": oriented(o) for o in range(1, 9)}
    files |= {
        "png-rgb": save(rgb, "PNG"),
        "png-rgba": save(with_alpha("RGBA"), "PNG"),
        "png-la": save(with_alpha("LA"), "PNG"),
        "png-palette-trns": save(palette(), "PNG", transparency=3),
        "png-palette-alpha-table": save(palette(), "PNG", transparency=bytes(range(0, 256, 16))),
        "png-gray-trns": save(gray, "PNG", transparency=7),
        "png-rgb-trns": save(keyed(rgb, (10, 20, 30)), "PNG", transparency=(10, 20, 30)),
        "png-16bit-gray": save(Image.fromarray(noise(40, 30, 1).astype(np.uint16) * 257), "PNG"),
        "png-1bit": save(gray.convert("1"), "PNG"),
        "jpeg-cmyk": save(Image.fromarray(noise(40, 32, 4), "CMYK"), "JPEG", quality=95),
        "jpeg-progressive": save(rgb, "JPEG", quality=90, progressive=True),
        "jpeg-gray": save(gray, "JPEG"),
        "webp-lossless": save(rgb, "WEBP", lossless=True),
        "webp-alpha": save(with_alpha("RGBA"), "WEBP", lossless=True),
        "webp-animated": animation("WEBP", lossless=True),
        "gif-animated": animation("GIF"),
        "gif-transparent": save(palette(), "GIF", transparency=3),
        "bmp": save(rgb, "BMP"),
        "tiff": save(rgb, "TIFF"),
        "tiff-rgba": save(with_alpha("RGBA"), "TIFF"),
        "tall-200-to-1": save(Image.fromarray(noise(2, 400), "RGB"), "PNG"),
        "wide-200-to-1": save(Image.fromarray(noise(400, 2), "RGB"), "PNG"),
        "one-pixel": save(Image.fromarray(noise(1, 1), "RGB"), "PNG"),
        "large-1000x999": save(Image.fromarray(noise(1000, 999), "RGB"), "PNG"),
        # a format outside vLLM's allow-list (Pillow writes it only where Ghostscript is absent too)
        "eps": save(rgb, "EPS"),
        # broken files
        "truncated-png": save(rgb, "PNG")[:200],
        "corrupt-png-stream": corrupt(save(rgb, "PNG")),
        "not-an-image": b"GIF89a but not really" * 4,
    }
    return files


LIMIT = 1 << 26


def assert_engine_inputs(
    tower: Any,
    data: bytes,
    loader: str,
    engine_inputs: Callable[[], tuple[int, tuple[int, ...] | None, np.ndarray]],
) -> None:
    """visenc's handle for ``data`` (row count and grid, from the header alone) and its preprocessed
    pixels equal what an engine's processor makes of the image (``engine_inputs()``: placeholder
    count, grid (``None`` for a model whose items carry none), ``pixel_values``; within 1e-6); where
    the engine's processor refuses the size, the handle is refused too (the test is then skipped,
    saying so)."""
    import pytest

    from visenc.errors import VisencError
    from visenc.imaging.decode import decode, probe

    size = probe(data, max_pixels=LIMIT, loader=loader)
    try:
        tokens, grid, want = engine_inputs()
    except Exception as e:  # the engine's processor refuses the size (an aspect ratio over 200)
        with pytest.raises(VisencError):
            tower.layout(*size)
        pytest.skip(f"the engine's processor refuses {size}: {e}")
    layout = tower.layout(*size)  # what the handle says
    prepared = tower.preprocess(decode(data, max_pixels=LIMIT, loader=loader))
    assert layout.num_tokens == tokens
    assert grid is None or layout.grid_thw == grid
    assert prepared.layout == layout
    pixels = prepared.pixels["pixel_values"] if isinstance(prepared.pixels, dict) else prepared.pixels
    pixels = np.asarray(pixels, dtype=np.float32)
    if pixels.ndim == want.ndim + 1 and pixels.shape[0] == 1:  # a batch of this one image
        pixels = pixels[0]
    assert pixels.shape == want.shape
    np.testing.assert_allclose(pixels, want, atol=1e-6, rtol=0)
