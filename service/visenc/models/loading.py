"""``load_tower``: a built-in tower by name, or the vision tower of a local or hub checkpoint."""

from __future__ import annotations

import hashlib
import json
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig, CLIPVisionModelWithProjection, SiglipVisionModel

from visenc.errors import ModelUnavailable
from visenc.imaging.video import VideoPreprocess, video_config, video_rule
from visenc.models import hub, sim
from visenc.models.base import VisionTower
from visenc.models.clip import FixedPreprocess, FixedResolutionTower
from visenc.models.construct import build_empty, resolve_dtype, set_attention
from visenc.models.families import FAMILIES
from visenc.models.qwen2vl import ARCHITECTURES, QwenPreprocess, QwenVisionTower
from visenc.models.registry import REGISTRY, build_registered
from visenc.models.vlm import FamilyTower, load_processor, vision_only
from visenc.models.weights import Checkpoint, LocalWeights, Weights, vision_renames
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
    torch_dtype = resolve_dtype(dtype)
    torch_device = torch.device(device)
    folder = None
    if spec.startswith(sim.PREFIX):
        tower: VisionTower = sim.load(spec)
    elif spec in REGISTRY:
        tower = build_registered(
            spec, dtype=torch_dtype, device=torch_device, max_pixels=max_pixels, seed=seed, backend=image_backend
        )
    else:
        checkpoint = open_checkpoint(spec, revision, hub_wait_s)
        folder = checkpoint.folder
        tower = _load_checkpoint(
            checkpoint, dtype=torch_dtype, device=torch_device, max_pixels=max_pixels, backend=image_backend
        )
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
            f"unknown tower {spec!r}: neither a built-in name ({sorted(REGISTRY)}), a folder with config.json, "
            "nor a hub id ORG/NAME[@REVISION]"
        )
    return hub.open_repo(*repo, hub_wait_s)


#: where transformers' ``AutoVideoProcessor`` looks for a checkpoint's video processor settings
VIDEO_CONFIG_FILES = ("processor_config.json", "video_preprocessor_config.json", "preprocessor_config.json")


def video_settings(tower: VisionTower, path: Path | None) -> VideoPreprocess | None:
    """The video processor settings of a video tower: the checkpoint's own, else its processor class's defaults."""
    if tower.video_rule is None:
        return None
    files = {} if path is None else {name: _read_json(path / name) for name in VIDEO_CONFIG_FILES}
    config = video_config(files)
    rule = video_rule(config, tower.video_rule)
    if rule is None:
        return None
    geometry = tower.video_geometry()
    settings = VideoPreprocess.from_config(rule, {**geometry, **config})
    if any(getattr(settings, k) != v for k, v in geometry.items()):
        raise ValueError(f"the video processor's patch, merge or temporal size differ from the model's {geometry}")
    return settings


def _load_checkpoint(
    checkpoint: Checkpoint, *, dtype: torch.dtype, device: torch.device, max_pixels: int | None, backend: str
) -> VisionTower:
    path, name = checkpoint.folder, checkpoint.name
    model_type = json.loads((path / "config.json").read_text()).get("model_type")
    processor_cfg = _read_json(path / "preprocessor_config.json")
    if model_type in ARCHITECTURES:
        config = AutoConfig.from_pretrained(path).vision_config
        set_attention(config)
        model_class = ARCHITECTURES[model_type][1]
        model = build_empty(lambda: model_class(config))
        digest = _load_vision_weights(model, checkpoint.weights)
        settings = QwenPreprocess.from_processor_config(
            {
                "patch_size": config.patch_size,
                "merge_size": config.spatial_merge_size,
                "temporal_patch_size": config.temporal_patch_size,
                **processor_cfg,
            }
        )
        settings = replace(settings, backend=backend)
        if max_pixels is not None:
            settings = replace(settings, max_pixels=max_pixels)
        source = {"checkpoint": model_type, "weights": digest}
        return QwenVisionTower(name=name, model=model, preprocess=settings, source=source, dtype=dtype, device=device)
    if model_type in ("clip", "siglip"):
        full = AutoConfig.from_pretrained(path)
        config = full.vision_config
        set_attention(config)
        if model_type == "clip":
            # CLIPModel projects with the top-level projection_dim, not the vision config's
            config.projection_dim = full.projection_dim
            model = build_empty(lambda: CLIPVisionModelWithProjection(config))
            defaults = FixedPreprocess.clip_default()
        else:
            model = build_empty(lambda: SiglipVisionModel(config))
            defaults = FixedPreprocess.siglip_default()
        digest = _load_vision_weights(model, checkpoint.weights)
        return FixedResolutionTower(
            name=name,
            model=model,
            preprocess=replace(defaults.with_processor_config(processor_cfg), backend=backend),
            source={"checkpoint": model_type, "weights": digest},
            dtype=dtype,
            device=device,
        )
    if model_type in FAMILIES:
        return _load_family(FAMILIES[model_type], checkpoint, dtype=dtype, device=device, backend=backend)
    raise ModelUnavailable(
        f"unsupported model_type {model_type!r}: visenc serves {[*ARCHITECTURES, *FAMILIES, 'clip', 'siglip']}"
    )


def _load_family(
    family: type[FamilyTower], checkpoint: Checkpoint, *, dtype: torch.dtype, device: torch.device, backend: str
) -> VisionTower:
    path = checkpoint.folder
    config = AutoConfig.from_pretrained(path)
    for sub in (config, getattr(config, "vision_config", None)):
        if sub is not None:
            set_attention(sub)
    model = build_empty(lambda: vision_only(family.model_class(), config, family.vision_modules(config)))
    digest = _load_vision_weights(model, checkpoint.weights)
    return family(
        name=checkpoint.name,
        config=config,
        model=model,
        processor=load_processor(path, backend),
        source={"checkpoint": config.model_type, "weights": digest},
        dtype=dtype,
        device=device,
        backend=backend,
    )


def _weights_of(checkpoint: Checkpoint, model: torch.nn.Module) -> dict[str, Any]:
    names = set(vision_renames(model, checkpoint.weights.names()))
    where = {n: f for f, found in checkpoint.weights.files(names).items() for n in found}
    return {"identity": weights_identity(where), "tensors": sorted(where)}


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _load_vision_weights(model: torch.nn.Module, weights: Weights) -> str:
    """Read only the vision tensors into ``model``; returns the weights digest (names, dtypes, shapes, bytes)."""
    renames = vision_renames(model, weights.names())
    where = {n: file for file, names in weights.files(set(renames)).items() for n in names}
    hasher = hashlib.sha256()
    state: dict[str, torch.Tensor] = {}
    with ExitStack() as stack:
        handles = {
            f: stack.enter_context(safe_open(str(f), framework="pt", device="cpu")) for f in sorted(set(where.values()))
        }
        for name in sorted(where):
            tensor = handles[where[name]].get_tensor(name)
            hasher.update(json.dumps([name, str(tensor.dtype), list(tensor.shape)]).encode())
            hasher.update(tensor.contiguous().view(-1).view(torch.uint8).numpy().data)
            state[renames[name]] = tensor
    # ``missing`` holds persistent buffers too (e.g. Gemma 4's clipping bounds): none may keep its built value
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ModelUnavailable(f"its tensors do not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return hasher.hexdigest()
