"""load_tower from checkpoint folders: only vision weights read, outputs equal the full model's.

Tiny full models (vision + language) are built with seeded weights and
written with ``save_pretrained`` (single file and sharded), then loaded
back as towers. Tolerance: fp32, atol 1e-5.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import safetensors
import torch
from harness.images import make_image
from safetensors.torch import load_file, save_file
from transformers import (  # the fast (torchvision) processors: the default backend
    CLIPConfig,
    CLIPImageProcessor,
    CLIPModel,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessor,
    SiglipConfig,
    SiglipImageProcessor,
    SiglipModel,
)

import visenc.models.registry as registry
from visenc.models.loading import load_tower

ATOL = 1e-5
SMALL_TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2}
TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
}
VISION = {"depth": 2, "num_heads": 4, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}
QWEN_MODELS = {
    "qwen2_vl": (
        Qwen2VLForConditionalGeneration,
        lambda: Qwen2VLConfig(vision_config={**VISION, "embed_dim": 64, "hidden_size": 64}, text_config=TEXT),
    ),
    "qwen2_5_vl": (
        Qwen2_5_VLForConditionalGeneration,
        lambda: Qwen2_5_VLConfig(
            vision_config={
                **VISION,
                "hidden_size": 64,
                "intermediate_size": 128,
                "out_hidden_size": 64,
                "fullatt_block_indexes": [1],
            },
            text_config=TEXT,
        ),
    ),
}


class _Spy:
    """Stands in for ``safetensors.safe_open`` in the loader: records files and tensors read."""

    def __init__(self) -> None:
        self.files: list[str] = []
        self.tensors: list[str] = []

    def __call__(self, filename: str, **kwargs: Any) -> Any:
        self.files.append(Path(filename).name)
        spy = self

        class _Handle:
            def __enter__(self) -> _Handle:
                self.inner = safetensors.safe_open(filename, **kwargs).__enter__()
                return self

            def __exit__(self, *exc: object) -> None:
                self.inner.__exit__(*exc)

            def get_tensor(self, name: str) -> torch.Tensor:
                spy.tensors.append(name)
                return self.inner.get_tensor(name)

            def __getattr__(self, attr: str) -> Any:
                raise AssertionError(f"loader used safe_open().{attr}; only get_tensor is spied")

        return _Handle()


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> _Spy:
    recorder = _Spy()
    monkeypatch.setattr(registry, "safe_open", recorder)
    return recorder


def _seeded(factory: Any, seed: int) -> Any:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return factory().eval()


def _save_qwen(root: Path, kind: str, seed: int, shard: str | None) -> tuple[Path, Any]:
    model_class, make_config = QWEN_MODELS[kind]
    model = _seeded(lambda: model_class(make_config()), seed)
    path = root / f"{kind}-{seed}-{shard}"
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=60_000).save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def qwen_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    root = tmp_path_factory.mktemp("qwen")
    out = {}
    for kind in QWEN_MODELS:
        out[f"{kind}-single"] = _save_qwen(root, kind, 0, None)
        out[f"{kind}-sharded"] = _save_qwen(root, kind, 0, "100KB")
    out["qwen2_vl-seed1"] = _save_qwen(root, "qwen2_vl", 1, None)
    return out


def _reference_features(model: Any, images: list[Any]) -> tuple[torch.Tensor, ...]:
    processor = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=60_000)
    inputs = processor(images=images, return_tensors="pt")
    with torch.inference_mode():
        out = model.get_image_features(pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"])
    return out.pooler_output


@pytest.mark.parametrize("variant", ["single", "sharded"])
@pytest.mark.parametrize("kind", list(QWEN_MODELS))
def test_qwen_checkpoint_equals_full_model(
    qwen_checkpoints: dict[str, tuple[Path, Any]], spy: _Spy, kind: str, variant: str
) -> None:
    path, full = qwen_checkpoints[f"{kind}-{variant}"]
    tower = load_tower(str(path))
    assert tower.packable and tower.hidden_size == 64
    assert tower.settings.max_pixels == 60_000  # type: ignore[attr-defined]  # from preprocessor_config.json
    # only vision tensors were read, and (sharded) only shards that hold some
    assert spy.tensors and all(name.startswith("visual.") for name in spy.tensors)
    weight_map = (
        json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
        if (variant == "sharded")
        else None
    )
    if weight_map is not None:
        vision_shards = {f for n, f in weight_map.items() if n.startswith("visual.")}
        assert set(spy.files) == vision_shards and len(set(weight_map.values())) > len(vision_shards)
        assert sorted(spy.tensors) == sorted(n for n in weight_map if n.startswith("visual."))

    images = [make_image(w, h, seed=i) for i, (w, h) in enumerate([(90, 60), (150, 150), (40, 200)])]
    reference = _reference_features(full, images)
    ours = tower.forward([tower.preprocess(image) for image in images])
    for o, r in zip(ours, reference, strict=True):
        torch.testing.assert_close(o, r, rtol=0, atol=ATOL)


def test_qwen_prefix_model_visual(qwen_checkpoints: dict[str, tuple[Path, Any]], tmp_path: Path) -> None:
    """transformers 4.5x saved ``model.visual.*`` / ``model.language_model.*``: loads the same."""
    source = qwen_checkpoints["qwen2_vl-single"][0]
    shutil.copytree(source, tmp_path / "legacy")
    file = tmp_path / "legacy" / "model.safetensors"
    tensors = load_file(str(file))
    renamed = {
        ("model." + k if k.startswith("visual.") else k.replace("model.", "model.language_model.", 1)): v
        for k, v in tensors.items()
    }
    save_file(renamed, str(file), metadata={"format": "pt"})
    legacy = load_tower(str(tmp_path / "legacy"))
    original = load_tower(str(source))
    image = make_image(80, 70)
    torch.testing.assert_close(
        legacy.forward([legacy.preprocess(image)])[0], original.forward([original.preprocess(image)])[0]
    )
    assert legacy.fingerprint != original.fingerprint  # names are part of the header digest


def test_fingerprint_tracks_weights_dtype_and_pixels(qwen_checkpoints: dict[str, tuple[Path, Any]]) -> None:
    path0 = str(qwen_checkpoints["qwen2_vl-single"][0])
    path1 = str(qwen_checkpoints["qwen2_vl-seed1"][0])
    base = load_tower(path0)
    assert load_tower(path0).fingerprint == base.fingerprint
    assert load_tower(path1).fingerprint != base.fingerprint  # same shapes, other weights
    assert load_tower(path0, dtype="bfloat16").fingerprint != base.fingerprint
    assert load_tower(path0, max_pixels=40_000).fingerprint != base.fingerprint


def test_copied_checkpoint_shares_fingerprint(qwen_checkpoints: dict[str, tuple[Path, Any]], tmp_path: Path) -> None:
    source = qwen_checkpoints["qwen2_vl-sharded"][0]
    shutil.copytree(source, tmp_path / "copy")
    assert load_tower(str(tmp_path / "copy")).fingerprint == load_tower(str(source)).fingerprint


#: a small dual-encoder (CLIP / SigLIP): one text layer, two vision layers at 64 px
TINY_TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2}
TINY_VISION = {
    "image_size": 64,
    "patch_size": 16,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
}


def test_clip_checkpoint_equals_get_image_features(tmp_path: Path, spy: _Spy) -> None:
    config = CLIPConfig(
        text_config=TINY_TEXT,
        vision_config=TINY_VISION,
        projection_dim=48,
    )
    full = _seeded(lambda: CLIPModel(config), 0)
    full.save_pretrained(tmp_path)
    processor = CLIPImageProcessor(size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64})
    processor.save_pretrained(tmp_path)
    tower = load_tower(str(tmp_path))
    assert tower.hidden_size == 48 and not tower.packable
    assert spy.tensors and all(n.startswith(("vision_model.", "visual_projection.")) for n in spy.tensors)

    images = [make_image(w, h, seed=i) for i, (w, h) in enumerate([(90, 60), (64, 64), (33, 120)])]
    pixels = processor(images=images, return_tensors="pt")["pixel_values"]
    with torch.inference_mode():
        reference = full.get_image_features(pixel_values=pixels).pooler_output
    ours = torch.cat(tower.forward([tower.preprocess(image) for image in images]))
    torch.testing.assert_close(ours, reference, rtol=0, atol=ATOL)


def test_siglip_checkpoint_equals_get_image_features(tmp_path: Path, spy: _Spy) -> None:
    config = SiglipConfig(
        text_config=TINY_TEXT,
        vision_config=TINY_VISION,
    )
    full = _seeded(lambda: SiglipModel(config), 0)
    full.save_pretrained(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({"image_processor_type": "SiglipImageProcessor", "size": {"height": 64, "width": 64}})
    )
    tower = load_tower(str(tmp_path))
    assert all(n.startswith("vision_model.") for n in spy.tensors)
    images = [make_image(w, h, seed=i) for i, (w, h) in enumerate([(90, 60), (30, 41)])]
    pixels = SiglipImageProcessor(size={"height": 64, "width": 64})(images=images, return_tensors="pt")
    with torch.inference_mode():
        reference = full.get_image_features(pixel_values=pixels["pixel_values"]).pooler_output
    ours = torch.cat(tower.forward([tower.preprocess(image) for image in images]))
    torch.testing.assert_close(ours, reference, rtol=0, atol=ATOL)


def test_unknown_specs_raise_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown tower"):
        load_tower("no-such-tower")
    with pytest.raises(ValueError, match="no such folder"):  # a path: never looked up on the hub
        load_tower(str(tmp_path / "missing"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="unsupported model_type 'bert'"):
        load_tower(str(tmp_path))
    with pytest.raises(ValueError, match="unsupported dtype"):
        load_tower("tiny-qwen2-vl", dtype="int8")


def test_fingerprint_does_not_depend_on_how_the_checkpoint_is_stored(
    qwen_checkpoints: dict[str, tuple[Path, Any]],
) -> None:
    """The weights digest covers each vision tensor's name, dtype, shape and bytes, not the files that
    hold them: one file or shards (or a vision-only file, or the hub cache) give one fingerprint, so a
    hub id and a local folder of the same checkpoint share index entries."""
    single, sharded = (str(qwen_checkpoints[f"qwen2_vl-{v}"][0]) for v in ("single", "sharded"))
    assert load_tower(single).fingerprint == load_tower(sharded).fingerprint


def test_a_persistent_buffer_missing_from_the_checkpoint_is_reported(tmp_path: Path) -> None:
    """Gemma 4's vision tower keeps its standardisation as persistent buffers (``std_bias``,
    ``std_scale``, allocated empty): a checkpoint without them cannot be served, rather than served
    with whatever memory the weight-less build left there."""
    from harness.tiny_families import build_family
    from transformers import Gemma4ForConditionalGeneration

    model, proc = build_family("gemma4")
    model.config.vision_config.standardize = True
    with_std = Gemma4ForConditionalGeneration(model.config)
    with_std.load_state_dict(model.state_dict(), strict=False)
    with_std.save_pretrained(tmp_path)
    proc.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert "model.vision_tower.std_bias" in tensors  # a persistent buffer: saved with the weights
    load_tower(str(tmp_path), image_backend="pil")
    del tensors["model.vision_tower.std_bias"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing \['vision_tower.std_bias'\]"):
        load_tower(str(tmp_path), image_backend="pil")
