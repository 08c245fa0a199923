"""Preprocessing speed vs transformers' image processors, and equality, for both backends.

python bench/bench_preprocess.py [--rounds 5] [--repeat 15] [--size 640x480,1280x720]
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
from collections.abc import Callable
from typing import Any

import _common as c  # bench/, this script's folder
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


def _rounds(
    ref: Callable[[], Any], ours: Callable[[], Any], rounds: int, repeat: int
) -> tuple[list[float], float, float]:
    """Per-round speedups (transformers / ours), each round timing both ways with the order
    alternating, and the median ms of each over every round."""
    ratios, t_ref, t_ours = [], [], []
    for r in range(rounds):
        if r % 2 == 0:
            a, b = _time(ref, repeat), _time(ours, repeat)
        else:
            b, a = _time(ours, repeat), _time(ref, repeat)
        t_ref.append(a)
        t_ours.append(b)
        ratios.append(a / b)
    return ratios, statistics.median(t_ref) * 1e3, statistics.median(t_ours) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per row")
    parser.add_argument("--repeat", type=int, default=15, help="calls per way per round (their median)")
    parser.add_argument("--size", default="1280x720", help="WxH, or several: 640x480,1280x720,1920x1080")
    args = parser.parse_args()
    print(
        f"torch threads {torch.get_num_threads()}; each row: {args.rounds} rounds alternating which way runs "
        f"first, each the median of {args.repeat} calls; speedup = transformers / visenc per round"
    )
    header = ("image", "tower", "backend", "transformers ms", "ours ms", "max abs diff", "forward ms")
    print(
        f"{header[0]:<11}{header[1]:<16}{header[2]:<13}{header[3]:>16}{header[4]:>9}{header[5]:>14}{header[6]:>12}"
        "  speedup"
    )
    for size in args.size.split(","):
        width, height = (int(v) for v in size.split("x"))
        image = _image(width, height)
        for (name, backend), processor_class in sorted(PROCESSORS.items()):
            tower = load_tower(name, image_backend=backend)
            processor = processor_class(**tower.settings.processor_kwargs())  # type: ignore[attr-defined]
            ref = processor(images=[image], return_tensors="np")["pixel_values"]
            ours = tower.preprocess(image).pixels
            diff = float(np.abs(ours - ref.reshape(ours.shape)).max())
            ratios, t_ref, t_ours = _rounds(
                lambda p=processor, i=image: p(images=[i], return_tensors="np"),
                lambda t=tower, i=image: t.preprocess(i),
                args.rounds,
                args.repeat,
            )
            prepared = tower.preprocess(image)
            t_fwd = _time(lambda t=tower, p=prepared: t.forward([p]), 3) * 1e3
            print(
                f"{size:<11}{name:<16}{backend:<13}{t_ref:>16.2f}{t_ours:>9.2f}{diff:>14.3g}{t_fwd:>12.1f}"
                f"  {c.spread(ratios)}"
            )


if __name__ == "__main__":
    main()
