"""Fast numpy preprocessing shared by the towers, bit-identical to transformers' PIL processors."""

from __future__ import annotations

import math
import platform
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image
from torch.nn import functional

from visenc.errors import InvalidImage

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGENET_STANDARD_MEAN = (0.5, 0.5, 0.5)
IMAGENET_STANDARD_STD = (0.5, 0.5, 0.5)
BICUBIC = int(Image.Resampling.BICUBIC)
MAX_ASPECT_RATIO = 200


def smart_resize(height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL target ``(height, width)``: multiples of ``factor``, area within the pixel bounds, aspect kept."""
    if height <= 0 or width <= 0:
        raise InvalidImage(f"image has an empty size {width}x{height}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise InvalidImage(
            f"image aspect ratio {max(height, width) / min(height, width):.1f} is over the limit {MAX_ASPECT_RATIO}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def shortest_edge_size(height: int, width: int, shortest_edge: int) -> tuple[int, int]:
    """``(height, width)`` with the short side ``shortest_edge``, as transformers' ``get_resize_output_image_size``."""
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = shortest_edge, int(shortest_edge * long / short)
    return (new_long, new_short) if width <= height else (new_short, new_long)


#: transformers' backends: ``torchvision`` (fast, what vLLM and SGLang run) and ``pil``; resizes differ up to ~0.2
BACKENDS = ("torchvision", "pil")
_TORCH_MODES = {Image.Resampling.NEAREST: "nearest", Image.Resampling.BILINEAR: "bilinear", BICUBIC: "bicubic"}


def resize(image: Image.Image, height: int, width: int, resample: int = BICUBIC, backend: str = "pil") -> np.ndarray:
    """``(height, width)`` resize → HWC uint8 array (RGB input), as ``backend`` does it."""
    if backend == "pil":
        if image.size != (width, height):
            image = image.resize((width, height), resample=resample)
        return np.asarray(image)
    array = np.asarray(image)
    if array.shape[:2] == (height, width):
        return array
    return resize_tensor(uint8_tensor(array), height, width, resample)[0].permute(1, 2, 0).numpy()


def uint8_tensor(array: np.ndarray) -> torch.Tensor:
    t = torch.from_numpy(np.array(array)).permute(2, 0, 1).unsqueeze(0)
    strides = list(t.stride())
    strides[0] = t.numel()
    return t.as_strided(t.shape, strides)


def resize_tensor(t: torch.Tensor, height: int, width: int, resample: int) -> torch.Tensor:
    if tuple(t.shape[-2:]) == (height, width):
        return t
    mode = _TORCH_MODES.get(resample)  # type: ignore[call-overload]
    if mode is None:
        raise ValueError(f"resample filter {resample} has no torchvision equivalent here; use the pil backend")
    smooth = mode != "nearest"
    native = mode == "nearest" or mode == "bicubic" or _native_uint8_bilinear()
    x = t if native else t.to(torch.float32)
    x = functional.interpolate(
        x, size=[height, width], mode=mode, align_corners=False if smooth else None, antialias=smooth
    )
    if not native:
        if mode == "bicubic":
            x = x.clamp_(0, 255)
        x = x.round_().to(torch.uint8)
    return x


def qwen_pixels_torchvision(
    image: Image.Image,
    height: int,
    width: int,
    *,
    resample: int,
    rescale_factor: float,
    mean: Sequence[float],
    std: Sequence[float],
    patch_size: int,
    merge_size: int,
    temporal_patch_size: int,
) -> np.ndarray:
    """Qwen2-VL ``pixel_values`` bit-identical to the fast processor's."""
    t = resize_tensor(uint8_tensor(np.asarray(image)), height, width, resample)
    x = qwen_patches(t, patch_size=patch_size, merge_size=merge_size, rescale_factor=rescale_factor, mean=mean, std=std)
    n, c, _, p, _ = x.shape
    return x.expand(-1, -1, temporal_patch_size, -1, -1).reshape(n, c * temporal_patch_size * p * p).numpy()


def qwen_patches(
    frames: torch.Tensor,
    *,
    patch_size: int,
    merge_size: int,
    rescale_factor: float,
    mean: Sequence[float],
    std: Sequence[float],
) -> torch.Tensor:
    """``[T, C, H, W]`` uint8 frames of one temporal patch → ``[grid_h * grid_w, C, T, P, P]`` float32 patches."""
    t, c, height, width = frames.shape
    p, m = patch_size, merge_size
    grid_h, grid_w = height // p, width // p
    thwc = frames.permute(0, 2, 3, 1)
    blocks = thwc.reshape(t, grid_h // m, m, p, grid_w // m, m, p, c).permute(1, 4, 2, 5, 7, 0, 3, 6)
    x = torch.empty(grid_h * grid_w, c, t, p, p)
    x.view(grid_h // m, grid_w // m, m, m, c, t, p, p).copy_(blocks)
    scale = 1.0 / rescale_factor
    x.sub_((torch.tensor(mean) * scale).view(1, -1, 1, 1, 1)).div_((torch.tensor(std) * scale).view(1, -1, 1, 1, 1))
    return x


def _native_uint8_bilinear() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") or platform.machine() in ("aarch64", "arm64")


def center_crop(array: np.ndarray, height: int, width: int, backend: str = "pil") -> np.ndarray:
    """Center crop an HWC array to ``(height, width)``, zero-padding where the image is smaller."""
    orig_h, orig_w = array.shape[:2]
    if backend == "torchvision":
        return _center_crop_torchvision(array, height, width)
    top = (orig_h - height) // 2
    left = (orig_w - width) // 2
    if top >= 0 and left >= 0:
        return array[top : top + height, left : left + width]
    new_h, new_w = max(height, orig_h), max(width, orig_w)
    padded = np.zeros((new_h, new_w, *array.shape[2:]), dtype=array.dtype)
    top_pad = math.ceil((new_h - orig_h) / 2)
    left_pad = math.ceil((new_w - orig_w) / 2)
    padded[top_pad : top_pad + orig_h, left_pad : left_pad + orig_w] = array
    top += top_pad
    left += left_pad
    return padded[max(0, top) : min(new_h, top + height), max(0, left) : min(new_w, left + width)]


def _center_crop_torchvision(array: np.ndarray, height: int, width: int) -> np.ndarray:
    orig_h, orig_w = array.shape[:2]
    if height > orig_h or width > orig_w:
        pad_top = (height - orig_h) // 2 if height > orig_h else 0
        pad_left = (width - orig_w) // 2 if width > orig_w else 0
        new_h, new_w = max(height, orig_h), max(width, orig_w)
        padded = np.zeros((new_h, new_w, *array.shape[2:]), dtype=array.dtype)
        padded[pad_top : pad_top + orig_h, pad_left : pad_left + orig_w] = array
        array, orig_h, orig_w = padded, new_h, new_w
    top = (orig_h - height) // 2
    left = (orig_w - width) // 2
    return array[top : top + height, left : left + width]


class Normalizer:
    """uint8 → float32 ``(x * rescale_factor - mean) / std`` per channel, as a lookup table."""

    __slots__ = ("lut", "pairs")

    def __init__(
        self,
        rescale_factor: float | None,
        mean: Sequence[float] | None,
        std: Sequence[float] | None,
        channels: int = 3,
        fused: bool = False,
    ) -> None:
        # transformers' exact op order, so table entries are bit-identical to its outputs
        values: np.ndarray = np.arange(256, dtype=np.float64)
        normalize = mean is not None and std is not None
        if fused and normalize and rescale_factor is not None:
            scale = np.float32(1.0 / rescale_factor)
            table = np.repeat(values.astype(np.float32)[None, :], channels, axis=0)
            mean32 = np.asarray(mean, dtype=np.float32) * scale
            std32 = np.asarray(std, dtype=np.float32) * scale
            table = (table - mean32[:, None]) / std32[:, None]
        else:
            if rescale_factor is not None:
                values = values.astype(np.float32) * np.float32(rescale_factor) if fused else values * rescale_factor
            table = np.repeat(values.astype(np.float32)[None, :], channels, axis=0)
            if normalize:
                table = (table - np.asarray(mean, dtype=np.float32)[:, None]) / np.asarray(std, dtype=np.float32)[
                    :, None
                ]
        self.lut: np.ndarray = np.ascontiguousarray(table, dtype=np.float32)
        self.lut.setflags(write=False)
        # pair table: two uint8 pixels (one uint16) → two float32 (one uint64); half the gathers, 512 KiB/channel
        first, second = np.arange(65536, dtype=np.uint16).view(np.uint8).reshape(-1, 2).T
        pairs = np.stack([self.lut[:, first], self.lut[:, second]], axis=-1)
        self.pairs: np.ndarray = np.ascontiguousarray(pairs).view(np.uint64)[..., 0]
        self.pairs.setflags(write=False)

    def map_into(self, src: np.ndarray, out: np.ndarray) -> None:
        if src.shape != out.shape or not (src.flags.c_contiguous and out.flags.c_contiguous):
            raise ValueError("map_into needs C-contiguous arrays of equal shape")
        if src.shape[-1] % 2 == 0:
            src, out, table = src.view(np.uint16), out.view(np.uint64), self.pairs
        else:
            table = self.lut
        for c in range(src.shape[1]):
            # mode="wrap": no bounds checks or output buffering; indices are always in range
            np.take(table[c], src[:, c], out=out[:, c], mode="wrap")

    def channels_first(self, array: np.ndarray) -> np.ndarray:
        planes = np.ascontiguousarray(array.transpose(2, 0, 1))[None]
        out = np.empty(planes.shape, dtype=np.float32)
        self.map_into(planes, out)
        return out[0]


def qwen_patchify(
    array: np.ndarray, norm: Normalizer, *, patch_size: int, merge_size: int, temporal_patch_size: int
) -> np.ndarray:
    """HWC uint8 → Qwen2-VL ``pixel_values`` ``[grid_h * grid_w, C * T * P * P]`` float32."""
    height, width, channels = array.shape
    p, m, t = patch_size, merge_size, temporal_patch_size
    grid_h, grid_w = height // p, width // p
    if grid_h * p != height or grid_w * p != width or grid_h % m or grid_w % m:
        raise ValueError(f"image {width}x{height} is not a multiple of patch {p} x merge {m}")
    blocks = array.reshape(grid_h // m, m, p, grid_w // m, m, p, channels).transpose(0, 3, 1, 4, 6, 2, 5)
    blocks = np.ascontiguousarray(blocks).reshape(grid_h * grid_w, channels, p, p)
    values = np.empty((grid_h * grid_w, channels, p, p), dtype=np.float32)
    norm.map_into(blocks, values)
    out = np.empty((grid_h * grid_w, channels, t, p, p), dtype=np.float32)
    out[:] = values[:, :, None]
    return out.reshape(grid_h * grid_w, channels * t * p * p)


def as_tuple(values: float | Sequence[float], channels: int = 3) -> tuple[float, ...]:
    if isinstance(values, (int, float)):
        return (float(values),) * channels
    return tuple(float(v) for v in values)
