"""Image bytes to an RGB ``PIL.Image``, loaded exactly as the serving engine's loader loads it."""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass

from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

from visenc.errors import ImageTooLarge, InvalidImage

# what Pillow raises on bad input (EOFError, IndexError: seen from fuzzed GIF/TIFF headers)
_PIL_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError, KeyError)


def _open(data: bytes, max_pixels: int, formats: tuple[str, ...] | None = None) -> Image.Image:
    if not data:
        raise InvalidImage("empty image bytes")
    try:
        image = Image.open(io.BytesIO(data), formats=formats)
    except Image.DecompressionBombError as e:
        # Pillow refuses sizes above 2 * MAX_IMAGE_PIXELS at open, before the size can be read
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


#: peak host bytes per source pixel of decoding and preprocessing (``bench/bench_memory.py --decode``): the
#: highest of 13 runs and 2-4 above it, as where the heap places the buffers moves a peak by 2-5 a pixel
DECODE_BYTES_PER_PIXEL = {"opaque": 20, "transparent": 25, "webp": 32}


@dataclass(frozen=True, slots=True)
class Header:
    #: the size of the picture the loader decodes (turned for EXIF orientations 5-8 where it applies them)
    width: int
    height: int
    decode_bytes_per_pixel: int


def read_header(data: bytes, *, max_pixels: int, loader: str = "vllm") -> Header:
    """The picture ``loader`` will decode, from the header only (no pixel data is decoded)."""
    how = LOADERS[loader]
    image = _open(data, max_pixels, how.formats)
    try:
        width, height = image.size
        if how.upright and _orientation(image) in (5, 6, 7, 8):  # a quarter turn: the sides swap
            width, height = height, width
        kind = "webp" if image.format == "WEBP" else "transparent" if _transparent(image) else "opaque"
        return Header(width, height, DECODE_BYTES_PER_PIXEL[kind])
    finally:
        image.close()


def probe(data: bytes, *, max_pixels: int, loader: str = "vllm") -> tuple[int, int]:
    header = read_header(data, max_pixels=max_pixels, loader=loader)
    return header.width, header.height


def _transparent(image: Image.Image) -> bool:
    return "A" in image.getbands() or image.mode in ("PA", "La", "RGBa") or "transparency" in image.info


def _orientation(image: Image.Image) -> int:
    try:
        return int(image.getexif().get(ExifTags.Base.Orientation, 1))
    except Exception:
        return 1


#: vLLM 0.32's ``ALLOWED_IMAGE_FORMATS`` (``vllm/multimodal/image.py``): the formats its loader opens
VLLM_FORMATS = (
    *("AVIF", "BLP", "BMP", "CUR", "DCX", "DDS", "DIB", "FITS", "FLI", "FTEX", "GBR", "GIF", "ICNS", "ICO"),
    *("IM", "IMT", "IPTC", "JPEG", "JPEG2000", "MCIDAS", "MSP", "PCD", "PCX", "PIXAR", "PNG", "PPM", "PSD"),
    *("QOI", "SGI", "SPIDER", "SUN", "TGA", "TIFF", "WEBP", "XBM", "XPM", "XVTHUMB"),
)


_TURNED = frozenset(range(2, 9))


def exif_upright(image: Image.Image) -> Image.Image:
    """``ImageOps.exif_transpose``, any failure of it ignored (vLLM's ``normalize_image``)."""
    try:
        if image.getexif().get(ExifTags.Base.Orientation, 1) not in _TURNED:
            return image
        return ImageOps.exif_transpose(image)
    except Exception:
        return image


def rgb_like_vllm(image: Image.Image) -> Image.Image:
    """vLLM's ``ImageMediaIO._convert_image_mode``: RGB as is; anything with transparency pasted onto white."""
    if image.mode == "RGB":
        return _opaque(image)
    if image.mode not in ("RGBA", "LA", "PA") and "transparency" not in image.info:
        return image.convert("RGB")
    rgba = image if image.mode == "RGBA" else image.convert("RGBA")
    converted = Image.new("RGB", rgba.size, (255, 255, 255))
    converted.paste(rgba, mask=rgba.split()[3])
    return converted


def rgb_like_sglang(image: Image.Image) -> Image.Image:
    """SGLang's encoder loader: ``convert("RGB")`` for every other mode (alpha dropped), no EXIF orientation."""
    return _opaque(image if image.mode == "RGB" else image.convert("RGB"))


def _opaque(rgb: Image.Image) -> Image.Image:
    rgb.info.pop("transparency", None)
    return rgb


def rgb_like_transformers(image: Image.Image) -> Image.Image:
    """transformers' ``convert_to_rgb``: any transparency composited onto white, other modes ``convert("RGB")``."""
    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    if has_alpha:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


@dataclass(frozen=True, slots=True)
class Loader:
    name: str
    version: str
    to_rgb: Callable[[Image.Image], Image.Image]
    formats: tuple[str, ...] | None = None
    upright: bool = False

    @property
    def label(self) -> str:
        return f"{self.name}-{self.version}"


#: how each serving engine turns a file into RGB (``--image-loader``; ``label`` is in the fingerprint)
LOADERS = {
    "vllm": Loader("vllm", "0.32", rgb_like_vllm, formats=VLLM_FORMATS, upright=True),
    "sglang": Loader("sglang", "0.5.23", rgb_like_sglang),
    "transformers": Loader("transformers", "5", rgb_like_transformers),
}


def loads_alike(data: bytes, loaders: tuple[str, str], *, max_pixels: int) -> bool:
    """Whether both ``loaders`` turn this file into the same RGB image, judged from its header alone."""
    first, second = (LOADERS[name] for name in loaders)
    image = _open(data, max_pixels)
    try:
        if any(how.formats is not None and image.format not in how.formats for how in (first, second)):
            return False
        if first.upright != second.upright and _orientation(image) != 1:
            return False
        return not _transparent(image)
    finally:
        image.close()


def decode(data: bytes, *, max_pixels: int, loader: str = "vllm") -> Image.Image:
    """Fully decoded RGB image (first frame of an animation), loaded as ``loader``'s engine loads it."""
    how = LOADERS[loader]
    image = _open(data, max_pixels, how.formats)
    try:
        image.load()  # all of it, before the EXIF look (which would swallow a broken stream's error)
        rgb = how.to_rgb(exif_upright(image) if how.upright else image)
        rgb.load()
    except Image.DecompressionBombError as e:
        image.close()
        raise ImageTooLarge(f"image has more pixels than the limit max_image_pixels={max_pixels}") from e
    except _PIL_ERRORS as e:
        image.close()
        raise InvalidImage(f"corrupt or truncated image data: {type(e).__name__}") from e
    if rgb is not image:
        # release the source; ``close`` on the returned image would invalidate its pixels
        image.close()
    return rgb
