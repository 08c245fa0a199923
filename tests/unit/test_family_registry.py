"""One family registry: a family is its own module, registered by being there. A module written into the
families package (or named by a ``visenc.families`` entry point) and nothing else is loaded and served:
its built-in tower by name, its checkpoints by ``model_type``."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from harness.images import png_bytes
from harness.paths import ROOT
from harness.processes import serve_process
from safetensors.torch import save_file
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

from visenc import preflight
from visenc.models import families, registry
from visenc.models.loading import load_tower
from visenc_client import Client

#: a whole family in one file: Qwen2-VL's vision tower at 2 blocks, 128 wide
FAMILY = """
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

from visenc.models.construct import build_empty, build_seeded, set_attention
from visenc.models.qwen2vl import QwenPreprocess, QwenVisionTower
from visenc.models.registry import Family, read_vision_weights


def config():
    c = Qwen2VLVisionConfig(depth=2, embed_dim=64, hidden_size=128, num_heads=2, spatial_merge_size=2)
    set_attention(c)
    return c


def tower(name, model, source, options):
    settings = QwenPreprocess(backend=options.backend)
    return QwenVisionTower(
        name=name, model=model, preprocess=settings, source=source, dtype=options.dtype, device=options.device
    )


def build(name, options):
    model = build_seeded(lambda: Qwen2VisionTransformerPretrainedModel(config()), options.seed)
    return tower(name, model, {"registry": name, "seed": options.seed}, options)


def load(checkpoint, model_type, options):
    model = build_empty(lambda: Qwen2VisionTransformerPretrainedModel(config()))
    digest = read_vision_weights(model, checkpoint.weights)
    return tower(checkpoint.name, model, {"checkpoint": model_type, "weights": digest}, options)


FAMILIES = (Family(("visenc_test_vl",), load, {"tiny-test-vl": build}),)
"""


def checkpoint(folder: Path) -> Path:
    """A checkpoint of the test family: its ``config.json`` and the vision tensors (seeded)."""
    folder.mkdir()
    torch.manual_seed(7)
    config = Qwen2VLVisionConfig(depth=2, embed_dim=64, hidden_size=128, num_heads=2, spatial_merge_size=2)
    model = Qwen2VisionTransformerPretrainedModel(config)
    save_file({f"visual.{k}": v.contiguous() for k, v in model.state_dict().items()}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"model_type": "visenc_test_vl"}))
    return folder


@pytest.fixture
def fresh_registry() -> Iterator[None]:
    registry.registered.cache_clear()
    yield
    registry.registered.cache_clear()


def test_a_module_in_the_families_package_is_all_a_family_needs(tmp_path, monkeypatch, fresh_registry) -> None:
    extra = tmp_path / "more_families"
    extra.mkdir()
    assert "tiny-test-vl" not in registry.built_in_names()
    (extra / "test_vl.py").write_text(FAMILY)
    monkeypatch.setattr(families, "__path__", [*families.__path__, str(extra)])
    registry.registered.cache_clear()
    assert "tiny-test-vl" in registry.built_in_names() and "visenc_test_vl" in registry.registered()[0]
    built = load_tower("tiny-test-vl")
    assert built.hidden_size == 128 and built.source == {"registry": "tiny-test-vl", "seed": 0}
    loaded = load_tower(str(checkpoint(tmp_path / "ckpt")))
    assert loaded.source["checkpoint"] == "visenc_test_vl" and len(loaded.source["weights"]) == 64
    assert loaded.layout(112, 84).num_tokens == built.layout(112, 84).num_tokens == 12


def test_a_name_registered_twice_is_refused(tmp_path, monkeypatch, fresh_registry) -> None:
    extra = tmp_path / "more_families"
    extra.mkdir()
    (extra / "again.py").write_text(FAMILY.replace('"tiny-test-vl"', '"tiny-qwen2-vl"'))
    monkeypatch.setattr(families, "__path__", [*families.__path__, str(extra)])
    with pytest.raises(ValueError, match="'tiny-qwen2-vl' is registered twice"):
        registry.registered()


def test_the_tiny_built_ins_are_families_like_any_other() -> None:
    by_type, built = registry.registered()
    assert sorted(built) == ["tiny-clip", "tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-siglip"]
    assert by_type["qwen2_vl"].built_in.keys() >= {"tiny-qwen2-vl"} and "tiny-clip" in by_type["clip"].built_in


def installed(site: Path) -> Path:
    """``site`` holding the test family as a distribution with a ``visenc.families`` entry point."""
    meta = site / "visenc_test_family-0.dist-info"
    meta.mkdir(parents=True)
    (site / "visenc_test_family.py").write_text(FAMILY)
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: visenc-test-family\nVersion: 0\n")
    (meta / "entry_points.txt").write_text(textwrap.dedent("[visenc.families]\ntest_vl = visenc_test_family\n"))
    return site


def test_preflight_knows_the_built_in_names_of_installed_families(tmp_path, monkeypatch, fresh_registry) -> None:
    with pytest.raises(preflight.StartError, match="neither a built-in name"):
        preflight.check_model("tiny-test-vl")
    monkeypatch.syspath_prepend(str(installed(tmp_path / "site")))
    preflight.check_model("tiny-test-vl")
    assert "tiny-test-vl" in preflight.built_in_names() and set(preflight.BUILT_IN) < set(preflight.built_in_names())
    with pytest.raises(preflight.StartError, match="tiny-test-vl"):
        preflight.check_model("tiny-nothing")


@pytest.mark.slow
def test_a_family_named_by_an_entry_point_is_served(tmp_path) -> None:
    """Out of the tree: a module and its distribution's ``visenc.families`` entry point, on the path of a
    real ``visenc serve``, serve that family's checkpoint."""
    site = installed(tmp_path / "site")
    folder = checkpoint(tmp_path / "ckpt")
    path = ":".join(str(p) for p in (ROOT / "service", ROOT / "clients", ROOT, site))
    with serve_process("--model", str(folder), "--max-wait-ms", "1", env={"PYTHONPATH": path}) as url:
        with Client(url) as vc:
            assert vc.model()["hidden_size"] == 128
            (h,) = vc.encode([png_bytes(3, 112, 84)])
            rows = vc.fetch(h)
    assert h.status == "ready" and rows.shape == (12, 128) and np.isfinite(rows).all()
