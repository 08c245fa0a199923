"""Qwen3-VL (and its MoE sibling): dynamic resolution, packed, with deepstack rows."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from visenc.errors import InvalidImage
from visenc.models import varlen
from visenc.models.base import Prepared, Rows, Segment, TokenLayout
from visenc.models.registry import vlm_families
from visenc.models.vlm import FamilyTower


class Qwen3VLTower(FamilyTower):
    family = "qwen3_vl"
    model_types = ("qwen3_vl",)
    processor_class = "Qwen3VLProcessor"
    base_model = "Qwen3VLModel"
    input_names = ("pixel_values", "image_grid_thw")
    packable = True
    video_rule = "qwen3"
    varlen = True

    @classmethod
    def vision_modules(cls, config: Any) -> dict[str, torch.nn.Module]:
        from transformers import AutoModel

        return {"visual": AutoModel.from_config(config.vision_config)}

    def layout(self, width: int, height: int) -> TokenLayout:
        return grid_layout(self.processor, width, height, smart_resize)

    def span(self, width: int, height: int) -> list[Segment]:
        layout = self.layout(width, height)
        return ["<|vision_start|>", Rows(layout.num_tokens), "<|vision_end|>"]

    def video_geometry(self) -> dict[str, int]:
        vc = self.config.vision_config
        return {
            "patch_size": int(vc.patch_size),
            "merge_size": int(vc.spatial_merge_size),
            "temporal_patch_size": int(vc.temporal_patch_size),
        }

    def tube_input(self, pixels: np.ndarray, grid_hw: tuple[int, int]) -> Prepared:
        """The tube as the image processor's outputs (images and videos run the same ``visual``)."""
        plain = super().tube_input(pixels, grid_hw)
        tensors = {"pixel_values": torch.from_numpy(pixels), "image_grid_thw": torch.tensor([plain.layout.grid_thw])}
        return Prepared(tensors, plain.layout)

    def image_features(self, inputs: dict[str, torch.Tensor]) -> Any:
        """``get_image_features`` with the grid on the host and what the vision model derives from it precomputed."""
        from transformers.vision_utils import get_vision_interpolation_indices_and_weights

        grid = inputs["image_grid_thw"]
        visual: Any = self.model.visual
        indices, weights = get_vision_interpolation_indices_and_weights(
            grid,
            num_grid_per_side=visual.num_grid_per_side,
            mode=visual.interpolation_mode,
            align_corners=visual.interpolation_align_corners,
            spatial_merge_size=self.vision_config.spatial_merge_size,
        )
        precomputed = {
            **varlen.packed_kwargs(self.vision_config, grid, self.device),
            "interp_indices": varlen.to_device(indices, self.device),
            "interp_weights": varlen.to_device(weights, self.device),
        }
        pixels = self.to_device(inputs["pixel_values"])
        return self.model.get_image_features(pixel_values=pixels, image_grid_thw=grid, **precomputed)

    def image_rows(self, outputs: Any) -> torch.Tensor:
        levels = [outputs.pooler_output, *outputs.deepstack_features]
        return torch.cat([torch.cat(list(level)) for level in levels], dim=-1)

    def row_width(self) -> int:
        vc = self.config.vision_config
        return int(vc.out_hidden_size) * (1 + len(vc.deepstack_visual_indexes))

    def row_layout(self) -> list[dict[str, Any]]:
        vc = self.config.vision_config
        width = int(vc.out_hidden_size)
        levels = range(1, 1 + len(vc.deepstack_visual_indexes))
        return [{"name": "main", "width": width}, *({"name": f"deepstack_{i}", "width": width} for i in levels)]


class Qwen3VLMoeTower(Qwen3VLTower):
    family = "qwen3_vl_moe"
    model_types = ("qwen3_vl_moe",)
    base_model = "Qwen3VLMoeModel"


def grid_layout(processor: Any, width: int, height: int, resize: Any, **resize_kwargs: Any) -> TokenLayout:
    """Layout of a Qwen-style processor: one row per ``merge x merge`` patches; the grid is the bucket."""
    p, m = int(processor.patch_size), int(processor.merge_size)
    size = processor.size
    bounds = (
        (size["shortest_edge"], size["longest_edge"])
        if isinstance(size, dict)
        else (size.shortest_edge, size.longest_edge)
    )
    try:
        h, w = resize(
            height=height, width=width, factor=p * m, min_pixels=bounds[0], max_pixels=bounds[1], **resize_kwargs
        )
    except ValueError as e:
        raise InvalidImage(f"the image processor refuses {width}x{height}: {e}") from e
    grid = (1, h // p, w // p)
    return TokenLayout(num_tokens=grid[1] * grid[2] // (m * m), grid_thw=grid, bucket=grid)


FAMILIES = vlm_families(Qwen3VLTower, Qwen3VLMoeTower)
