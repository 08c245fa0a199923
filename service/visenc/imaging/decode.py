"""Image bytes → RGB ``PIL.Image``, with the pixel limit checked before any decode.

Contract:

- ``probe`` reads only the header (Pillow opens lazily) and returns
  ``(width, height)``; cheap enough to run on every upload before queueing.
- ``decode`` returns a fully loaded RGB image, converted exactly as the
  transformers image processors do with ``do_convert_rgb=True``
  (``to_rgb``), so towers see the same pixels the reference processor sees.
- EXIF orientation is *not* applied: transformers' processors do not apply it,
  and outputs must equal theirs.
- Errors: ``InvalidImage`` for anything that is not a decodable image (empty,
  random, truncated, corrupt, unsupported); ``ImageTooLarge`` when
  ``width * height > max_pixels``, decided from the header alone.

The limit does not rely on Pillow's global ``Image.MAX_IMAGE_PIXELS`` (process
state another library may change); Pillow's own bomb check still fires at
open for absurd sizes, and is reported as ``ImageTooLarge`` too.
"""

from __future__ import annotations

import io

from PIL import Image, UnidentifiedImageError

from visenc.errors import ImageTooLarge, InvalidImage

# What Pillow raises on bad input: header parse errors (SyntaxError from some
# plugins), truncated/corrupt streams (OSError), bad parameters (ValueError),
# odd plugin internals (struct.error is a subclass of Exception; EOFError and
# IndexError have been seen from fuzzed GIF/TIFF headers).
_PIL_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError, KeyError)


def _open(data: bytes, max_pixels: int) -> Image.Image:
    if not data:
        raise InvalidImage("empty image bytes")
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        # Pillow refuses sizes above 2 * MAX_IMAGE_PIXELS at open, before we can
        # read the size: such an image is over any sane limit.
        raise ImageTooLarge(f"image has more pixels than the limit max_image_pixels={max_pixels}") from e
    except UnidentifiedImageError as e:
        raise InvalidImage("unsupported or unrecognised image format") from e
    except _PIL_ERRORS as e:
        raise InvalidImage(f"corrupt image header: {type(e).__name__}") from e
    width, height = image.size
    if width <= 0 or height <= 0:
        raise InvalidImage(f"image has an empty size {width}x{height}")
    if width * height > max_pixels:
        raise ImageTooLarge(
            f"image is {width}x{height} = {width * height} pixels, over the limit max_image_pixels={max_pixels}"
        )
    return image


def probe(data: bytes, *, max_pixels: int) -> tuple[int, int]:
    """``(width, height)`` from the header only; no pixel data is decoded."""
    image = _open(data, max_pixels)
    try:
        return image.size
    finally:
        image.close()


def to_rgb(image: Image.Image) -> Image.Image:
    """Convert to RGB as transformers' ``convert_to_rgb`` does.

    Any transparency (an alpha band, or a ``transparency`` entry in the info
    of P/L/RGB images) is composited onto an opaque white background; other
    modes (L, P, CMYK, I, ...) use Pillow's ``convert("RGB")``. An RGB image
    with no transparency is returned as is (no copy).
    """
    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    if has_alpha:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    if image.mode == "RGB":
        return image
    return image.convert("RGB")


def decode(data: bytes, *, max_pixels: int) -> Image.Image:
    """Fully decoded RGB image (first frame of animations), pixel limit checked first."""
    image = _open(data, max_pixels)
    try:
        image.load()
        rgb = to_rgb(image)
        rgb.load()
    except Image.DecompressionBombError as e:
        image.close()
        raise ImageTooLarge(f"image has more pixels than the limit max_image_pixels={max_pixels}") from e
    except _PIL_ERRORS as e:
        image.close()
        raise InvalidImage(f"corrupt or truncated image data: {type(e).__name__}") from e
    if rgb is not image:
        # release the source (and any multi-frame file handle); ``close`` on
        # the returned image itself would invalidate its pixels
        image.close()
    return rgb
