"""Video, tube by tube: visenc's tube inputs equal transformers' video processors, and a video's
rows (its tubes', each encoded on its own, concatenated) equal the whole-video forward,
``get_video_features`` of transformers' own model, for Qwen2-VL, Qwen2.5-VL and Qwen3-VL.

Clips cover a resize, odd frame counts (the last tube pairs a frame with itself), a frame
smaller than the patch grid, Qwen3-VL's budget over the whole clip and ``cap_pixels_per_frame``
(a target that depends on the frame count). Pixels: bit-identical. Rows: fp32, within 1e-5 of the
largest value (one forward per tube against one forward for the clip). A control where attention
crosses tubes differs, so the comparison can fail.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from harness.tiny_families import build_family
from tests.support.tiny_processors import save_with_processor
from transformers import AutoVideoProcessor, Qwen2_5_VLConfig, Qwen2_5_VLModel, Qwen2VLConfig, Qwen2VLModel
from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

from visenc.imaging.video import RULES, VideoPreprocess
from visenc.models.base import VisionTower
from visenc.models.loading import load_tower
from visenc.models.vlm import vision_only

#: (frames, height, width): a resize, odd counts, a frame under the patch grid, a wide clip
CLIPS = [(4, 120, 200), (5, 61, 97), (3, 20, 30), (6, 90, 300)]
TOLERANCE = 1e-5


def _clip(t: int, h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (t, h, w, 3), dtype=np.uint8)


def _processor_settings(rule: str, proc: Any) -> VideoPreprocess:
    return VideoPreprocess.from_config(rule, proc.to_dict())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("rule", "cls", "kwargs"),
    [
        ("qwen2", Qwen2VLVideoProcessor, {}),
        ("qwen2", Qwen2VLVideoProcessor, {"cap_pixels_per_frame": True, "max_video_tokens": 200}),
        ("qwen2", Qwen2VLVideoProcessor, {"min_pixels": 3136, "max_pixels": 40000}),
        ("qwen3", Qwen3VLVideoProcessor, {}),
        ("qwen3", Qwen3VLVideoProcessor, {"size": {"shortest_edge": 4096, "longest_edge": 120000}}),
        ("qwen3", Qwen3VLVideoProcessor, {"cap_pixels_per_frame": True, "max_video_tokens": 40}),
    ],
)
def test_tubes_equal_the_video_processor(rule: str, cls: type, kwargs: dict[str, Any]) -> None:
    """Each tube's input is its rows of ``pixel_values_videos`` (bit-identical); the grid is
    ``video_grid_thw``."""
    proc = cls(**kwargs)
    settings = _processor_settings(rule, proc)
    for t, h, w in CLIPS:
        frames = _clip(t, h, w)
        out = proc(
            videos=[frames],
            return_tensors="pt",
            do_sample_frames=False,
            cap_pixels_per_frame=bool(kwargs.get("cap_pixels_per_frame")),
        )
        tubes, grid = settings.tubes(frames)
        assert grid == tuple(out["video_grid_thw"][0].tolist()), (rule, kwargs, (t, h, w))
        assert grid == settings.grid(t, h, w)
        assert np.array_equal(np.concatenate(tubes), out["pixel_values_videos"].numpy()), (rule, kwargs, (t, h, w))


def test_a_cap_makes_the_target_depend_on_the_frame_count() -> None:
    """With ``cap_pixels_per_frame`` the same frames resize otherwise in a longer clip, so their
    tubes get other keys: nothing computed for one length is reused for the other. Without it, the
    first tube of either clip is one key, and one tower input."""
    settings = VideoPreprocess.from_config("qwen2", {"cap_pixels_per_frame": True, "max_video_tokens": 400})
    frames = _clip(8, 300, 400)
    (short,), grid_short = settings.cut(frames[:2])
    long, grid_long = settings.cut(frames)
    assert grid_short[1:] != grid_long[1:]
    assert settings.key(short, grid_short[1:]) != settings.key(long[0], grid_long[1:])
    plain = VideoPreprocess.defaults("qwen2")
    (first,), grid = plain.cut(frames[:2])
    again, grid_again = plain.cut(frames)
    assert grid[1:] == grid_again[1:] and plain.key(first, grid[1:]) == plain.key(again[0], grid_again[1:])
    np.testing.assert_array_equal(plain.tube_pixels(first), plain.tube_pixels(again[0]))


def test_keys_cover_the_frames_their_order_and_the_settings() -> None:
    """Another frame, the two frames swapped, or another normalisation: another key."""
    plain = VideoPreprocess.defaults("qwen2")
    (tube,), grid = plain.cut(_clip(2, 90, 120))
    keys = {
        plain.key(tube, grid[1:]),
        plain.key(tube.flip(0), grid[1:]),
        plain.key(tube.clone().index_fill_(2, torch.tensor([0]), 0), grid[1:]),
        dataclasses.replace(plain, image_std=(0.5, 0.5, 0.5)).key(tube, grid[1:]),
    }
    assert len(keys) == 4


def _tube_rows(tower: VisionTower, frames: np.ndarray) -> tuple[torch.Tensor, tuple[int, int, int]]:
    assert tower.video is not None
    tubes, grid = tower.video.tubes(frames)
    # every tube alone, and the tubes of a clip in one packed batch: both must give the rows
    alone = torch.cat([tower.forward([tower.tube_input(x, grid[1:])])[0] for x in tubes])
    together = torch.cat(tower.forward([tower.tube_input(x, grid[1:]) for x in tubes]))
    torch.testing.assert_close(alone, together, rtol=0, atol=TOLERANCE * alone.abs().max().item())
    return alone, grid


@pytest.mark.parametrize(("name", "config", "base"), [("tiny-qwen2-vl", Qwen2VLConfig, Qwen2VLModel)])
def test_qwen2_vl_tubes_equal_get_video_features(name: str, config: type, base: type) -> None:
    _check_registry_tower(name, config, base)


@pytest.mark.parametrize(("name", "config", "base"), [("tiny-qwen2.5-vl", Qwen2_5_VLConfig, Qwen2_5_VLModel)])
def test_qwen2_5_vl_tubes_equal_get_video_features(name: str, config: type, base: type) -> None:
    _check_registry_tower(name, config, base)


def _check_registry_tower(name: str, config_class: type, base: type) -> None:
    tower = load_tower(name)
    assert tower.video is not None
    model: Any = tower.model  # type: ignore[attr-defined]
    host: Any = vision_only(base, config_class(vision_config=model.config.to_dict()), {"visual": model})
    proc = Qwen2VLVideoProcessor(size={"shortest_edge": tower.video.min_pixels, "longest_edge": tower.video.max_pixels})
    for t, h, w in CLIPS:
        frames = _clip(t, h, w, seed=t)
        inputs = proc(videos=[frames], return_tensors="pt", do_sample_frames=False, cap_pixels_per_frame=False)
        with torch.inference_mode():
            ref = torch.cat(
                host.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"]).pooler_output
            )
        rows, grid = _tube_rows(tower, frames)
        assert grid == tuple(inputs["video_grid_thw"][0].tolist())
        assert rows.shape == ref.shape
        torch.testing.assert_close(rows, ref, rtol=0, atol=TOLERANCE * ref.abs().max().item())
        if grid[0] > 1:  # control: one attention segment over the whole clip differs
            one = inputs["video_grid_thw"].clone()
            one[0, 0], one[0, 1] = 1, grid[0] * grid[1]
            with torch.inference_mode():
                crossed = model(inputs["pixel_values_videos"], grid_thw=one).pooler_output
            assert (crossed - ref).abs().max().item() > 1e-3 * ref.abs().max().item()


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = save_with_processor("qwen3_vl", tmp_path_factory.mktemp("qwen3_vl"))
    model, _ = build_family("qwen3_vl")
    return path, model


@pytest.mark.parametrize("cap", [False, True])
def test_qwen3_vl_tubes_equal_get_video_features(qwen3_vl: tuple[Path, Any], cap: bool) -> None:
    """Deepstack rows included (``[main | ds_1 | ...]``); the settings are the checkpoint's own,
    read as ``AutoVideoProcessor`` reads them."""
    path, model = qwen3_vl
    tower = load_tower(str(path), image_backend="pil")
    proc = AutoVideoProcessor.from_pretrained(path)
    assert tower.video is not None and tower.video == _processor_settings(RULES[type(proc).__name__], proc)
    if cap:
        proc.cap_pixels_per_frame, proc.max_video_tokens = True, 24
        tower.video = _processor_settings("qwen3", proc)
    for t, h, w in CLIPS:
        frames = _clip(t, h, w, seed=t)
        inputs = proc(videos=[frames], return_tensors="pt", do_sample_frames=False, cap_pixels_per_frame=cap)
        with torch.inference_mode():
            out = model.model.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"])
        ref = torch.cat([torch.cat(list(level)) for level in [out.pooler_output, *out.deepstack_features]], dim=-1)
        rows, grid = _tube_rows(tower, frames)
        assert grid == tuple(inputs["video_grid_thw"][0].tolist())
        assert rows.shape == ref.shape == (grid[0] * tower.video.tube_tokens(grid), tower.hidden_size)
        torch.testing.assert_close(rows, ref, rtol=0, atol=TOLERANCE * ref.abs().max().item())


@pytest.mark.parametrize(
    "files",
    [
        {"preprocessor_config.json": {"image_processor_type": "Qwen2VLImageProcessor", "max_pixels": 50000}},
        {"preprocessor_config.json": {"image_processor_type": "Qwen2VLImageProcessorFast", "min_pixels": 8192}},
        {"video_preprocessor_config.json": {"video_processor_type": "Qwen2VLVideoProcessor", "merge_size": 2}},
        {
            "video_preprocessor_config.json": {"video_processor_type": "Qwen3VLVideoProcessor", "max_video_tokens": 9},
            "preprocessor_config.json": {"image_processor_type": "Qwen2VLImageProcessor"},
        },
        {
            "processor_config.json": {
                "video_processor": {"video_processor_type": "Qwen2VLVideoProcessor", "patch_size": 16}
            }
        },
    ],
)
def test_settings_resolve_as_auto_video_processor(qwen3_vl: tuple[Path, Any], files: dict, tmp_path: Path) -> None:
    """Whichever files a checkpoint has, visenc follows the video processor class and settings
    transformers' ``AutoVideoProcessor`` (which vLLM calls) resolves them to."""
    import json
    import shutil

    path, _ = qwen3_vl
    for name in ("config.json", "model.safetensors"):
        shutil.copy(path / name, tmp_path / name)
    for name, content in files.items():
        nested = name == "processor_config.json"
        (tmp_path / name).write_text(json.dumps(content if nested else {"patch_size": 16, **content}))
    proc = AutoVideoProcessor.from_pretrained(tmp_path)
    tower = load_tower(str(tmp_path), image_backend="pil") if files.get("preprocessor_config.json") else None
    from visenc.imaging.video import video_config, video_rule

    config = video_config({n: json.loads((tmp_path / n).read_text()) for n in files})
    rule = video_rule(config, "qwen3")
    assert rule == RULES[type(proc).__name__]
    assert VideoPreprocess.from_config(rule, {"patch_size": 16, **config}) == _processor_settings(rule, proc)
    if tower is not None:
        assert tower.video == _processor_settings(rule, proc)


def test_towers_without_tubes_have_no_video_settings() -> None:
    assert load_tower("tiny-clip").video is None
