"""``load_tower``: a built-in tower by name, or the vision tower of a local or hub checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from visenc.errors import ModelUnavailable
from visenc.imaging.video import VideoPreprocess, video_config, video_rule
from visenc.models import hub, sim
from visenc.models.base import VisionTower
from visenc.models.construct import resolve_dtype
from visenc.models.registry import TowerOptions, build_registered, built_in_names, load_registered, read_json
from visenc.models.weights import Checkpoint, LocalWeights, vision_renames
from visenc_client.checkpoint import weights_identity


def load_tower(
    spec: str,
    *,
    revision: str | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    max_pixels: int | None = None,
    seed: int = 0,
    image_loader: str = "vllm",
    image_backend: str = "torchvision",
    hub_wait_s: float = hub.HUB_WAIT_S,
) -> VisionTower:
    """Build a tower from a registry name, a local checkpoint folder or a hub id (``ORG/NAME[@REVISION]``)."""
    options = TowerOptions(resolve_dtype(dtype), torch.device(device), max_pixels, image_backend, seed)
    folder = None
    if spec.startswith(sim.PREFIX):
        tower: VisionTower = sim.load(spec)
    elif spec in built_in_names():
        tower = build_registered(spec, options)
    else:
        checkpoint = open_checkpoint(spec, revision, hub_wait_s)
        folder = checkpoint.folder
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
        tower = load_registered(checkpoint, model_type, options)
        tower.weights = _weights_of(checkpoint, tower.model)
    tower.image_loader = image_loader
    tower.video = video_settings(tower, folder)
    return tower


def open_checkpoint(spec: str, revision: str | None = None, hub_wait_s: float = hub.HUB_WAIT_S) -> Checkpoint:
    """A local folder with a ``config.json`` (it wins over a hub id of the same spelling, as in vLLM), else a hub id."""
    path = Path(spec).expanduser()
    if (path / "config.json").is_file():
        if revision is not None:
            raise ModelUnavailable(f"a revision ({revision!r}) was asked of a local folder")
        return Checkpoint(name=str(path), folder=path, weights=LocalWeights(path))
    if hub.looks_like_path(spec) and not path.exists():
        raise ModelUnavailable(f"{spec}: no such folder (a path: not looked up on the hub)")
    repo = hub.parse_spec(spec, revision)
    if repo is None:
        raise ModelUnavailable(
            f"unknown tower {spec!r}: neither a built-in name ({built_in_names()}), a folder with config.json, "
            "nor a hub id ORG/NAME[@REVISION]"
        )
    return hub.open_repo(*repo, hub_wait_s)


#: where transformers' ``AutoVideoProcessor`` looks for a checkpoint's video processor settings
VIDEO_CONFIG_FILES = ("processor_config.json", "video_preprocessor_config.json", "preprocessor_config.json")


def video_settings(tower: VisionTower, path: Path | None) -> VideoPreprocess | None:
    """The video processor settings of a video tower: the checkpoint's own, else its processor class's defaults."""
    if tower.video_rule is None:
        return None
    files = {} if path is None else {name: read_json(path / name) for name in VIDEO_CONFIG_FILES}
    config = video_config(files)
    rule = video_rule(config, tower.video_rule)
    if rule is None:
        return None
    geometry = tower.video_geometry()
    settings = VideoPreprocess.from_config(rule, {**geometry, **config})
    if any(getattr(settings, k) != v for k, v in geometry.items()):
        raise ValueError(f"the video processor's patch, merge or temporal size differ from the model's {geometry}")
    return settings


def _weights_of(checkpoint: Checkpoint, model: torch.nn.Module) -> dict[str, Any]:
    names = set(vision_renames(model, checkpoint.weights.names()))
    where = {n: f for f, found in checkpoint.weights.files(names).items() for n in found}
    return {"identity": weights_identity(where), "tensors": sorted(where)}
