"""CPU work on one image, run in the preprocessing pool: inspect an upload
(hash it, read its size from the header) and preprocess it (decode + the
tower's own preprocessing). Both are pure functions of the bytes.

A video is inspected whole (``inspect_video``): its frames decoded and preprocessed as the
tower's video processor does, cut into tubes, each keyed by its tower input
(``imaging/video.py``). A tube is then a job like an image whose input is already made."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from visenc.errors import HashMismatch, ImageTooLarge, InvalidVideo, VisencError
from visenc.imaging.decode import decode, probe, read_header
from visenc.imaging.video import frames_array
from visenc.models.base import Prepared, TokenLayout, VisionTower
from visenc_client.format import image_hash, video_hash


@dataclass(frozen=True, slots=True)
class Inspected:
    hash: str
    layout: TokenLayout
    #: tower-input tokens the forward processes (the batch budget's unit)
    cost: int
    #: extra staging charge while the image is decoded and preprocessed, in the same units
    #: (``DECODE_BYTES_PER_PIXEL`` of its source, and its input once more)
    decode_cost: int


@dataclass(frozen=True, slots=True)
class Tube:
    """One tube of a video: its key, what it costs, and its two frames resized to the clip's
    target (``[2, C, H, W]`` uint8; its tower input is made only if it is encoded)."""

    inspected: Inspected
    frames: torch.Tensor
    grid_hw: tuple[int, int]


@dataclass(frozen=True, slots=True)
class Video:
    """A video, inspected: its ``(tubes, grid_h, grid_w)`` and its tubes in order."""

    hash: str
    grid_thw: tuple[int, int, int]
    tubes: list[Tube]


#: a job's input before preprocessing: an image's bytes, or a video's tube
Source = bytes | Tube


class ImagePrep:
    def __init__(
        self,
        tower: VisionTower,
        *,
        max_image_bytes: int,
        max_image_pixels: int,
        max_video_frames: int = 768,
        max_video_pixels: int = 128_000_000,
    ) -> None:
        self.tower = tower
        self.max_image_bytes = max_image_bytes
        self.max_image_pixels = max_image_pixels
        self.max_video_frames = max_video_frames
        self.max_video_pixels = max_video_pixels
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
            header = read_header(data, max_pixels=self.max_image_pixels, loader=self.tower.image_loader)
            layout = self.tower.layout(header.width, header.height)  # InvalidImage where the processor refuses it
        except VisencError as e:
            return digest, e
        cost = self.tower.input_tokens(layout)
        # while it is made, the tower's intermediate arrays may hold its input once more
        decode_cost = -(-header.decode_bytes_per_pixel * header.width * header.height // self._input_bytes) + cost
        return digest, Inspected(digest, layout, cost, decode_cost)

    def inspect_video(self, frames: Sequence[bytes], given_hash: str | None) -> tuple[str, Video | VisencError]:
        """Hash (and check) a video's frames, decode them and cut the clip into tubes.

        Returns the video's hash and its tubes, or the per-item error that stops it
        (``HashMismatch``, ``InvalidVideo``, ``InvalidImage``, ``ImageTooLarge``). Every limit is
        checked from the frames' headers before a pixel is decoded."""
        digest = video_hash([image_hash(f) for f in frames])
        if given_hash is not None and given_hash != digest:
            return digest, HashMismatch(f"the frames hash to video {digest}, not to the given {given_hash}")
        video = self.tower.video
        try:
            if video is None:
                raise InvalidVideo(f"the tower {self.tower.name} has no video processor: send images")
            if not frames:
                raise InvalidVideo("a video needs at least one frame")
            if len(frames) > self.max_video_frames:
                raise ImageTooLarge(f"{len(frames)} frames exceed max_video_frames={self.max_video_frames}")
            sizes = set()
            for data in frames:
                if len(data) > self.max_image_bytes:
                    raise ImageTooLarge(f"a frame of {len(data)} bytes exceeds max_image_bytes={self.max_image_bytes}")
                sizes.add(probe(data, max_pixels=self.max_image_pixels, loader=self.tower.image_loader))
            if len(sizes) > 1:
                raise InvalidVideo(f"a video's frames must share one size, got {sorted(sizes)}")
            ((width, height),) = sizes
            # held at once from inspection to the tubes' forwards: the decoded clip, then its tower input
            grid = video.grid(len(frames), height, width)
            resized = grid[0] * video.temporal_patch_size * grid[1] * grid[2] * video.patch_size**2
            pixels = max(len(frames) * width * height, resized)
            if pixels > self.max_video_pixels:
                limit = f"max_video_pixels={self.max_video_pixels}"
                raise ImageTooLarge(f"{pixels} pixels (decoded, or as the tower's input) exceed {limit}")
            decoded = [
                np.asarray(decode(f, max_pixels=self.max_image_pixels, loader=self.tower.image_loader)) for f in frames
            ]
            cut, grid = video.cut(frames_array(decoded))
        except VisencError as e:
            return digest, e
        layout = self.tower.tube_layout(grid[1:])
        cost = self.tower.input_tokens(layout)
        tubes = [Tube(Inspected(video.key(t, grid[1:]), layout, cost, 0), t, grid[1:]) for t in cut]
        return digest, Video(digest, grid, tubes)

    def preprocess(self, source: Source) -> Prepared:
        """A job's tower input: an image decoded and preprocessed, or a tube's frames normalised
        and patchified (resized at inspection)."""
        if isinstance(source, Tube):
            assert self.tower.video is not None
            return self.tower.tube_input(self.tower.video.tube_pixels(source.frames), source.grid_hw)
        return self.tower.preprocess(decode(source, max_pixels=self.max_image_pixels, loader=self.tower.image_loader))
