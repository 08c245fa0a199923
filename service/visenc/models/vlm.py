"""The vision path of a full VLM, run by transformers' own code: ``FamilyTower``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from PIL import Image

from visenc.errors import InvalidImage
from visenc.imaging.decode import rgb_like_transformers
from visenc.models import memory, varlen
from visenc.models.base import Prepared, TokenLayout, VisionTower
from visenc.models.construct import cast_module, config_fields


def vision_only(model_class: type, config: Any, modules: dict[str, Any]) -> torch.nn.Module:
    """An instance of ``model_class`` (a transformers VLM base model) that holds only ``modules``."""
    from transformers import PreTrainedModel

    host: Any = object.__new__(model_class)
    PreTrainedModel.__init__(host, config)
    for name, module in modules.items():
        if isinstance(module, torch.nn.Parameter):
            host.register_parameter(name, module)
        else:
            host.add_module(name, module)
    return host


class FamilyTower(VisionTower):
    """A VLM's image path, as transformers computes it; subclassed once per family."""

    family: ClassVar[str]
    #: ``config.json`` ``model_type`` values served by this family
    model_types: ClassVar[tuple[str, ...]]
    #: ``Processor`` class whose ``images_kwargs`` defaults the family's processor call adds
    processor_class: ClassVar[str | None] = None
    #: keys of the image processor's output the forward takes
    input_names: ClassVar[tuple[str, ...]] = ("pixel_values",)
    #: the transformers base model whose ``get_image_features`` defines the rows
    base_model: ClassVar[str]
    #: the vision attention takes ``cu_seqlens``: it runs on the varlen kernels (``models/varlen.py``)
    varlen: ClassVar[bool] = False
    #: inputs transformers reads on the host (sizes, counts): they stay on the host
    host_inputs: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        *,
        name: str,
        config: Any,
        model: torch.nn.Module,
        processor: Any,
        source: dict[str, Any],
        dtype: torch.dtype,
        device: torch.device,
        backend: str,
    ) -> None:
        self.name = name
        self.config = config
        self.model = cast_module(model, device=device, dtype=dtype).eval()
        self.processor = processor
        self.source = source
        self.dtype = dtype
        self.device = device
        self.backend = backend
        self.call_kwargs = self.processor_defaults()
        self.hidden_size = self.row_width()
        self.vision_config = config.vision_config
        if self.varlen:
            varlen.use_varlen(self.model)

    @property
    def attention_kernel(self) -> str:
        if not self.varlen:
            return "sdpa"
        vc = self.vision_config
        heads = int(getattr(vc, "num_heads", 0) or vc.num_attention_heads)
        return varlen.kernel_for(varlen.device_key(self.device), self.dtype, int(vc.hidden_size) // heads)

    @classmethod
    def vision_modules(cls, config: Any) -> dict[str, Any]:
        """The base model's submodules the image path uses, built from ``config`` as its ``__init__`` builds them."""
        raise NotImplementedError

    @classmethod
    def model_class(cls) -> type:
        import transformers

        return getattr(transformers, cls.base_model)  # type: ignore[no-any-return]

    def layout(self, width: int, height: int) -> TokenLayout:
        raise NotImplementedError

    def feature_kwargs(self, inputs: dict[str, torch.Tensor]) -> dict[str, Any]:
        return dict(inputs)

    def image_features(self, inputs: dict[str, torch.Tensor]) -> Any:
        """The base model's image features of one collated batch of host inputs (``image_rows`` reads them)."""
        moved = {
            k: v
            if k in self.host_inputs
            else self.to_device(v)
            if v.is_floating_point()
            else varlen.to_device(v, self.device)
            for k, v in inputs.items()
        }
        return self.model.get_image_features(**self.feature_kwargs(moved))

    def collate(self, inputs: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """One batch from per-image processor outputs (default: concatenated along dim 0)."""
        return {k: cat([x[k] for x in inputs]) for k in self.input_names}

    def image_rows(self, outputs: Any) -> torch.Tensor:
        pooled = outputs.pooler_output
        if isinstance(pooled, (list, tuple)):
            return torch.cat([p.reshape(-1, p.shape[-1]) for p in pooled])
        return pooled.reshape(-1, pooled.shape[-1])

    def row_width(self) -> int:
        return int(self.config.text_config.hidden_size)

    def processor_defaults(self) -> dict[str, Any]:
        if self.processor_class is None:
            return {}
        import transformers

        defaults = dict(getattr(getattr(transformers, self.processor_class), "images_kwargs", {}) or {})
        defaults.pop("return_tensors", None)
        return defaults

    @property
    def image_backend(self) -> str:
        return self.backend

    def check_size(self, width: int, height: int) -> None:
        if width <= 0 or height <= 0:
            raise InvalidImage(f"image has an empty size {width}x{height}")

    def preprocess(self, image: Image.Image) -> Prepared:
        image = rgb_like_transformers(image)  # the processor's own do_convert_rgb (no-op on RGB)
        layout = self.layout(*image.size)
        try:
            out = self.processor(images=[image], return_tensors="pt", **self.call_kwargs)
        except ValueError as e:  # sizes the processor refuses
            raise InvalidImage(f"the image processor refuses this image: {e}") from e
        return Prepared(pixels={k: out[k] for k in self.input_names}, layout=layout)

    def forward(self, batch: Sequence[Prepared]) -> list[torch.Tensor]:
        if not batch:
            return []
        inputs = self.collate([p.pixels for p in batch])
        with torch.inference_mode():
            rows = self.image_rows(self.image_features(inputs))
        return list(torch.split(rows, [p.layout.num_tokens for p in batch]))

    def fingerprint_fields(self) -> dict[str, Any]:
        return {
            "family": self.family,
            "source": self.source,
            "config": config_fields(self.config),
            "dtype": str(self.dtype),
            "preprocess": {
                "class": type(self.processor).__name__,
                "settings": self.processor.to_dict(),
                "call": self.call_kwargs,
                "backend": self.backend,
            },
        }

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "family": self.family}

    def input_bytes_per_token(self) -> int:
        patch = self.vision_config.patch_size
        patch = patch[0] if isinstance(patch, (list, tuple)) else patch
        return 4 * 3 * 2 * int(patch) ** 2

    def activation_bytes_per_token(self) -> int:
        vc = self.vision_config
        item = self.dtype.itemsize
        mlp = int(getattr(vc, "intermediate_size", 0) or 4 * vc.hidden_size)
        per = self.input_bytes_per_token() + memory.block_bytes_per_position(vc.hidden_size, mlp, item, gated=True)
        return int(memory.SAFETY * (per + 4 * self.hidden_size * item))

    def forward_bytes(self, layouts: Sequence[TokenLayout]) -> int:
        vc = self.vision_config
        heads = int(getattr(vc, "num_attention_heads", 0) or getattr(vc, "num_heads", 1))
        scores = sum(
            memory.attention_score_bytes(
                heads,
                lay.grid_thw[1] * lay.grid_thw[2],
                self.dtype.itemsize,
                materialised=memory.materialises_scores(vc),
            )
            * lay.grid_thw[0]
            for lay in layouts
        )
        return self.activation_bytes_per_token() * sum(self.input_tokens(lay) for lay in layouts) + int(
            memory.SAFETY * scores
        )


def cat(tensors: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(list(tensors), dim=dim)


def load_processor(path: Path, backend: str) -> Any:
    """The checkpoint's own image processor in ``backend`` (``torchvision`` | ``pil``), never silently the other one."""
    from transformers import AutoImageProcessor
    from transformers.image_processing_backends import PilBackend, TorchvisionBackend

    proc = AutoImageProcessor.from_pretrained(path, backend=backend)
    expected = TorchvisionBackend if backend == "torchvision" else PilBackend
    if not isinstance(proc, expected):
        hint = " (install torchvision, or serve with --image-backend pil)" if backend == "torchvision" else ""
        raise ValueError(f"{path}: the {backend} image processor is not available here{hint}")
    return proc
