"""GLM-4.1V / GLM-4.5V: Qwen-style dynamic resolution (its own ``smart_resize``), packed."""

from __future__ import annotations

from typing import Any

import torch
from transformers.models.glm4v.image_processing_pil_glm4v import smart_resize

from visenc.models import varlen
from visenc.models.base import Rows, Segment, TokenLayout
from visenc.models.families.qwen3_vl import grid_layout
from visenc.models.registry import vlm_families
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

    def image_features(self, inputs: dict[str, torch.Tensor]) -> Any:
        """``Glm4vModel.get_image_features`` is the vision model's output split by sizes it reads back from the
        grid (``tolist()``), while the vision model's position embeddings index the grid on the device."""
        grid = inputs["image_grid_thw"]
        return self.model.visual(
            self.to_device(inputs["pixel_values"]),
            grid_thw=varlen.to_device(grid, self.device),
            **varlen.packed_kwargs(self.vision_config, grid, self.device),
        )

    def layout(self, width: int, height: int) -> TokenLayout:
        t = int(self.processor.temporal_patch_size)
        return grid_layout(self.processor, width, height, smart_resize, num_frames=t, temporal_factor=t)

    def span(self, width: int, height: int) -> list[Segment]:
        layout = self.layout(width, height)
        return ["<|begin_of_image|>", Rows(layout.num_tokens), "<|end_of_image|>"]


FAMILIES = vlm_families(Glm4vTower)
