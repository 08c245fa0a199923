"""InternVL (transformers' ``-hf`` format): the image is cut into square tiles (plus a thumbnail) as
``InternVLProcessor`` does (``crop_to_patches``), each tile runs the ViT, the CLS token is dropped
(``vision_feature_select_strategy``), pixel shuffle, then the MLP projector."""

from __future__ import annotations

from typing import Any

import torch

from visenc.models.base import Rows, Segment, TokenLayout
from visenc.models.registry import vlm_families
from visenc.models.vlm import FamilyTower


class InternVLTower(FamilyTower):
    family = "internvl"
    model_types = ("internvl",)
    processor_class = "InternVLProcessor"
    base_model = "InternVLModel"

    @classmethod
    def vision_modules(cls, config: Any) -> dict[str, torch.nn.Module]:
        from transformers import AutoModel
        from transformers.models.internvl.modeling_internvl import InternVLMultiModalProjector

        return {
            "vision_tower": AutoModel.from_config(config.vision_config),
            "multi_modal_projector": InternVLMultiModalProjector(config),
        }

    def layout(self, width: int, height: int) -> TokenLayout:
        self.check_size(width, height)
        tiles = int(self.processor.get_number_of_image_patches(height, width, self.call_kwargs))
        side = self.vision_config.image_size[0] // self.vision_config.patch_size[0]
        per_tile = int(side * side * self.config.downsample_ratio**2)
        return TokenLayout(tiles * per_tile, (tiles, side, side), "tiles")

    def feature_kwargs(self, inputs: dict[str, torch.Tensor]) -> dict[str, Any]:
        return {
            **inputs,
            "vision_feature_layer": self.config.vision_feature_layer,
            "vision_feature_select_strategy": self.config.vision_feature_select_strategy,
        }

    def span(self, width: int, height: int) -> list[Segment]:
        layout = self.layout(width, height)
        return ["<img>", Rows(layout.num_tokens), "</img>"]


FAMILIES = vlm_families(InternVLTower)
