"""The weights identity (``visenc_client.checkpoint``): the one visenc says in ``/v1/model`` for a tower read
from the hub (its vision-only file) is the one the connector computes over the engine's full local
checkpoint; a checkpoint whose vision tensors differ gives another; ``EngineWeights`` refuses it naming
both models, and accepts it only when told to."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tests.support.hub import LoopbackHub
from tests.support.hub_checkpoints import SHARDS, hub_layout

from visenc.models.loading import load_tower
from visenc_client._weights import EngineWeights


def redrawn(folder: Path, to: Path) -> Path:
    """A copy of ``folder`` whose first vision tensor's values are redrawn (same names, shapes, dtypes)."""
    shutil.copytree(folder, to)
    tensors = load_file(to / SHARDS[0])
    name = next(n for n in sorted(tensors) if "visual" in n or "vision" in n)
    tensors[name] = torch.randn_like(tensors[name].float()).to(tensors[name].dtype)
    save_file(tensors, to / SHARDS[0], metadata={"format": "pt"})
    return to


def test_the_hub_towers_identity_is_the_local_checkpoints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    folder = hub_layout("qwen2_5_vl", tmp_path / "q")
    with LoopbackHub() as hub:
        hub.publish("acme/q", folder)
        for key, value in {
            "ENDPOINT": hub.url,
            "HUGGINGFACE_CO_URL_TEMPLATE": hub.url + "/{repo_id}/resolve/{revision}/{filename}",
            "HF_HOME": str(tmp_path / "hf"),
            "HF_HUB_CACHE": str(tmp_path / "hf" / "hub"),
            "HF_HUB_OFFLINE": False,
        }.items():
            monkeypatch.setattr(constants, key, value)
        served = load_tower("acme/q").describe()
    assert any((tmp_path / "hf" / "visenc").rglob("vision.safetensors"))  # read from the vision-only file
    assert EngineWeights(str(folder), folder).refusal("U", served) is None
    other = redrawn(folder, tmp_path / "other")
    refusal = EngineWeights(str(other), other).refusal("U", served)
    assert refusal is not None and "'acme/q'" in refusal and repr(str(other)) in refusal and "other weights" in refusal
    assert EngineWeights(str(other), other, accept_other=True).refusal("U", served) is None
    assert "not compared" in str(EngineWeights(str(folder), folder).refusal("U", load_tower("tiny-clip").describe()))


def test_a_checkpoint_without_safetensors_is_said_not_compared(tmp_path: Path) -> None:
    """An engine checkpoint of ``.bin`` files only: the weights could not be compared, not "another model"."""
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0" * 16)
    served = {"name": "acme/q", "weights": {"identity": "0" * 32, "tensors": ["visual.patch_embed.proj.weight"]}}
    refusal = str(EngineWeights("acme/q", tmp_path).refusal("U", served))
    assert "could not be compared" in refusal and "another model" not in refusal, refusal
