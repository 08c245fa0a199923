"""Gemma 4: aspect-preserving resize to at most ``max_soft_tokens * k²`` patches, a ViT with 2-D positions, ``k
x k`` average pooling (scaled in fp32) and the multimodal embedder."""

from __future__ import annotations

from typing import Any

import torch
from transformers.models.gemma4.image_processing_pil_gemma4 import get_aspect_ratio_preserving_size

from visenc.errors import InvalidImage
from visenc.models.base import Rows, Segment, TokenLayout
from visenc.models.registry import vlm_families
from visenc.models.vlm import FamilyTower


class Gemma4Tower(FamilyTower):
    family = "gemma4"
    model_types = ("gemma4",)
    processor_class = "Gemma4Processor"
    base_model = "Gemma4Model"
    input_names = ("pixel_values", "image_position_ids")

    @classmethod
    def vision_modules(cls, config: Any) -> dict[str, torch.nn.Module]:
        from transformers import AutoModel
        from transformers.models.gemma4.modeling_gemma4 import Gemma4MultimodalEmbedder

        return {
            "vision_tower": AutoModel.from_config(config.vision_config),
            "embed_vision": Gemma4MultimodalEmbedder(config.vision_config, config.text_config),
        }

    def _settings(self) -> tuple[int, int, int]:
        p = self.processor
        k = int(self.call_kwargs.get("pooling_kernel_size") or p.pooling_kernel_size)
        soft = int(self.call_kwargs.get("max_soft_tokens") or p.max_soft_tokens)
        return int(self.call_kwargs.get("patch_size") or p.patch_size), k, soft

    def layout(self, width: int, height: int) -> TokenLayout:
        self.check_size(width, height)
        patch, k, soft = self._settings()
        try:
            h, w = get_aspect_ratio_preserving_size(
                height=height, width=width, patch_size=patch, max_patches=soft * k * k, pooling_kernel_size=k
            )
        except ValueError as e:
            raise InvalidImage(f"the image processor refuses {width}x{height}: {e}") from e
        grid = (1, h // patch, w // patch)
        return TokenLayout(grid[1] * grid[2] // (k * k), grid, "fixed")

    def input_tokens(self, layout: TokenLayout) -> int:
        _, k, soft = self._settings()
        return soft * k * k  # every image is padded to the same patch count

    def span(self, width: int, height: int) -> list[Segment]:
        layout = self.layout(width, height)
        return ["<|image>", Rows(layout.num_tokens), "<image|>"]


FAMILIES = vlm_families(Gemma4Tower)
