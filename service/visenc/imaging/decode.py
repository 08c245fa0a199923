"""Image bytes → RGB ``PIL.Image``, with the pixel limit checked before any decode.

Contract:

- ``probe`` reads only the header (Pillow opens lazily) and returns
  ``(width, height)``; cheap enough to run on every upload before queueing.
- ``decode`` returns a fully loaded RGB image, converted exactly as the serving
  engine's loader converts it before its processor runs (``LOADERS``: vLLM by
  default, SGLang, or a bare transformers processor), so the rows equal the
  engine's own.
- EXIF orientation is *not* applied: neither the engines' loaders nor
  transformers' processors apply it, and outputs must equal theirs.
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


def rgb_like_vllm(image: Image.Image) -> Image.Image:
    """vLLM's loader (``ImageMediaIO``): RGB as it is; RGBA pasted onto white through its alpha;
    every other mode through ``convert("RGB")`` (so the alpha of LA, and of a palette with
    transparency, is dropped, not composited)."""
    if image.mode == "RGB":
        return image
    if image.mode == "RGBA":
        converted = Image.new("RGB", image.size, (255, 255, 255))
        converted.paste(image, mask=image.split()[3])
        return converted
    return _opaque(image.convert("RGB"))


def rgb_like_sglang(image: Image.Image) -> Image.Image:
    """SGLang's loader: every mode that is not RGB through ``convert("RGB")`` (RGBA's alpha dropped too)."""
    return image if image.mode == "RGB" else _opaque(image.convert("RGB"))


def _opaque(rgb: Image.Image) -> Image.Image:
    """``convert("RGB")`` of a palette image with transparency keeps the transparent colour as
    ``info["transparency"]``; the engines' processors (transformers 5.19, vLLM 0.32's) ignore it on an
    RGB image, while newer ones composite it onto white. The loaders drop the alpha: so must the image."""
    rgb.info.pop("transparency", None)
    return rgb


def rgb_like_transformers(image: Image.Image) -> Image.Image:
    """transformers' ``convert_to_rgb`` (a processor handed the image as the file holds it):
    any transparency (an alpha band, or a ``transparency`` entry of P/L/RGB images) is
    composited onto opaque white; other modes use ``convert("RGB")``."""
    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    if has_alpha:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


#: how each serving engine turns a decoded file into the RGB image its processor sees
#: (``--image-loader``; part of the model fingerprint: rows differ where these differ)
LOADERS = {"vllm": rgb_like_vllm, "sglang": rgb_like_sglang, "transformers": rgb_like_transformers}


def decode(data: bytes, *, max_pixels: int, loader: str = "vllm") -> Image.Image:
    """Fully decoded RGB image, converted as ``loader``'s engine converts it (``LOADERS``);
    the first frame of an animation (GIF, WebP, APNG), as every engine's loader takes it;
    no EXIF rotation (no engine applies it). The pixel limit is checked before decoding."""
    to_rgb = LOADERS[loader]
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
