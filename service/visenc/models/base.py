"""The one interface every vision tower sits behind: ``layout``, ``preprocess`` (CPU) and ``forward`` (device)."""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from PIL import Image

from visenc import devices
from visenc.imaging.decode import LOADERS
from visenc.imaging.video import Rule, VideoPreprocess
from visenc.models import compiled


@dataclass(frozen=True, slots=True)
class TokenLayout:
    """What an image becomes, known from its pixel size alone."""

    num_tokens: int
    grid_thw: tuple[int, int, int]
    #: images with equal buckets have equal input shapes (batchable without padding)
    bucket: Hashable


@dataclass(slots=True)
class Prepared:
    """A preprocessed image: the tower's input (an array, or a dict of tensors: opaque to the engine) and its layout."""

    pixels: Any
    layout: TokenLayout


@dataclass(frozen=True, slots=True)
class Rows:
    count: int


#: one piece of an image's placeholder span: a run of rows, or prompt text (tokenised by the engine)
Segment = Rows | str


def compact(span: Sequence[Segment]) -> list[dict[str, Any]]:
    """A span as JSON: ``{"rows": n}`` / ``{"text": s}``, neighbouring pieces of a kind merged."""
    out: list[dict[str, Any]] = []
    for seg in span:
        kind, value = ("rows", seg.count) if isinstance(seg, Rows) else ("text", seg)
        if not value:
            continue
        if out and kind in out[-1]:
            out[-1][kind] += value
        else:
            out.append({kind: value})
    return out


WARM_UP_SIZES = ((224, 224), (448, 336))


class VisionTower(ABC):
    name: str
    model: torch.nn.Module
    hidden_size: int
    dtype: torch.dtype
    device: torch.device
    #: images of different buckets may share one forward (variable-resolution towers)
    packable: bool = False
    #: whose loader turns a file into the RGB image ``preprocess`` gets (``imaging.decode.LOADERS``)
    image_loader: str = "vllm"
    #: the video processor a tube-by-tube video tower follows (``None``: images only)
    video_rule: ClassVar[Rule | None] = None
    video: VideoPreprocess | None = None
    #: a checkpoint's vision tensors and their identity (``{"identity", "tensors"}``; ``None``: built in)
    weights: dict[str, Any] | None = None

    @abstractmethod
    def layout(self, width: int, height: int) -> TokenLayout: ...

    @abstractmethod
    def preprocess(self, image: Image.Image) -> Prepared: ...

    @abstractmethod
    def forward(self, batch: Sequence[Prepared]) -> list[torch.Tensor]: ...

    #: blocks compiled by ``compile`` (0: the tower runs eagerly)
    compiled_blocks: int = 0
    compilation: compiled.Status = compiled.NOT_COMPILED

    @property
    def attention_kernel(self) -> str:
        """What the tower's attention runs on (``models/varlen.py`` for packed towers)."""
        return "sdpa"

    def compile(self) -> int:
        """Compile the tower's repeated blocks (``models/compiled.py``); returns how many."""
        self.compiled_blocks = compiled.compile_blocks(self.model)
        if self.compiled_blocks:
            detail = f"{self.compiled_blocks} blocks; the warm-up builds their graphs"
            self.compilation = compiled.Status("warming", detail=detail)
        else:
            self.compilation = compiled.Status("eager", "backend", "the tower has no repeated blocks to compile")
        return self.compiled_blocks

    def compiled_ready(self, graphs: int) -> None:
        """The warm-up of the compiled blocks is done: ``graphs`` graphs built."""
        self.compilation = compiled.Status("compiled", graphs=graphs)

    def run_eagerly(self, status: compiled.Status) -> None:
        """The blocks run eagerly from now on (undone if compiled), for the reason ``status`` gives."""
        compiled.uncompile_blocks(self.model)
        self.compiled_blocks = 0
        self.compilation = status

    def warm_up(self) -> None:
        """Forwards of one image, then of two: a compiled tower builds its graphs before any request waits."""
        small, large = (self.preprocess(Image.new("RGB", size, (120, 130, 140))) for size in WARM_UP_SIZES)
        for batch in ([small], [small, large if self.packable else small]):
            self.forward(batch)
        self.runtime.synchronize()

    @property
    def runtime(self) -> devices.Device:
        """The device interface the tower runs through (``visenc.devices``)."""
        return devices.for_device(self.device)

    @property
    def input_dtype(self) -> torch.dtype:
        """The dtype the forward reads its pixels in: staged in it on the host where the cast is the model's own."""
        return torch.float32

    def stage(self, prepared: Prepared) -> Prepared:
        """``prepared``'s input written once into a host buffer the device reads (a preprocessing thread)."""
        pixels = prepared.pixels
        if isinstance(pixels, np.ndarray):
            staged: Any = self.runtime.stage(torch.from_numpy(pixels), self.input_dtype)
        elif isinstance(pixels, dict):
            staged = {
                k: self.runtime.stage(v, v.dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                for k, v in pixels.items()
            }
        else:
            return prepared
        return Prepared(staged, prepared.layout)

    def forward_groups(self, batch: Sequence[Prepared]) -> list[list[int]]:
        """The device calls ``forward`` would cut ``batch`` into anyway, as index lists in order (default: one)."""
        return [list(range(len(batch)))] if batch else []

    def span(self, width: int, height: int) -> list[Segment]:
        """The placeholder span of a ``width x height`` image in the engine's prompt (default: rows alone)."""
        return [Rows(self.layout(width, height).num_tokens)]

    def video_geometry(self) -> dict[str, int]:
        raise NotImplementedError

    def tube_layout(self, grid_hw: tuple[int, int]) -> TokenLayout:
        """What one tube of a video becomes: an input of grid ``(1, h, w)``, its own bucket."""
        assert self.video is not None
        grid = (1, *grid_hw)
        return TokenLayout(self.video.tube_tokens(grid), grid, grid)

    def tube_input(self, pixels: np.ndarray, grid_hw: tuple[int, int]) -> Prepared:
        """One tube's tower input (``VideoPreprocess.tube_pixels``) as ``forward`` takes it."""
        return Prepared(pixels, self.tube_layout(grid_hw))

    def row_layout(self) -> list[dict[str, Any]]:
        """What the columns of a row are, along the hidden axis: ``[{"name", "width"}]``."""
        return [{"name": "image", "width": self.hidden_size}]

    @abstractmethod
    def fingerprint_fields(self) -> dict[str, Any]:
        """Everything that changes the output: model, weights, config, dtype, preprocessing."""

    @property
    def image_backend(self) -> str:
        """Whose image-processor backend the pixels equal (``torchvision`` or ``pil``)."""
        return "pil"

    def input_tokens(self, layout: TokenLayout) -> int:
        """Tokens the forward processes for this image: the unit of the batch budget."""
        t, h, w = layout.grid_thw
        return t * h * w

    def activation_bytes_per_token(self) -> int:
        """Peak activation bytes per ``input_tokens`` unit in one forward, the part linear in the batch."""
        return 64 * self.hidden_size * max(1, self.dtype.itemsize)

    def input_bytes_per_token(self) -> int:
        """Host bytes of preprocessed input per ``input_tokens`` unit (what the scheduler holds staged)."""
        return 4 * self.hidden_size

    def forward_bytes(self, layouts: Sequence[TokenLayout]) -> int:
        """Estimated peak bytes one ``forward`` of these images allocates, weights and staged inputs excluded."""
        return self.activation_bytes_per_token() * sum(self.input_tokens(lay) for lay in layouts)

    def to_device(self, pixels: torch.Tensor) -> torch.Tensor:
        """Host input → the tower's device and dtype, queued (from a staged host buffer: no host copy)."""
        return self.runtime.to_device(pixels, self.dtype)

    @property
    def fingerprint(self) -> str:
        """128-bit digest (32 hex) of ``fingerprint_fields`` and the image loader; goes into every index key."""
        cached = getattr(self, "_fingerprint", None)
        if cached is None:
            fields = {**self.fingerprint_fields(), "image_loader": LOADERS[self.image_loader].label}
            blob = json.dumps(fields, sort_keys=True, default=str).encode()
            cached = hashlib.sha256(blob).hexdigest()[:32]
            self._fingerprint = cached
        return cached

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "fingerprint": self.fingerprint,
            "hidden_size": self.hidden_size,
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
            "packable": self.packable,
            "attention": self.attention_kernel,
            "compiled_blocks": self.compiled_blocks,
            "image_loader": LOADERS[self.image_loader].label,
            "image_backend": self.image_backend,
            "row_layout": self.row_layout(),
            "weights": self.weights,
        }
