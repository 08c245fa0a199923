"""Idefics3 and SmolVLM: the image is resized and split into square tiles (row-major) plus the whole image,
downsized, last; each tile runs SigLIP, pixel shuffle (``scale_factor``) and the connector's projection into
``image_seq_len`` rows."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from visenc.models import varlen
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

    def image_features(self, inputs: dict[str, torch.Tensor]) -> Any:
        """transformers' ``get_image_features``, with what it reads (padding tiles, patch mask, tile counts)
        computed on the host from the host inputs, and only the vision model and connector on the device."""
        pixels = inputs["pixel_values"]
        batch, tiles = pixels.shape[:2]
        pixels = pixels.to(dtype=self.dtype).view(batch * tiles, *pixels.shape[2:])
        real = (pixels == 0.0).sum(dim=(-1, -2, -3)) != pixels.shape[1:].numel()
        counts = real.view(batch, tiles).sum(dim=1).tolist()
        mask = inputs["pixel_attention_mask"]
        mask = mask.view(batch * tiles, *mask.shape[2:])[real]
        patch = self.vision_config.patch_size
        patches = mask.unfold(dimension=1, size=patch, step=patch).unfold(dimension=2, size=patch, step=patch)
        patch_mask = (patches.sum(dim=(-1, -2)) > 0).bool()
        hidden = self._vision(self.to_device(pixels[real].contiguous()), patch_mask)
        features = self.model.connector(hidden)  # type: ignore[operator]
        return SimpleNamespace(pooler_output=[f.reshape(-1, f.shape[-1]) for f in features.split(counts)])

    def _vision(self, pixels: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:
        """The vision transformer's forward, its attention mask decided from the host's patch mask."""
        from transformers.masking_utils import create_bidirectional_mask

        vision: Any = self.model.vision_model
        mask = varlen.to_device(patch_mask, self.device)
        hidden = vision.embeddings(pixel_values=pixels, patch_attention_mask=mask)
        if vision.config._attn_implementation == "sdpa" and bool(patch_mask.all()):
            attention = None  # what ``create_bidirectional_mask`` gives SDPA for a mask with no padding
        else:
            attention = create_bidirectional_mask(
                config=vision.config, inputs_embeds=hidden, attention_mask=mask.view(pixels.shape[0], -1)
            )
        return vision.post_layernorm(vision.encoder(inputs_embeds=hidden, attention_mask=attention).last_hidden_state)


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
