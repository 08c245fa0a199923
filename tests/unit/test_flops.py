"""FLOP counting of the Qwen vision towers (``bench/flops.py``, used by ``bench/bench_gpu.py``):
equal to torch's own FLOP counter on the real modules, window attention's partial windows included."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from visenc.models.loading import load_tower

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from flops import qwen_vision_flops  # noqa: E402


@pytest.mark.parametrize(
    ("name", "grid"),
    [
        ("tiny-qwen2-vl", (1, 16, 24)),
        ("tiny-qwen2-vl", (1, 10, 6)),
        ("tiny-qwen2.5-vl", (1, 16, 24)),  # whole windows
        ("tiny-qwen2.5-vl", (1, 12, 20)),  # the last window row and column are partial
        ("tiny-qwen2.5-vl", (1, 2, 34)),
    ],
)
def test_counted_flops_equal_torchs_counter(name: str, grid: tuple[int, int, int]) -> None:
    tower = load_tower(name)
    config = tower.model.config
    config._attn_implementation = "eager"  # matmuls the counter sees (it does not count CPU sdpa)
    t, h, w = grid
    pixels = torch.randn(t * h * w, 3 * config.temporal_patch_size * config.patch_size**2)
    try:
        with FlopCounterMode(display=False) as counter, torch.inference_mode():
            tower.model(pixels, grid_thw=torch.tensor([grid]))
    finally:
        config._attn_implementation = "sdpa"
    assert qwen_vision_flops(config, grid) == counter.get_total_flops()


def test_seven_b_tower_at_1080p_is_in_the_expected_range() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_gpu
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig

    config = Qwen2_5_VLVisionConfig(**bench_gpu.QWEN2_5_VL_7B_VISION)
    grid = (1, 1092 // 14, 1932 // 14)  # 1920x1080 after smart_resize (multiples of 28)
    flops = qwen_vision_flops(config, grid)
    # linear part alone: ~2 x 0.67 G parameters x 10764 patches; attention adds a few percent
    params = 32 * (3 * 1280 * 1280 + 1280 * 1280 + 3 * 1280 * 3420)
    assert 2 * params * grid[1] * grid[2] < flops < 1.3 * 2 * params * grid[1] * grid[2]
    assert bench_gpu.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0


def test_bench_gpu_says_so_without_a_device() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the bench would run for real")
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_gpu.py")], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "no CUDA device"


@pytest.mark.slow
def test_bench_gpu_runs_its_paths_on_a_cpu_with_a_tiny_tower() -> None:
    """The bench's own code, end to end (three towers, warm-up, every path, the JSON line), so a GPU
    run does not find it broken; the figures of a CPU run mean nothing."""
    args = ["--device", "cpu", "--tower", "tiny", "--rounds", "1", "--scenarios", "1080p x1", "--json"]
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_gpu.py"), *args], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    paths = report["scenarios"]["1080p x1"]["paths"]
    assert set(paths) == {"transformers", "visenc eager", "visenc compiled", "compiled per-image"}
    assert all(p["img_s"] > 0 for p in paths.values())
    # bench/gpu_check.py reads the targets out of this line
    import gpu_check

    found = gpu_check.figures(gpu_check.last_json(out.stdout, "scenarios"), None)
    assert [label for label, _ in found["speedup"]] == ["1080p x1"]
