"""probe/decode: sizes, RGB conversion as transformers does it, and every failure mode."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from harness.images import image_bytes, make_image, save
from PIL import Image, ImageOps
from transformers.image_transforms import convert_to_rgb

from visenc.errors import InvalidImage, PayloadTooLarge
from visenc.imaging.decode import decode, exif_upright, probe

LIMIT = 4096 * 4096


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"])
def test_probe_and_decode_good_images(fmt: str) -> None:
    data = image_bytes(67, 45, fmt=fmt)
    assert probe(data, max_pixels=LIMIT) == (67, 45)
    image = decode(data, max_pixels=LIMIT)
    assert image.mode == "RGB" and image.size == (67, 45)
    np.asarray(image)  # fully loaded, readable


@pytest.mark.parametrize("mode", ["RGBA", "LA", "L", "P", "CMYK"])
def test_the_transformers_loader_converts_like_transformers(mode: str) -> None:
    source = make_image(40, 30, mode=mode, seed=1)  # seed 1: P gets a transparent index
    fmt = "JPEG" if mode == "CMYK" else "PNG"
    data = save(source, fmt)
    reopened = Image.open(io.BytesIO(data))
    expected = convert_to_rgb(reopened, return_numpy=True)
    np.testing.assert_array_equal(np.asarray(decode(data, max_pixels=LIMIT, loader="transformers")), expected)


def test_exif_orientation_per_loader() -> None:
    """vLLM shows the picture upright (so the handle's size, read from the header, turns too);
    SGLang's loader and a bare transformers processor take the pixels as stored."""
    image = make_image(40, 20)
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW"
    data = save(image, "JPEG", exif=exif.tobytes())
    assert decode(data, max_pixels=LIMIT).size == probe(data, max_pixels=LIMIT) == (20, 40)
    for loader in ("sglang", "transformers"):
        assert decode(data, max_pixels=LIMIT, loader=loader).size == probe(data, max_pixels=LIMIT, loader=loader)
        assert probe(data, max_pixels=LIMIT, loader=loader) == (40, 20)


@pytest.mark.parametrize("orientation", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 65535])
def test_exif_upright_gives_the_pixels_of_pillows_exif_transpose(orientation: int) -> None:
    """Every orientation, those it does not turn for included (returned as they are, no copy)."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = save(make_image(40, 20, mode="RGB", seed=3), "JPEG", exif=exif.tobytes())
    source, reference = Image.open(io.BytesIO(data)), Image.open(io.BytesIO(data))
    source.load()
    upright = exif_upright(source)
    assert (upright is source) == (orientation not in range(2, 9))
    np.testing.assert_array_equal(np.asarray(upright), np.asarray(ImageOps.exif_transpose(reference)))


def test_pixel_limit_is_checked_from_the_header() -> None:
    data = image_bytes(100, 50)
    assert probe(data, max_pixels=5000) == (100, 50)
    with pytest.raises(PayloadTooLarge, match="max_image_pixels=4999"):
        probe(data, max_pixels=4999)
    with pytest.raises(PayloadTooLarge, match="max_image_pixels=4999"):
        decode(data, max_pixels=4999)


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares ``width x height`` and carries one tiny IDAT: a bomb's header."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))


@pytest.mark.parametrize("side", [100_000, 5_000])  # over and under Pillow's own bomb threshold
def test_decompression_bomb_is_payload_too_large(side: int) -> None:
    data = _png_header_only(side, side)
    assert len(data) < 200
    with pytest.raises(PayloadTooLarge, match=f"max_image_pixels={LIMIT}"):
        probe(data, max_pixels=LIMIT)
    with pytest.raises(PayloadTooLarge):
        decode(data, max_pixels=LIMIT)


def test_truncated_jpeg_is_invalid() -> None:
    data = image_bytes(120, 90, fmt="JPEG")
    truncated = data[: len(data) // 2]
    assert probe(truncated, max_pixels=LIMIT) == (120, 90)  # the header is intact
    with pytest.raises(InvalidImage):
        decode(truncated, max_pixels=LIMIT)


def test_corrupt_png_is_invalid() -> None:
    data = bytearray(image_bytes(50, 40))
    data[60:80] = b"\xff" * 20  # inside the IDAT stream: CRC/zlib errors
    with pytest.raises(InvalidImage):
        decode(bytes(data), max_pixels=LIMIT)


@pytest.mark.parametrize(
    "data",
    [b"", b"not an image at all", np.random.default_rng(0).bytes(4096), b"\x89PNG\r\n\x1a\n"],
    ids=["empty", "text", "random", "png-magic-only"],
)
def test_non_images_are_invalid(data: bytes) -> None:
    with pytest.raises(InvalidImage):
        probe(data, max_pixels=LIMIT)
    with pytest.raises(InvalidImage):
        decode(data, max_pixels=LIMIT)
