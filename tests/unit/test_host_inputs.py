"""Each image's input is written once, on a preprocessing thread, into the host buffer the device reads,
in the tower's input dtype where the cast is transformers' own (``VisionTower.stage``): the forward then
copies no host bytes, and its rows are bit for bit those of the float32 input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from visenc.models import sim
from visenc.models.loading import load_tower


def _image(seed: int, w: int = 120, h: int = 90) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_host_cast_gives_transformers_bits(dtype: str) -> None:
    tower = load_tower("tiny-qwen2-vl", dtype=dtype)
    prepared = [tower.preprocess(_image(i, 120 + 28 * i)) for i in range(3)]
    staged = [tower.stage(p) for p in prepared]
    for p, s in zip(prepared, staged):
        assert s.pixels.dtype == tower.dtype
        # transformers' first step on the pixels: ``pixel_values.type(self.visual.dtype)``
        want = torch.from_numpy(p.pixels).type(tower.model.dtype)
        assert torch.equal(s.pixels.view(torch.int16), want.view(torch.int16))
    for a, b in zip(tower.forward(prepared), tower.forward(staged)):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the device's own cast)")
def test_a_host_cast_equals_the_devices() -> None:
    pixels = torch.randn(4096, 1176) * 3
    on_device = pixels.to("cuda").to(torch.bfloat16).cpu()
    assert torch.equal(pixels.to(torch.bfloat16).view(torch.int16), on_device.view(torch.int16))


def test_the_stand_in_charges_the_host_bytes_its_launch_copies() -> None:
    tower = sim.load("sim:launch_ms=0,token_us=1,hidden=8")
    prepared = tower.preprocess(_image(7, 160, 160))
    tower.forward([prepared])
    assert tower.runtime.host_bytes_copied == prepared.pixels.nbytes  # a pageable input: copied at launch
    tower.forward([tower.stage(prepared)])
    assert tower.runtime.host_bytes_copied == prepared.pixels.nbytes  # staged: none more
    tower.runtime.synchronize()


def test_host_buffers_come_from_a_pool() -> None:
    tower = sim.load("sim:launch_ms=0,token_us=1,hidden=8")
    pool = tower.runtime.pool
    for _ in range(5):
        buffer = tower.runtime.host_buffer((100, 3), torch.float32)
        del buffer
    assert pool.allocated == 1


def test_the_host_device_reads_the_input_itself() -> None:
    """On the host the forward reads the preprocessed array: no second copy, and no idle buffers kept
    outside the memory budget (the C heap, held by ``heap.hold_freed``, is the pool)."""
    tower = load_tower("tiny-qwen2-vl")
    prepared = tower.preprocess(_image(3))
    staged = tower.stage(prepared)
    assert staged.pixels.data_ptr() == torch.from_numpy(prepared.pixels).data_ptr()
    assert not hasattr(tower.runtime, "pool")
