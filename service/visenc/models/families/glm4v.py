"""GLM-4.1V / GLM-4.5V: Qwen-style dynamic resolution (its own ``smart_resize``), packed.
Span: ``<|begin_of_image|>`` rows ``<|end_of_image|>``."""

from __future__ import annotations

from typing import Any

import torch
from transformers.models.glm4v.image_processing_pil_glm4v import smart_resize

from visenc.models.base import Rows, Segment, TokenLayout
from visenc.models.families.qwen3_vl import grid_layout
from visenc.models.vlm import FamilyTower


class Glm4vTower(FamilyTower):
    family = "glm4v"
    model_types = ("glm4v",)
    processor_class = "Glm4vProcessor"
    base_model = "Glm4vModel"
    input_names = ("pixel_values", "image_grid_thw")
    packable = True
    varlen = True

    @classmethod
    def vision_modules(cls, config: Any) -> dict[str, torch.nn.Module]:
        from transformers.models.glm4v.modeling_glm4v import Glm4vVisionModel

        return {"visual": Glm4vVisionModel._from_config(config.vision_config)}

    def layout(self, width: int, height: int) -> TokenLayout:
        t = int(self.processor.temporal_patch_size)
        return grid_layout(self.processor, width, height, smart_resize, num_frames=t, temporal_factor=t)

    def span(self, width: int, height: int) -> list[Segment]:
        layout = self.layout(width, height)
        return ["<|begin_of_image|>", Rows(layout.num_tokens), "<|end_of_image|>"]
