"""Qwen2-VL / Qwen2.5-VL vision towers: variable resolution, packable."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from PIL import Image
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig

from visenc.imaging.decode import rgb_like_transformers
from visenc.imaging.preprocess import (
    BICUBIC,
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    Normalizer,
    as_tuple,
    qwen_patchify,
    qwen_pixels_torchvision,
    resize,
    smart_resize,
)
from visenc.models import memory, varlen
from visenc.models.base import Prepared, Rows, Segment, TokenLayout, VisionTower
from visenc.models.construct import cast_module, config_fields

log = logging.getLogger(__name__)

#: default resize ceiling for the service: 1280 merged tokens (≈1.0 Mpx), as Qwen2-VL's processor
DEFAULT_MAX_PIXELS = 1280 * 28 * 28
DEFAULT_MIN_PIXELS = 56 * 56


@dataclass(frozen=True)
class QwenPreprocess:
    """The ``Qwen2VLImageProcessor`` settings that change the pixels (units: pixels)."""

    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    rescale_factor: float | None = 1 / 255
    do_normalize: bool = True
    resample: int = BICUBIC
    backend: str = "torchvision"

    @classmethod
    def from_processor_config(cls, cfg: dict[str, Any]) -> QwenPreprocess:
        size = cfg.get("size") or {}
        base = cls(max_pixels=28 * 28 * 1280)  # the processor's own default, not the service's
        min_pixels = cfg.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels")
        max_pixels = cfg.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels")
        return replace(
            base,
            min_pixels=int(min_pixels or base.min_pixels),
            max_pixels=int(max_pixels or base.max_pixels),
            patch_size=int(cfg.get("patch_size", base.patch_size)),
            merge_size=int(cfg.get("merge_size", base.merge_size)),
            temporal_patch_size=int(cfg.get("temporal_patch_size", base.temporal_patch_size)),
            image_mean=as_tuple(cfg.get("image_mean", base.image_mean)),
            image_std=as_tuple(cfg.get("image_std", base.image_std)),
            rescale_factor=float(cfg.get("rescale_factor", 1 / 255)) if cfg.get("do_rescale", True) else None,
            do_normalize=bool(cfg.get("do_normalize", True)),
            resample=int(cfg.get("resample", base.resample)),
        )

    def processor_kwargs(self) -> dict[str, Any]:
        return {
            "size": {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels},
            "patch_size": self.patch_size,
            "merge_size": self.merge_size,
            "temporal_patch_size": self.temporal_patch_size,
            "image_mean": list(self.image_mean),
            "image_std": list(self.image_std),
            "do_rescale": self.rescale_factor is not None,
            "rescale_factor": self.rescale_factor or 1 / 255,
            "do_normalize": self.do_normalize,
            "resample": self.resample,
        }


#: on a CPU, images with more patches than this get a forward of their own (see ``forward``)
CPU_PACK_MAX_PATCHES = 512


class QwenVisionTower(VisionTower):
    packable = True
    video_rule = "qwen2"

    def __init__(
        self,
        *,
        name: str,
        model: torch.nn.Module,
        preprocess: QwenPreprocess,
        source: dict[str, Any],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        config: Any = model.config
        if preprocess.patch_size != config.patch_size or preprocess.merge_size != config.spatial_merge_size:
            raise ValueError(
                f"preprocessing patch/merge {preprocess.patch_size}/{preprocess.merge_size} do not match the "
                f"model's {config.patch_size}/{config.spatial_merge_size}"
            )
        if preprocess.temporal_patch_size != config.temporal_patch_size:
            raise ValueError("preprocessing temporal_patch_size does not match the model's")
        self.name = name
        self.model: torch.nn.Module = cast_module(model, device=device, dtype=dtype).eval()
        self.settings = preprocess
        self.source = source
        self.dtype = dtype
        self.device = device
        # Qwen2-VL: merger width is ``hidden_size``; Qwen2.5-VL: ``out_hidden_size``
        self.hidden_size = int(getattr(config, "out_hidden_size", None) or config.hidden_size)
        self._embed_dim = int(getattr(config, "embed_dim", None) or config.hidden_size)
        self._factor = preprocess.patch_size * preprocess.merge_size
        self._norm = Normalizer(
            preprocess.rescale_factor,
            preprocess.image_mean if preprocess.do_normalize else None,
            preprocess.image_std if preprocess.do_normalize else None,
            fused=preprocess.backend == "torchvision",
        )
        self._attention = str(config._attn_implementation)
        self.use_varlen(True)
        log.info("%s: attention on %s", name, self.attention_kernel)

    def use_varlen(self, enabled: bool) -> None:
        """Packed forwards with batch metadata computed on the CPU (``models/varlen.py``); off: the model's own path."""
        if enabled:
            varlen.register()
        self.varlen = enabled
        self.model.config._attn_implementation = varlen.VARLEN if enabled else self._attention

    @property
    def attention_kernel(self) -> str:
        if not self.varlen:
            return self._attention
        return varlen.kernel_for(
            varlen.device_key(self.device), self.dtype, self._embed_dim // self.model.config.num_heads
        )

    def _resized(self, width: int, height: int) -> tuple[int, int]:
        s = self.settings
        return smart_resize(height, width, factor=self._factor, min_pixels=s.min_pixels, max_pixels=s.max_pixels)

    @property
    def image_backend(self) -> str:
        return self.settings.backend

    def video_geometry(self) -> dict[str, int]:
        s = self.settings
        return {"patch_size": s.patch_size, "merge_size": s.merge_size, "temporal_patch_size": s.temporal_patch_size}

    def layout(self, width: int, height: int) -> TokenLayout:
        resized_h, resized_w = self._resized(width, height)
        p, m = self.settings.patch_size, self.settings.merge_size
        grid = (1, resized_h // p, resized_w // p)
        return TokenLayout(num_tokens=grid[1] * grid[2] // (m * m), grid_thw=grid, bucket=grid)

    def span(self, width: int, height: int) -> list[Segment]:
        return ["<|vision_start|>", Rows(self.layout(width, height).num_tokens), "<|vision_end|>"]

    def preprocess(self, image: Image.Image) -> Prepared:
        """RGB image → the processor's ``pixel_values`` for it, ``[grid_h * grid_w, C * T * P * P]`` float32."""
        image = rgb_like_transformers(image)  # the processor's own do_convert_rgb (no-op on RGB)
        width, height = image.size
        layout = self.layout(width, height)
        s = self.settings
        _, grid_h, grid_w = layout.grid_thw
        height, width = grid_h * s.patch_size, grid_w * s.patch_size
        if s.backend == "torchvision" and s.rescale_factor is not None and s.do_normalize:
            pixels = qwen_pixels_torchvision(
                image,
                height,
                width,
                resample=s.resample,
                rescale_factor=s.rescale_factor,
                mean=s.image_mean,
                std=s.image_std,
                patch_size=s.patch_size,
                merge_size=s.merge_size,
                temporal_patch_size=s.temporal_patch_size,
            )
            return Prepared(pixels=pixels, layout=layout)
        array = resize(image, height, width, s.resample, s.backend)
        pixels = qwen_patchify(
            array,
            self._norm,
            patch_size=s.patch_size,
            merge_size=s.merge_size,
            temporal_patch_size=s.temporal_patch_size,
        )
        return Prepared(pixels=pixels, layout=layout)

    def forward_groups(self, batch: Sequence[Prepared]) -> list[list[int]]:
        """One packed forward for the batch, except where the device is the host (``docs/internals.md``)."""
        if self.runtime.separate_memory:
            return super().forward_groups(batch)
        groups: list[list[int]] = []
        small: list[int] = []
        for i, p in enumerate(batch):
            if p.pixels.shape[0] <= CPU_PACK_MAX_PATCHES:
                small.append(i)
                continue
            groups += [small, [i]] if small else [[i]]
            small = []
        return [*groups, small] if small else groups

    def forward(self, batch: Sequence[Prepared]) -> list[torch.Tensor]:
        return [out for g in self.forward_groups(batch) for out in self._forward_packed([batch[i] for i in g])]

    @property
    def input_dtype(self) -> torch.dtype:
        return self.dtype  # transformers' first step: ``pixel_values.type(self.visual.dtype)``

    def _forward_packed(self, batch: Sequence[Prepared]) -> list[torch.Tensor]:
        if not batch:
            return []
        # each image's staged buffer is copied to the device as it is: the packing is the device's own cat
        inputs = [self.to_device(torch.as_tensor(p.pixels)) for p in batch]
        pixels = inputs[0] if len(inputs) == 1 else torch.cat(inputs)
        grid = [p.layout.grid_thw for p in batch]
        if self.varlen:  # grid_thw stays on the CPU: the forward reads only the precomputed metadata
            extra = varlen.packed_kwargs(self.model.config, grid, self.device)
            grid_thw = torch.tensor(grid, dtype=torch.long)
        else:
            extra, grid_thw = {}, torch.tensor(grid, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            out = self.model(pixels, grid_thw=grid_thw, **extra).pooler_output
        return list(torch.split(out, [p.layout.num_tokens for p in batch]))

    def fingerprint_fields(self) -> dict[str, Any]:
        return {
            "family": "qwen2-vl",
            "source": self.source,
            "config": config_fields(self.model.config),
            "dtype": str(self.dtype),
            "preprocess": asdict(self.settings),
        }

    def input_bytes_per_token(self) -> int:
        c = int(getattr(self.model.config, "in_channels", None) or getattr(self.model.config, "in_chans", 3))
        s = self.settings
        return 4 * c * s.temporal_patch_size * s.patch_size * s.patch_size

    def activation_bytes_per_token(self) -> int:
        config = self.model.config
        item = self.dtype.itemsize
        mlp_dim = int(getattr(config, "intermediate_size", 0) or self._embed_dim * config.mlp_ratio)
        gated = hasattr(config, "intermediate_size")  # Qwen2.5-VL: gated SiLU MLP
        head_dim = self._embed_dim // config.num_heads
        per_patch = (
            self.input_bytes_per_token() * (1 + memory.cast_bytes(item) / 4)
            + memory.block_bytes_per_position(self._embed_dim, mlp_dim, item, gated=gated)
            + 4 * head_dim * 4  # rotary cos and sin, float32, twice (q and k)
            + 2 * self._embed_dim * item  # merger: merged input and its MLP hidden, per patch
        )
        return int(memory.SAFETY * per_patch)

    def forward_bytes(self, layouts: Sequence[TokenLayout]) -> int:
        """Linear in the patches: the varlen kernels hold no scores."""
        if not layouts:
            return 0
        seqs = [self.input_tokens(lay) for lay in layouts]
        linear = self.activation_bytes_per_token() * sum(seqs)
        if self.varlen:
            return linear
        scores = memory.attention_score_bytes(
            self.model.config.num_heads,
            max(seqs),
            self.dtype.itemsize,
            materialised=memory.materialises_scores(self.model.config),
        )
        return linear + int(memory.SAFETY * scores)


def tiny_qwen2_vl_config() -> Qwen2VLVisionConfig:
    """The built-in default: Qwen2-VL's vision architecture, downsized for CPU."""
    return Qwen2VLVisionConfig(
        depth=4,
        embed_dim=128,
        hidden_size=256,
        mlp_ratio=4,
        num_heads=4,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )


def tiny_qwen2_5_vl_config() -> Qwen2_5_VLVisionConfig:
    """Qwen2.5-VL's vision architecture (windowed attention, RMSNorm, gated MLP), downsized."""
    return Qwen2_5_VLVisionConfig(
        depth=4,
        hidden_size=128,
        intermediate_size=512,
        num_heads=4,
        out_hidden_size=256,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=[1, 3],
    )
