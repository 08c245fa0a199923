"""CPU work on one image, run in the preprocessing pool: inspect an upload
(hash it, read its size from the header) and preprocess it (decode + the
tower's own preprocessing). Both are pure functions of the bytes."""

from __future__ import annotations

from dataclasses import dataclass

from visenc.errors import HashMismatch, ImageTooLarge, VisencError
from visenc.imaging.decode import decode, probe
from visenc.models.base import Prepared, TokenLayout, VisionTower
from visenc_client.format import image_hash

#: host bytes per source pixel while an image is decoded and resized: PIL holds
#: RGB as 4 bytes per pixel, plus the converted copy and resize buffers
DECODE_BYTES_PER_PIXEL = 8


@dataclass(frozen=True, slots=True)
class Inspected:
    hash: str
    layout: TokenLayout
    #: tower-input tokens the forward processes (the batch budget's unit)
    cost: int
    #: extra staging charge while the image is decoded, in the same units
    decode_cost: int


class ImagePrep:
    def __init__(self, tower: VisionTower, *, max_image_bytes: int, max_image_pixels: int) -> None:
        self.tower = tower
        self.max_image_bytes = max_image_bytes
        self.max_image_pixels = max_image_pixels
        self._input_bytes = max(1, tower.input_bytes_per_token())

    def inspect(self, data: bytes, given_hash: str | None) -> tuple[str, Inspected | VisencError]:
        """Hash (and check) uploaded bytes and read the image size from its header only.

        Returns the bytes' hash and what they become, or the per-item error
        (``HashMismatch``, ``InvalidImage``, ``ImageTooLarge``) that stops them."""
        digest = image_hash(data)
        if given_hash is not None and given_hash != digest:
            return digest, HashMismatch(f"the uploaded bytes hash to {digest}, not to the given {given_hash}")
        if len(data) > self.max_image_bytes:
            return digest, ImageTooLarge(f"{len(data)} bytes exceed max_image_bytes={self.max_image_bytes}")
        try:
            width, height = probe(data, max_pixels=self.max_image_pixels, loader=self.tower.image_loader)
            layout = self.tower.layout(width, height)  # InvalidImage where the processor refuses the size
        except VisencError as e:
            return digest, e
        decode_cost = -(-DECODE_BYTES_PER_PIXEL * width * height // self._input_bytes)
        return digest, Inspected(digest, layout, self.tower.input_tokens(layout), decode_cost)

    def preprocess(self, data: bytes) -> Prepared:
        return self.tower.preprocess(decode(data, max_pixels=self.max_image_pixels, loader=self.tower.image_loader))
