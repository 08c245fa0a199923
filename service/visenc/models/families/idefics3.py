"""Idefics3 and SmolVLM: the image is resized and split into square tiles (row-major) plus the whole image,
downsized, last; each tile runs SigLIP, pixel shuffle (``scale_factor``) and the connector's projection into
``image_seq_len`` rows."""

from __future__ import annotations

from typing import Any

import torch

from visenc.models.base import Rows, Segment, TokenLayout
from visenc.models.registry import vlm_families
from visenc.models.vlm import FamilyTower, cat

FAKE = "<fake_token_around_image>"


class Idefics3Tower(FamilyTower):
    family = "idefics3"
    model_types = ("idefics3",)
    processor_class = "Idefics3Processor"
    base_model = "Idefics3Model"
    input_names = ("pixel_values", "pixel_attention_mask")

    @classmethod
    def vision_modules(cls, config: Any) -> dict[str, torch.nn.Module]:
        from transformers.models.idefics3 import modeling_idefics3 as m

        return {
            "vision_model": m.Idefics3VisionTransformer._from_config(config.vision_config),
            "connector": m.Idefics3Connector(config),
        }

    def _tiles(self, width: int, height: int) -> tuple[int, int, int]:
        self.check_size(width, height)
        _, rows, cols = self.processor.get_number_of_image_patches(height, width, self.call_kwargs)
        return rows * cols + 1 if rows * cols else 1, rows, cols

    def _seq(self) -> int:
        vc = self.vision_config
        return int((vc.image_size // vc.patch_size) ** 2 / self.config.scale_factor**2)

    def layout(self, width: int, height: int) -> TokenLayout:
        tiles, _rows, _cols = self._tiles(width, height)
        side = self.vision_config.image_size // self.vision_config.patch_size
        return TokenLayout(tiles * self._seq(), (tiles, side, side), "tiles")

    def span(self, width: int, height: int) -> list[Segment]:
        _, rows, cols = self._tiles(width, height)
        seq = self._seq()
        span: list[Segment] = []
        for r in range(rows):
            for c in range(cols):
                span += [f"{FAKE}<row_{r + 1}_col_{c + 1}>", Rows(seq)]
            span.append("\n")
        lead = "\n" if rows else ""
        return [*span, f"{lead}{FAKE}<global-img>", Rows(seq), FAKE]

    def collate(self, inputs: Any) -> dict[str, torch.Tensor]:
        # one sample holding every image's tiles; all-zero tiles are padding to the model
        return {k: cat([x[k] for x in inputs], dim=1) for k in self.input_names}


class SmolVLMTower(Idefics3Tower):
    family = "smolvlm"
    model_types = ("smolvlm",)
    processor_class = "SmolVLMProcessor"
    base_model = "SmolVLMModel"

    @classmethod
    def vision_modules(cls, config: Any) -> dict[str, torch.nn.Module]:
        from transformers.models.smolvlm import modeling_smolvlm as m

        return {
            "vision_model": m.SmolVLMVisionTransformer._from_config(config.vision_config),
            "connector": m.SmolVLMConnector(config),
        }


FAMILIES = vlm_families(Idefics3Tower, SmolVLMTower)
