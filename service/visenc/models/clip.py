"""Fixed-resolution towers: CLIP and SigLIP image embeddings (one row per image)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import (
    CLIPVisionConfig,
    CLIPVisionModelWithProjection,
    SiglipVisionConfig,
    SiglipVisionModel,
)

from visenc.errors import InvalidImage
from visenc.imaging.decode import rgb_like_transformers
from visenc.imaging.preprocess import (
    BICUBIC,
    IMAGENET_STANDARD_MEAN,
    IMAGENET_STANDARD_STD,
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    Normalizer,
    as_tuple,
    center_crop,
    resize,
    shortest_edge_size,
)
from visenc.models import memory
from visenc.models.base import Prepared, TokenLayout, VisionTower
from visenc.models.construct import cast_module, config_fields


@dataclass(frozen=True)
class FixedPreprocess:
    """CLIP/SigLIP image processor settings (units: pixels)."""

    shortest_edge: int | None
    height: int | None
    width: int | None
    crop_height: int | None
    crop_width: int | None
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    rescale_factor: float | None = 1 / 255
    do_normalize: bool = True
    resample: int = BICUBIC
    backend: str = "torchvision"

    @property
    def output_size(self) -> tuple[int, int]:
        if self.crop_height is not None and self.crop_width is not None:
            return self.crop_height, self.crop_width
        if self.height is None or self.width is None:
            raise ValueError("a shortest-edge resize needs a center crop to give a fixed size")
        return self.height, self.width

    @classmethod
    def clip_default(cls) -> FixedPreprocess:
        """``CLIPImageProcessorPil`` defaults (224 short side, 224 crop, bicubic, OpenAI mean/std)."""
        return cls(224, None, None, 224, 224, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)

    @classmethod
    def siglip_default(cls) -> FixedPreprocess:
        """``SiglipImageProcessorPil`` defaults (224x224, bicubic, mean/std 0.5)."""
        return cls(None, 224, 224, None, None, IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD)

    def with_processor_config(self, cfg: dict[str, Any]) -> FixedPreprocess:
        size = cfg.get("size")
        out = self
        if isinstance(size, dict):
            if "shortest_edge" in size:
                out = replace(out, shortest_edge=int(size["shortest_edge"]), height=None, width=None)
            elif "height" in size and "width" in size:
                out = replace(out, shortest_edge=None, height=int(size["height"]), width=int(size["width"]))
        elif isinstance(size, int):
            out = replace(out, shortest_edge=size, height=None, width=None)
        crop = cfg.get("crop_size")
        if cfg.get("do_center_crop", out.crop_height is not None) and crop is not None:
            if isinstance(crop, int):
                crop = {"height": crop, "width": crop}
            out = replace(out, crop_height=int(crop["height"]), crop_width=int(crop["width"]))
        elif cfg.get("do_center_crop") is False:
            out = replace(out, crop_height=None, crop_width=None)
        return replace(
            out,
            image_mean=as_tuple(cfg.get("image_mean", out.image_mean)),
            image_std=as_tuple(cfg.get("image_std", out.image_std)),
            rescale_factor=float(cfg.get("rescale_factor", 1 / 255)) if cfg.get("do_rescale", True) else None,
            do_normalize=bool(cfg.get("do_normalize", out.do_normalize)),
            resample=int(cfg.get("resample", out.resample)),
        )

    def processor_kwargs(self) -> dict[str, Any]:
        size = (
            {"shortest_edge": self.shortest_edge}
            if self.shortest_edge is not None
            else {"height": self.height, "width": self.width}
        )
        crop = self.crop_height is not None
        return {
            "size": size,
            "do_center_crop": crop,
            **({"crop_size": {"height": self.crop_height, "width": self.crop_width}} if crop else {}),
            "image_mean": list(self.image_mean),
            "image_std": list(self.image_std),
            "do_rescale": self.rescale_factor is not None,
            "rescale_factor": self.rescale_factor or 1 / 255,
            "do_normalize": self.do_normalize,
            "resample": self.resample,
        }


class FixedResolutionTower(VisionTower):
    """CLIP or SigLIP as one embedding row per image."""

    packable = False

    def __init__(
        self,
        *,
        name: str,
        model: CLIPVisionModelWithProjection | SiglipVisionModel,
        preprocess: FixedPreprocess,
        source: dict[str, Any],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        config: Any = model.config
        image_size = config.image_size
        if preprocess.output_size != (image_size, image_size):
            raise ValueError(
                f"preprocessing gives {preprocess.output_size} inputs, the model expects {image_size}x{image_size}"
            )
        self.name = name
        module: torch.nn.Module = model  # PreTrainedModel.to's wrapper confuses type checkers
        self.model = cast_module(module, device=device, dtype=dtype).eval()
        self.settings = preprocess
        self.source = source
        self.dtype = dtype
        self.device = device
        self._is_clip = isinstance(model, CLIPVisionModelWithProjection)
        self.hidden_size = int(config.projection_dim if self._is_clip else config.hidden_size)
        self._layout = TokenLayout(num_tokens=1, grid_thw=(1, 1, 1), bucket=preprocess.output_size)
        self._norm = Normalizer(
            preprocess.rescale_factor,
            preprocess.image_mean if preprocess.do_normalize else None,
            preprocess.image_std if preprocess.do_normalize else None,
            fused=preprocess.backend == "torchvision",
        )
        # encoder positions behind the one output row: patches + class token
        self._positions_per_image = (image_size // config.patch_size) ** 2 + 1

    @property
    def image_backend(self) -> str:
        return self.settings.backend

    def layout(self, width: int, height: int) -> TokenLayout:
        if width <= 0 or height <= 0:
            raise InvalidImage(f"image has an empty size {width}x{height}")
        return self._layout

    def preprocess(self, image: Image.Image) -> Prepared:
        """RGB image → ``[C, H, W]`` float32, equal to the processor's ``pixel_values[0]``."""
        image = rgb_like_transformers(image)  # the processor's own do_convert_rgb (no-op on RGB)
        s = self.settings
        width, height = image.size
        if s.shortest_edge is not None:
            target_h, target_w = shortest_edge_size(height, width, s.shortest_edge)
        else:
            assert s.height is not None and s.width is not None
            target_h, target_w = s.height, s.width
        array = resize(image, target_h, target_w, s.resample, s.backend)
        if s.crop_height is not None and s.crop_width is not None:
            array = center_crop(array, s.crop_height, s.crop_width, s.backend)
        return Prepared(pixels=self._norm.channels_first(array), layout=self._layout)

    def forward(self, batch: Sequence[Prepared]) -> list[torch.Tensor]:
        if not batch:
            return []
        pixels = torch.from_numpy(np.stack([p.pixels for p in batch]))
        with torch.inference_mode():
            outputs = self.model(pixel_values=self.to_device(pixels))
            embeds = outputs.image_embeds if self._is_clip else outputs.pooler_output
        return [embeds[i : i + 1] for i in range(len(batch))]

    def fingerprint_fields(self) -> dict[str, Any]:
        return {
            "family": "clip" if self._is_clip else "siglip",
            "source": self.source,
            "config": config_fields(self.model.config),
            "dtype": str(self.dtype),
            "preprocess": asdict(self.settings),
        }

    def input_bytes_per_token(self) -> int:
        height, width = self.settings.output_size
        return 4 * 3 * height * width

    def activation_bytes_per_token(self) -> int:
        config = self.model.config
        item = self.dtype.itemsize
        per_image = self.input_bytes_per_token() * (
            1 + memory.cast_bytes(item) / 4
        ) + self._positions_per_image * memory.block_bytes_per_position(
            config.hidden_size, config.intermediate_size, item
        )
        return int(memory.SAFETY * per_image)

    def forward_bytes(self, layouts: Sequence[TokenLayout]) -> int:
        """Images are stacked, so every image's attention scores are live at once."""
        config = self.model.config
        scores = memory.attention_score_bytes(
            config.num_attention_heads,
            self._positions_per_image,
            self.dtype.itemsize,
            materialised=memory.materialises_scores(config),
        )
        return len(layouts) * (self.activation_bytes_per_token() + int(memory.SAFETY * scores))


def tiny_clip_config() -> CLIPVisionConfig:
    """The peer benchmark's tiny CLIP vision side (infinity ``make_tiny_clip.py``)."""
    return CLIPVisionConfig(
        image_size=224,
        patch_size=16,
        hidden_size=384,
        intermediate_size=1536,
        num_hidden_layers=6,
        num_attention_heads=6,
        projection_dim=256,
    )


def tiny_siglip_config() -> SiglipVisionConfig:
    return SiglipVisionConfig(
        image_size=224,
        patch_size=16,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
    )
