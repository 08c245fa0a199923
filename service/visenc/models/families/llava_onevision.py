"""LLaVA-OneVision: AnyRes tiles plus a base tile, SigLIP features, the MLP projector, then unpadding."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import torch

from visenc.models.base import TokenLayout
from visenc.models.registry import vlm_families
from visenc.models.vlm import FamilyTower, cat


class LlavaOnevisionTower(FamilyTower):
    family = "llava_onevision"
    model_types = ("llava_onevision",)
    processor_class = "LlavaOnevisionProcessor"
    base_model = "LlavaOnevisionModel"
    input_names = ("pixel_values", "image_sizes")
    host_inputs = ("image_sizes",)  # the tile counts and the unpadding read them (``.tolist()``)

    @classmethod
    def vision_modules(cls, config: Any) -> dict[str, Any]:
        from transformers import AutoModel
        from transformers.models.llava_onevision.modeling_llava_onevision import LlavaOnevisionMultiModalProjector

        hidden = config.text_config.hidden_size
        keep_lengths_on_host()
        return {
            "vision_tower": AutoModel.from_config(config.vision_config),
            "multi_modal_projector": LlavaOnevisionMultiModalProjector(config),
            "image_newline": torch.nn.Parameter(torch.empty(hidden)),
        }

    def layout(self, width: int, height: int) -> TokenLayout:
        """``LlavaOnevisionProcessor._get_number_of_features``, run on this tower's settings."""
        from transformers import LlavaOnevisionProcessor
        from transformers.models.llava_onevision.modeling_llava_onevision import image_size_to_num_patches

        self.check_size(width, height)
        size = self.vision_config.image_size
        side = size // self.vision_config.patch_size
        counter = SimpleNamespace(
            image_processor=self.processor,
            num_image_tokens=side * side,
            vision_aspect_ratio=self.config.vision_aspect_ratio,
        )
        counter._get_unpadded_features = lambda *a: LlavaOnevisionProcessor._get_unpadded_features(counter, *a)
        rows = LlavaOnevisionProcessor._get_number_of_features(counter, height, width, size, size)
        tiles = image_size_to_num_patches((height, width), self.config.image_grid_pinpoints, size)
        return TokenLayout(int(rows), (int(tiles), side, side), "tiles")

    def collate(self, inputs: Any) -> dict[str, torch.Tensor]:
        # one image's tiles are ``[1, tiles, C, H, W]``; the batch is every tile, image after image
        return {
            "pixel_values": cat([x["pixel_values"][0] for x in inputs]),
            "image_sizes": cat([x["image_sizes"] for x in inputs]),
        }

    def feature_kwargs(self, inputs: dict[str, torch.Tensor]) -> dict[str, Any]:
        c = self.config
        return {
            **inputs,
            "vision_feature_layer": c.vision_feature_layer,
            "vision_feature_select_strategy": c.vision_feature_select_strategy,
            "vision_aspect_ratio": c.vision_aspect_ratio,
            "batch_num_images": None,
        }

    def forward_bytes(self, layouts: Any) -> int:
        # tiles are stacked, plus the unpadding's per-image copies of the projected grid
        extra = sum(4 * lay.num_tokens * self.hidden_size * self.dtype.itemsize for lay in layouts)
        return super().forward_bytes(layouts) + math.ceil(extra)


class _LengthsOnHost:
    """``torch`` as ``modeling_llava_onevision`` sees it, except that a tensor made from a list of ints stays on
    the host: ``pack_image_features`` makes its per-image lengths into one on the features' device, a blocking
    copy that waits for the device, and ``get_image_features`` drops them."""

    def __init__(self, module: Any) -> None:
        self._torch = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)

    def tensor(self, data: Any, *args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        if isinstance(data, list) and all(type(x) is int for x in data):
            device = None
        return self._torch.tensor(data, *args, device=device, **kwargs)


def keep_lengths_on_host() -> None:
    from transformers.models.llava_onevision import modeling_llava_onevision as modeling

    if not isinstance(modeling.torch, _LengthsOnHost):
        modeling.torch = _LengthsOnHost(modeling.torch)  # type: ignore[assignment]


FAMILIES = vlm_families(LlavaOnevisionTower)
