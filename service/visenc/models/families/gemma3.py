"""Gemma 3: SigLIP at a fixed size, average-pooled to ``mm_tokens_per_image`` rows, then the projector's RMSNorm
and matmul."""

from __future__ import annotations

from typing import Any

import torch

from visenc.models.base import Rows, Segment, TokenLayout
from visenc.models.registry import vlm_families
from visenc.models.vlm import FamilyTower


class Gemma3Tower(FamilyTower):
    family = "gemma3"
    model_types = ("gemma3",)
    processor_class = "Gemma3Processor"
    base_model = "Gemma3Model"

    @classmethod
    def vision_modules(cls, config: Any) -> dict[str, torch.nn.Module]:
        from transformers import AutoModel
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        return {
            "vision_tower": AutoModel.from_config(config.vision_config),
            "multi_modal_projector": Gemma3MultiModalProjector(config),
        }

    def layout(self, width: int, height: int) -> TokenLayout:
        self.check_size(width, height)
        side = self.vision_config.image_size // self.vision_config.patch_size
        return TokenLayout(int(self.config.mm_tokens_per_image), (1, side, side), "fixed")

    def span(self, width: int, height: int) -> list[Segment]:
        layout = self.layout(width, height)
        return ["\n\n<start_of_image>", Rows(layout.num_tokens), "<end_of_image>\n\n"]


FAMILIES = vlm_families(Gemma3Tower)
