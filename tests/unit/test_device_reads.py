"""A forward of every packed family reads nothing back from the device (``tests/support/device_reads.py``).

Each read of a device tensor on the host (a size, a grid, a length) waits for every kernel queued
before it, so the next batch's launches wait behind the previous batch. On the ``meta`` device, where
a device tensor has no values to read, a forward of a mixed-size batch runs to the end with no read
and no blocking copy, for Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4.1V and Mistral 3; the models' own
paths (grids and sizes on the device) read, so the check can fail. On a CUDA device the same
forwards run under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from harness.tiny_families import save_family
from PIL import Image
from tests.support.device_reads import DeviceRead, DeviceReads

from visenc.models.loading import load_tower

SIZES = [(224, 224), (300, 200), (97, 131), (61, 500)]
FAMILIES = ("qwen3_vl", "glm4v", "mistral3")
PACKED = ("tiny-qwen2-vl", "tiny-qwen2.5-vl", *FAMILIES)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: save_family(name, tmp_path_factory.mktemp(name)) for name in FAMILIES}


def _tower(name: str, checkpoints: dict[str, Path], **kwargs: Any) -> Any:
    return load_tower(str(checkpoints[name]) if name in checkpoints else name, image_backend="pil", **kwargs)


def _batch(tower: Any, sizes: list[tuple[int, int]] = SIZES) -> list[Any]:
    rng = np.random.default_rng(4)
    return [tower.preprocess(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))) for w, h in sizes]


@pytest.mark.parametrize("name", PACKED)
def test_a_packed_forward_reads_nothing_back_from_the_device(name: str, checkpoints: dict[str, Path]) -> None:
    tower = _tower(name, checkpoints, device="meta")
    assert tower.packable  # on a device every one of them packs images of different sizes
    batch = _batch(tower)
    with DeviceReads():
        rows = tower.forward(batch)
    assert [r.shape for r in rows] == [(p.layout.num_tokens, tower.hidden_size) for p in batch]
    assert all(r.device.type == "meta" for r in rows)


#: towers that batch without packing; their forwards keep on the host what transformers reads there
UNPACKED = ("llava_onevision", "idefics3", "smolvlm")


@pytest.fixture(scope="module")
def unpacked(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: save_family(name, tmp_path_factory.mktemp(name)) for name in UNPACKED}


@pytest.mark.parametrize("name", UNPACKED)
def test_an_unpacked_forward_reads_nothing_back(name: str, unpacked: dict[str, Path]) -> None:
    tower = _tower(name, unpacked, device="meta")
    batch = _batch(tower, [(224, 224), (300, 200)])
    with DeviceReads():
        rows = tower.forward(batch)
    assert [r.shape for r in rows] == [(p.layout.num_tokens, tower.hidden_size) for p in batch]


@pytest.mark.parametrize("name", UNPACKED)
def test_their_own_paths_read_back(name: str, unpacked: dict[str, Path]) -> None:
    """transformers' ``get_image_features`` with every input on the device reads it back (the check can fail)."""
    tower = _tower(name, unpacked, device="meta")
    inputs = tower.collate([p.pixels for p in _batch(tower, [(224, 224)])])
    moved = {k: v.to(tower.device, non_blocking=True) for k, v in inputs.items()}
    with pytest.raises((DeviceRead, NotImplementedError)), DeviceReads(), torch.inference_mode():
        # a read of a ``meta`` tensor's values, or of a shape that depends on them (``nonzero``), fails
        tower.model.get_image_features(**tower.feature_kwargs(moved))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the sync check is CUDA's own)")
@pytest.mark.parametrize("name", UNPACKED)
def test_cuda_unpacked_forward_has_no_sync(name: str, unpacked: dict[str, Path]) -> None:
    tower = _tower(name, unpacked, device="cuda", dtype="bfloat16")
    _no_sync_in_second_forward(tower, _batch(tower, [(224, 224), (300, 200)]))


def _no_sync_in_second_forward(tower: Any, batch: list[Any]) -> None:
    """The batch's second forward under CUDA's sync check (the first picks kernels, and may synchronise)."""
    tower.forward(batch)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rows = tower.forward(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [r.shape[0] for r in rows] == [p.layout.num_tokens for p in batch]


def test_a_video_tube_forward_reads_nothing_back(checkpoints: dict[str, Path]) -> None:
    tower = _tower("qwen3_vl", checkpoints, device="meta")
    geometry = tower.video_geometry()
    grid = (4, 6)
    width = 3 * geometry["temporal_patch_size"] * geometry["patch_size"] ** 2
    tube = tower.tube_input(np.zeros((grid[0] * grid[1], width), np.float32), grid)
    with DeviceReads():
        (rows,) = tower.forward([tube])
    assert rows.shape == (tube.layout.num_tokens, tower.hidden_size)


def _own_path(name: str, tower: Any, batch: list[Any]) -> None:
    """The model's own forward of the batch, every input on the device (as transformers runs it)."""
    if name.startswith("tiny-"):
        tower.use_varlen(False)
        tower.forward(batch)
        return
    inputs = tower.collate([p.pixels for p in batch])
    moved = {k: v.to(tower.device, non_blocking=True) for k, v in inputs.items()}
    with torch.inference_mode():
        tower.model.get_image_features(**tower.feature_kwargs(moved))


@pytest.mark.parametrize("name", PACKED)
def test_the_models_own_paths_read_back(name: str, checkpoints: dict[str, Path]) -> None:
    """The check can fail: with the grid or the sizes on the device, transformers reads them back."""
    tower = _tower(name, checkpoints, device="meta")
    batch = _batch(tower)
    with pytest.raises(DeviceRead), DeviceReads():
        _own_path(name, tower, batch)


def test_a_blocking_copy_to_the_device_counts_too() -> None:
    with pytest.raises(DeviceRead, match="blocking copy"), DeviceReads():
        torch.tensor([0, 4, 9], device="meta")
    with pytest.raises(DeviceRead, match="blocking copy"), DeviceReads():
        torch.arange(3).to("meta")
    with DeviceReads():
        torch.arange(3).to("meta", non_blocking=True)
        torch.arange(3).tolist()  # host tensors are read freely


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the sync check is CUDA's own)")
@pytest.mark.parametrize("name", PACKED)
def test_cuda_forward_has_no_sync(name: str, checkpoints: dict[str, Path]) -> None:
    tower = _tower(name, checkpoints, device="cuda", dtype="bfloat16")
    batch = _batch(tower)
    tower.forward(batch)  # the first forward picks the attention kernel (its probe synchronises)
    assert tower.attention_kernel != "per-segment"  # a varlen kernel: the per-segment one reads its bounds
    _no_sync_in_second_forward(tower, batch)


def test_llava_onevision_makes_its_lengths_as_the_tower_expects() -> None:
    """The tower keeps on the host the one tensor ``pack_image_features`` makes from a list of ints (its
    per-image lengths), which ``get_image_features`` drops: pinned against the installed transformers."""
    import inspect

    from transformers.models.llava_onevision import modeling_llava_onevision as modeling

    pack = inspect.getsource(modeling.LlavaOnevisionModel.pack_image_features)
    assert "feature_lens = torch.tensor(feature_lens" in pack
    features = inspect.getsource(modeling.LlavaOnevisionModel.get_image_features)
    assert "image_features, feature_lens = self.pack_image_features(" in features
    assert features.count("feature_lens") == 1  # made, and never read
