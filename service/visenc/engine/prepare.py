"""CPU work on one image or video, in the preprocessing pool: inspect an upload, preprocess it."""

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
    decode_cost: int


@dataclass(frozen=True, slots=True)
class Tube:
    """One tube of a video: its key, cost, and two frames resized to the target (``[2, C, H, W]`` uint8)."""

    inspected: Inspected
    frames: torch.Tensor
    grid_hw: tuple[int, int]


@dataclass(frozen=True, slots=True)
class Video:
    hash: str
    grid_thw: tuple[int, int, int]
    tubes: list[Tube]


#: a job's input before preprocessing: an image's bytes, or a video's tube
Source = bytes | Tube


class ImagePrep:
    """Immutable after construction; called from the preprocess pool's threads."""

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
        """Hash (and check) uploaded bytes and read the size from the header: the hash and the image or its error."""
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
        """Hash (and check) a video's frames and cut them into tubes: the hash and the video or its error."""
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
        """A job's tower input: an image decoded and preprocessed, or a tube's frames patchified."""
        if isinstance(source, Tube):
            assert self.tower.video is not None
            return self.tower.tube_input(self.tower.video.tube_pixels(source.frames), source.grid_hw)
        return self.tower.preprocess(decode(source, max_pixels=self.max_image_pixels, loader=self.tower.image_loader))
