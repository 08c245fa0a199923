"""Preprocessing speed vs transformers' image processors, and equality, for both backends.

For a 1280x720 RGB image (decoded once, outside the timing): per-image time of
the transformers processor (the fast torchvision one for ``--image-backend
torchvision``, the PIL one for ``pil``) vs the tower's ``preprocess`` with the
same backend, their ratio and the max abs difference of the outputs; then the
tower's forward time. The torchvision processors need torchvision
(``make install-test`` installs it); without it those rows are skipped.

    PYTHONPATH=service python bench/bench_preprocess.py [--repeat 20] [--size 1280x720]

(or with the package installed, ``pip install -e .``, no PYTHONPATH).
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

from visenc.imaging.decode import decode
from visenc.models.loading import load_tower

PROCESSORS: dict[tuple[str, str], Any] = {
    ("tiny-qwen2-vl", "pil"): Qwen2VLImageProcessorPil,
    ("tiny-clip", "pil"): CLIPImageProcessorPil,
    ("tiny-siglip", "pil"): SiglipImageProcessorPil,
}
try:  # the fast processors import torchvision
    from transformers import CLIPImageProcessor, Qwen2VLImageProcessor, SiglipImageProcessor

    PROCESSORS |= {
        ("tiny-qwen2-vl", "torchvision"): Qwen2VLImageProcessor,
        ("tiny-clip", "torchvision"): CLIPImageProcessor,
        ("tiny-siglip", "torchvision"): SiglipImageProcessor,
    }
except ImportError as e:
    print(f"no torchvision processors ({e}): only the pil backend is compared")


def _image(width: int, height: int) -> Image.Image:
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([(x * 255 // width), (y * 255 // height), ((x + y) * 127 // (width + height))], -1)
    noisy = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(noisy).save(buffer, "JPEG", quality=90)
    return decode(buffer.getvalue(), max_pixels=100_000_000)


def _time(fn: Callable[[], Any], repeat: int) -> float:
    """Median seconds per call after one warm-up call."""
    fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--size", default="1280x720")
    args = parser.parse_args()
    width, height = (int(v) for v in args.size.split("x"))
    image = _image(width, height)
    print(f"image {width}x{height}, torch threads {torch.get_num_threads()}, median of {args.repeat}")
    header = ("tower", "backend", "transformers ms", "ours ms", "speedup", "max abs diff", "forward ms")
    print(f"{header[0]:<16}{header[1]:<13}{header[2]:>16}{header[3]:>10}{header[4]:>9}{header[5]:>14}{header[6]:>12}")
    for (name, backend), processor_class in sorted(PROCESSORS.items()):
        tower = load_tower(name, image_backend=backend)
        processor = processor_class(**tower.settings.processor_kwargs())  # type: ignore[attr-defined]
        ref = processor(images=[image], return_tensors="np")["pixel_values"]
        ours = tower.preprocess(image).pixels
        ref = ref.reshape(ours.shape)
        diff = float(np.abs(ours - ref).max())
        t_ref = _time(lambda p=processor: p(images=[image], return_tensors="np"), args.repeat)
        t_ours = _time(lambda t=tower: t.preprocess(image), args.repeat)
        prepared = tower.preprocess(image)
        t_fwd = _time(lambda t=tower, p=prepared: t.forward([p]), max(3, args.repeat // 4))
        print(
            f"{name:<16}{backend:<13}{t_ref * 1e3:>16.2f}{t_ours * 1e3:>10.2f}{t_ref / t_ours:>8.2f}x"
            f"{diff:>14.3g}{t_fwd * 1e3:>12.1f}"
        )


if __name__ == "__main__":
    main()
