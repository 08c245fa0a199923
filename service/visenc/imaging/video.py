"""Video preprocessing for the Qwen-VL towers, cut into 2-frame tubes, equal to transformers' video processors."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
import torch

from visenc.errors import InvalidImage, InvalidVideo
from visenc.imaging.preprocess import (
    BICUBIC,
    IMAGENET_STANDARD_MEAN,
    IMAGENET_STANDARD_STD,
    MAX_ASPECT_RATIO,
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    as_tuple,
    qwen_patches,
    resize_tensor,
    smart_resize,
)

#: whose frame resize a tower follows: ``qwen2`` per frame, ``qwen3`` from a pixel budget over the clip
Rule = Literal["qwen2", "qwen3"]


@dataclass(frozen=True)
class VideoPreprocess:
    """The video processor settings that change a tube's input (units: pixels)."""

    rule: Rule
    min_pixels: int
    max_pixels: int
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    rescale_factor: float
    resample: int = BICUBIC
    #: qwen-vl-utils' per-frame share of a whole-clip budget: makes the target depend on the frame count
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 128000

    @classmethod
    def defaults(cls, rule: Rule) -> VideoPreprocess:
        if rule == "qwen2":
            return cls("qwen2", 128 * 28 * 28, 28 * 28 * 768, 14, 2, 2, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, 1 / 255)
        return cls(
            "qwen3",
            128 * 32 * 32,
            32 * 32 * 768,
            16,
            2,
            2,
            IMAGENET_STANDARD_MEAN,
            IMAGENET_STANDARD_STD,
            1 / 255,
            max_video_tokens=768,
        )

    @classmethod
    def from_config(cls, rule: Rule, cfg: Mapping[str, Any]) -> VideoPreprocess:
        base = cls.defaults(rule)
        if cfg.get("do_resize") is False or cfg.get("do_rescale") is False or cfg.get("do_normalize") is False:
            raise ValueError("video processors without resize, rescale or normalise are not supported")
        size = dict(cfg.get("size") or {})
        if rule == "qwen2":
            if cfg.get("min_pixels") is not None:
                size["shortest_edge"] = cfg["min_pixels"]
            if cfg.get("max_pixels") is not None:
                size["longest_edge"] = cfg["max_pixels"]
        cap = cfg.get("cap_pixels_per_frame")
        return replace(
            base,
            min_pixels=int(size.get("shortest_edge") or base.min_pixels),
            max_pixels=int(size.get("longest_edge") or base.max_pixels),
            patch_size=int(cfg.get("patch_size") or base.patch_size),
            merge_size=int(cfg.get("merge_size") or base.merge_size),
            temporal_patch_size=int(cfg.get("temporal_patch_size") or base.temporal_patch_size),
            image_mean=as_tuple(cfg.get("image_mean", base.image_mean)),
            image_std=as_tuple(cfg.get("image_std", base.image_std)),
            rescale_factor=float(cfg.get("rescale_factor", base.rescale_factor)),
            resample=int(cfg.get("resample", base.resample)),
            cap_pixels_per_frame=bool(cap),
            max_video_tokens=int(cfg.get("max_video_tokens") or base.max_video_tokens),
        )

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def target(self, num_frames: int, height: int, width: int) -> tuple[int, int]:
        """The ``(height, width)`` every frame of a ``num_frames``-frame clip is resized to."""
        if num_frames < 1 or height <= 0 or width <= 0:
            raise InvalidImage(f"video has an empty size {num_frames}x{width}x{height}")
        factor, t = self.factor, self.temporal_patch_size
        if self.rule == "qwen2":
            max_pixels = self.max_pixels
            if self.cap_pixels_per_frame:
                total = int(self.max_video_tokens * factor * factor * 0.9)
                max_pixels = max(min(max_pixels, total * t // num_frames), int(self.min_pixels * 1.05))
            return smart_resize(height, width, factor=factor, min_pixels=self.min_pixels, max_pixels=max_pixels)
        max_pixels = self.max_pixels
        if self.cap_pixels_per_frame:
            per_frame = min(self.max_video_tokens * factor * factor, self.max_pixels // num_frames)
            max_pixels = max(per_frame, int(self.min_pixels * 1.05)) * num_frames
        return clip_resize(num_frames, height, width, t, factor, self.min_pixels, max_pixels)

    def grid(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        h, w = self.target(num_frames, height, width)
        t = self.temporal_patch_size
        return -(-num_frames // t), h // self.patch_size, w // self.patch_size

    def tube_tokens(self, grid: tuple[int, int, int]) -> int:
        return grid[1] * grid[2] // (self.merge_size * self.merge_size)

    def cut(self, frames: np.ndarray) -> tuple[list[torch.Tensor], tuple[int, int, int]]:
        """``[T, H, W, 3]`` uint8 frames → each tube's two resized ``[2, C, H, W]`` frames, and the clip's grid."""
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
            raise ValueError(f"frames must be [T, H, W, 3] uint8, got {frames.shape} {frames.dtype}")
        num_frames, height, width = frames.shape[:3]
        grid = self.grid(num_frames, height, width)
        p, t = self.patch_size, self.temporal_patch_size
        clip = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).contiguous()
        clip = resize_tensor(clip, grid[1] * p, grid[2] * p, self.resample)
        if pad := -num_frames % t:  # an odd last frame is paired with itself
            clip = torch.cat([clip, clip[-1:].expand(pad, -1, -1, -1)])
        return [clip[i * t : (i + 1) * t].clone() for i in range(grid[0])], grid

    def tube_pixels(self, tube: torch.Tensor) -> np.ndarray:
        """One tube's resized frames → its rows of the video processor's ``pixel_values_videos``."""
        x = qwen_patches(
            tube,
            patch_size=self.patch_size,
            merge_size=self.merge_size,
            rescale_factor=self.rescale_factor,
            mean=self.image_mean,
            std=self.image_std,
        )
        return x.reshape(x.shape[0], -1).numpy()

    def tubes(self, frames: np.ndarray) -> tuple[list[np.ndarray], tuple[int, int, int]]:
        cut, grid = self.cut(frames)
        return [self.tube_pixels(tube) for tube in cut], grid

    def key(self, tube: torch.Tensor, grid_hw: tuple[int, int]) -> str:
        """A tube's key: SHA-256 of its resized frames, its grid and these settings."""
        h = hashlib.sha256(b"visenc-tube\0%d,%d\0" % grid_hw + repr(self).encode() + b"\0")
        h.update(tube.contiguous().numpy().data)
        return h.hexdigest()


def clip_resize(
    num_frames: int, height: int, width: int, temporal_factor: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Qwen3-VL's video ``smart_resize``: a clip's target from a pixel budget over its frames."""
    if num_frames < temporal_factor:
        raise InvalidImage(f"a video needs at least {temporal_factor} frames here, got {num_frames}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise InvalidImage(
            f"video aspect ratio {max(height, width) / min(height, width):.1f} is over the limit {MAX_ASPECT_RATIO}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def video_config(files: Mapping[str, Mapping[str, Any] | None]) -> dict[str, Any]:
    """The video processor dict transformers' ``AutoVideoProcessor`` reads from a checkpoint."""
    nested = files.get("processor_config.json") or {}
    if isinstance(nested.get("video_processor"), Mapping):
        return dict(nested["video_processor"])
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        if files.get(name):
            return dict(files[name] or {})
    return {}


RULES: dict[str, Rule] = {"Qwen2VLVideoProcessor": "qwen2", "Qwen3VLVideoProcessor": "qwen3"}


def video_rule(cfg: Mapping[str, Any], default: Rule) -> Rule | None:
    """Whose video processor a checkpoint's settings resolve to, in ``AutoVideoProcessor``'s order."""
    name = cfg.get("video_processor_type")
    if name is None and isinstance(cfg.get("image_processor_type"), str):
        inferred = cfg["image_processor_type"].replace("ImageProcessor", "VideoProcessor")
        name = inferred if inferred in RULES else None
    return default if name is None else RULES.get(name)


def frames_array(frames: Sequence[np.ndarray]) -> np.ndarray:
    sizes = {f.shape for f in frames}
    if len(sizes) != 1:
        raise InvalidVideo(f"a video's frames must share one size, got {sorted(sizes)}")
    return np.stack(frames)
