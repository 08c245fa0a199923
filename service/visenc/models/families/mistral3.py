"""Mistral 3: a Pixtral ViT with 2-D rotary positions and a patch merger, one row per merged patch."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers.image_utils import ChannelDimension
from transformers.models.pixtral.image_processing_pil_pixtral import get_resize_output_image_size

from visenc.errors import InvalidImage
from visenc.models import varlen
from visenc.models.base import Rows, Segment, TokenLayout
from visenc.models.registry import vlm_families
from visenc.models.vlm import FamilyTower, cat


class Mistral3Tower(FamilyTower):
    family = "mistral3"
    model_types = ("mistral3",)
    processor_class = "PixtralProcessor"
    base_model = "Mistral3Model"
    input_names = ("pixel_values", "image_sizes")
    varlen = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.packable = self.device.type != "cpu"

    @classmethod
    def vision_modules(cls, config: Any) -> dict[str, torch.nn.Module]:
        from transformers import AutoModel
        from transformers.models.mistral3.modeling_mistral3 import Mistral3MultiModalProjector

        return {
            "vision_tower": AutoModel.from_config(config.vision_config),
            "multi_modal_projector": Mistral3MultiModalProjector(config),
        }

    def processor_defaults(self) -> dict[str, Any]:
        # ``PixtralProcessor``: the image processor resizes to multiples of a merged patch, not of a patch
        return {**super().processor_defaults(), "patch_size": self._merged_patch()}

    def _merged_patch(self) -> int:
        return int(self.config.vision_config.patch_size) * int(self.config.spatial_merge_size)

    def _resized(self, width: int, height: int) -> tuple[int, int]:
        self.check_size(width, height)
        p = self.processor
        longest = p.size["longest_edge"] if isinstance(p.size, dict) else p.size.longest_edge
        merged = self._merged_patch()
        # shape only (a zero-stride view); axes named, else transformers reads a 1 or 3 px tall image as channels-first
        shape_only = np.broadcast_to(np.zeros((1, 1, 1), np.uint8), (height, width, 3))
        h, w = get_resize_output_image_size(
            shape_only, size=(longest, longest), patch_size=(merged, merged), input_data_format=ChannelDimension.LAST
        )
        return int(h), int(w)

    def layout(self, width: int, height: int) -> TokenLayout:
        h, w = self._resized(width, height)
        patch = self.vision_config.patch_size
        merge = int(self.config.spatial_merge_size)
        grid = (1, h // patch, w // patch)
        rows = (grid[1] // merge) * (grid[2] // merge)
        if rows == 0:  # under merge x merge patches: the merger has nothing to merge
            raise InvalidImage(f"{width}x{height} is smaller than one merged patch ({merge * patch} px) of this model")
        return TokenLayout(rows, grid, (h, w))

    def span(self, width: int, height: int) -> list[Segment]:
        layout = self.layout(width, height)
        merge = int(self.config.spatial_merge_size)
        rows, cols = layout.grid_thw[1] // merge, layout.grid_thw[2] // merge
        span: list[Segment] = []
        for r in range(rows):
            span += [Rows(cols), "[IMG_END]" if r == rows - 1 else "[IMG_BREAK]"]
        return span

    def collate(self, inputs: Any) -> dict[str, torch.Tensor]:
        pixels = [x["pixel_values"] for x in inputs]
        h = max(p.shape[-2] for p in pixels)
        w = max(p.shape[-1] for p in pixels)
        padded = [
            p if p.shape[-2:] == (h, w) else torch.nn.functional.pad(p, (0, w - p.shape[-1], 0, h - p.shape[-2]))
            for p in pixels
        ]
        return {"pixel_values": cat(padded), "image_sizes": cat([x["image_sizes"] for x in inputs])}

    def image_features(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """``Mistral3Model.get_image_features`` from transformers' own modules, every size kept on the host."""
        vision: Any = self.model.vision_tower
        patch = int(vision.patch_size)
        sizes = [(int(h), int(w)) for h, w in inputs["image_sizes"].tolist()]
        grids = [(h // patch, w // patch) for h, w in sizes]
        embeds = vision.patch_conv(self.to_device(inputs["pixel_values"]))
        hidden = torch.cat([e[:, :gh, :gw].flatten(1).T for e, (gh, gw) in zip(embeds, grids, strict=True)])
        hidden = vision.ln_pre(hidden.unsqueeze(0))
        positions, attention = _packed_grids(grids, self.device)
        rotary = vision.patch_positional_embedding(hidden, positions)
        layers = self._feature_layers()
        kept = {0: hidden} if 0 in layers else {}  # only the selected states outlive the next block
        for depth, layer in enumerate(vision.transformer.layers[: max(layers)], 1):
            hidden = layer(hidden, None, position_embeddings=rotary, **attention)
            if depth in layers:
                kept[depth] = hidden
        selected = torch.cat([kept[i] for i in layers], dim=-1)
        return self.model.multi_modal_projector(selected[0], sizes)  # type: ignore[no-any-return]

    def _feature_layers(self) -> list[int]:
        """``vision_feature_layer`` as indices into the hidden states (0: the blocks' input)."""
        chosen = self.config.vision_feature_layer
        count = int(self.vision_config.num_hidden_layers) + 1
        return [int(i) % count for i in ([chosen] if isinstance(chosen, int) else chosen)]

    def image_rows(self, outputs: torch.Tensor) -> torch.Tensor:
        return outputs


def _packed_grids(grids: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, dict[str, Any]]:
    positions = torch.cat([torch.cartesian_prod(torch.arange(h), torch.arange(w)).reshape(h * w, 2) for h, w in grids])
    lengths = [h * w for h, w in grids]
    cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu = varlen.to_device(cu, device)
    attention = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(lengths), "max_length_k": max(lengths)}
    return varlen.to_device(positions, device), attention


FAMILIES = vlm_families(Mistral3Tower)
