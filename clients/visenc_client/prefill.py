"""Prefill integration: lay a multimodal prompt out from visenc handles, fill each chunk's image rows
(docs/integration-prefill.md)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from visenc_client._client import Client
from visenc_client._exceptions import (
    DeadlineError,
    ImageEncodeError,
    NotFoundError,
    OverloadedError,
    ProtocolError,
)
from visenc_client._protocol import read_image
from visenc_client._types import Handle, ImageInput
from visenc_client.chunks import ImagePlacement
from visenc_client.format import NUMPY_DTYPES, TORCH_NAMES, bfloat16_as_float32, words_tensor

T = TypeVar("T")


def expand_placeholders(
    token_ids: Sequence[int] | np.ndarray, image_token_id: int, num_tokens: Sequence[int]
) -> tuple[np.ndarray, list[int]]:
    """Expand image ``k``'s single placeholder into ``num_tokens[k]``: the ids and each image's first position."""
    ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    where = np.flatnonzero(ids == image_token_id)
    if len(where) != len(num_tokens):
        raise ValueError(f"the prompt has {len(where)} image placeholders for {len(num_tokens)} images")
    counts = np.ones(len(ids), dtype=np.int64)
    counts[where] = np.asarray(num_tokens, dtype=np.int64)
    if (counts < 0).any():
        raise ValueError("num_tokens must be >= 0")
    expanded = np.repeat(ids, counts)
    offsets = (np.cumsum(counts) - counts)[where]
    return expanded, [int(x) for x in offsets]


def tokens_for_grid(grid_thw: Sequence[int], merge_size: int) -> int:
    t, h, w = grid_thw
    return int(t * h * w) // (merge_size * merge_size)


@dataclass(frozen=True)
class PromptLayout:
    """A prompt whose image placeholders are expanded (``placements`` in prompt order): what each chunk needs."""

    input_ids: np.ndarray
    placements: tuple[ImagePlacement, ...]
    image_token_id: int
    #: the images' bytes, to re-upload one the service evicted before its rows were fetched
    images: tuple[bytes, ...] = field(repr=False)

    @property
    def num_positions(self) -> int:
        return len(self.input_ids)

    @property
    def handles(self) -> list[Handle]:
        return [p.image for p in self.placements if isinstance(p.image, Handle)]

    @property
    def image_grid_thw(self) -> list[tuple[int, int, int]]:
        return [h.grid_thw for h in self.handles if h.grid_thw is not None]

    @property
    def mm_token_type_ids(self) -> np.ndarray:
        return (self.input_ids == self.image_token_id).astype(np.int32)

    def image_positions(self, start: int, end: int) -> np.ndarray:
        return np.flatnonzero(self.input_ids[start:end] == self.image_token_id)


class VisencPrefill:
    """One visenc ``Client`` in a prefill worker. ``merge_size``: when given, each handle's ``num_tokens`` is
    checked against its grid; ``attempts``: tries per encode or fetch before a retryable error propagates."""

    def __init__(
        self, client: Client, *, image_token_id: int, merge_size: int | None = None, attempts: int = 3
    ) -> None:
        if attempts < 1:
            raise ValueError("attempts must be >= 1")
        self.client = client
        self.image_token_id = image_token_id
        self.merge_size = merge_size
        self.attempts = attempts

    def prepare(self, token_ids: Sequence[int] | np.ndarray, images: Sequence[ImageInput]) -> PromptLayout:
        """Encode ``images`` (hash-first, not waiting) and lay the prompt out from their handles."""
        datas = tuple(read_image(im) for im in images)
        handles = self._encode(datas)
        expanded, offsets = expand_placeholders(token_ids, self.image_token_id, [h.num_tokens or 0 for h in handles])
        placements = tuple(ImagePlacement.of(h, off) for h, off in zip(handles, offsets))
        return PromptLayout(expanded, placements, self.image_token_id, datas)

    def fill_chunk(self, layout: PromptLayout, start: int, end: int, inputs_embeds: Any) -> None:
        """Write the image rows of chunk ``[start, end)`` into ``inputs_embeds`` (numpy or torch, any device)."""
        if not 0 <= start <= end <= layout.num_positions:
            raise ValueError(f"chunk [{start}, {end}) is outside the prompt's {layout.num_positions} positions")
        if len(inputs_embeds) != end - start:
            raise ValueError(f"inputs_embeds has {len(inputs_embeds)} rows for chunk [{start}, {end})")
        if not layout.image_positions(start, end).size:
            return
        if self._fetches_in_place(layout, inputs_embeds):
            self._retrying(
                layout, lambda: self.client.fetch_chunk(layout.placements, start, end, out=inputs_embeds, dense=True)
            )
            return
        rows = self._retrying(layout, lambda: self.client.fetch_chunk(layout.placements, start, end))
        _scatter(inputs_embeds, layout.image_positions(start, end), rows, layout.handles[0].dtype or "float32")

    def _encode(self, datas: Sequence[bytes]) -> list[Handle]:
        handles = self._retrying(None, lambda: self.client.encode(datas, wait=False))
        for h in handles:
            if h.status == "error":
                raise ImageEncodeError(h.hash, h.error or "encode failed", h.reason)
            if h.status not in ("ready", "pending") or h.num_tokens is None:
                raise ProtocolError(f"{h.hash}: unusable handle (status {h.status}, num_tokens {h.num_tokens})")
            if self.merge_size is not None and h.grid_thw is not None:
                expected = tokens_for_grid(h.grid_thw, self.merge_size)
                if h.num_tokens != expected:
                    raise ProtocolError(
                        f"{h.hash}: {h.num_tokens} tokens for grid {h.grid_thw}, the model "
                        f"expects {expected} (merge {self.merge_size}): is visenc serving its tower?"
                    )
        return handles

    def _retrying(self, layout: PromptLayout | None, call: Callable[[], T]) -> T:
        for attempt in range(1, self.attempts + 1):
            try:
                return call()
            except OverloadedError as e:
                if attempt == self.attempts:
                    raise
                time.sleep(min(e.retry_after_s, 10.0))
            except DeadlineError:
                if attempt == self.attempts:
                    raise
            except NotFoundError:
                if layout is None or attempt == self.attempts:
                    raise
                self._reupload(layout)
        raise AssertionError("unreachable")

    def _reupload(self, layout: PromptLayout) -> None:
        for before, after in zip(layout.handles, self._encode(layout.images)):
            if (before.num_tokens, before.hidden_size) != (after.num_tokens, after.hidden_size):
                raise ProtocolError(f"{before.hash}: re-encoded with a different shape; the service's model changed")

    @staticmethod
    def _fetches_in_place(layout: PromptLayout, out: Any) -> bool:
        wire = layout.handles[0].dtype if layout.handles else None
        if isinstance(out, np.ndarray):
            return wire in NUMPY_DTYPES and out.dtype == NUMPY_DTYPES[wire] and out.flags.c_contiguous
        device = getattr(out, "device", None)
        return (
            getattr(device, "type", None) == "cpu"
            and str(out.dtype) == TORCH_NAMES.get(wire or "")
            and bool(out.is_contiguous())
        )


def _scatter(out: Any, positions: np.ndarray, rows: np.ndarray, wire_dtype: str) -> None:
    """``out[positions] = rows``, converting dtype (bfloat16 rows come as 16-bit words) and device."""
    if isinstance(out, np.ndarray):
        out[positions] = bfloat16_as_float32(rows) if wire_dtype == "bfloat16" else rows
        return
    import torch

    src = words_tensor(np.ascontiguousarray(rows), wire_dtype)
    index = torch.from_numpy(positions).to(out.device)
    out.index_copy_(0, index, src.to(device=out.device, dtype=out.dtype, non_blocking=True))
