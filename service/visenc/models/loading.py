"""``load_tower``: a built-in tower by name, or the vision tower of a local checkpoint.

Only the vision tower is built and only its tensors are read (the language model is never instantiated);
where they sit in the checkpoint is derived from its names, never assumed. Supported checkpoints and the
weights digest: ``docs/models.md``, ``docs/internals.md``.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig, CLIPVisionModelWithProjection, SiglipVisionModel

from visenc.imaging.video import VideoPreprocess, video_config, video_rule
from visenc.models.base import VisionTower
from visenc.models.building import build_empty, resolve_dtype, set_attention
from visenc.models.clip import FixedPreprocess, FixedResolutionTower
from visenc.models.families import FAMILIES
from visenc.models.qwen2vl import ARCHITECTURES, QwenPreprocess, QwenVisionTower
from visenc.models.registry import REGISTRY, build_registered
from visenc.models.vlm import FamilyTower, load_processor, vision_only


def load_tower(
    spec: str,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    max_pixels: int | None = None,
    seed: int = 0,
    image_loader: str = "vllm",
    image_backend: str = "torchvision",
) -> VisionTower:
    """Build a tower from a registry name (``REGISTRY``) or a local checkpoint folder.

    ``dtype``: ``float32`` (CPU) or ``bfloat16``/``float16`` (GPU hosts);
    ``device``: any torch device string; ``max_pixels``: Qwen resize ceiling
    (overrides the checkpoint's preprocessor config); ``seed``: weights of
    registry towers; ``image_loader``: whose loader's RGB conversion the tower's
    inputs follow (``imaging.decode.LOADERS``, part of the fingerprint);
    ``image_backend``: whose image-processor backend the pixels equal,
    ``torchvision`` (the fast processors engines run) or ``pil``. Raises
    ``ValueError`` for unknown specs, unsupported model types, or checkpoints
    without vision weights.
    """
    torch_dtype = resolve_dtype(dtype)
    torch_device = torch.device(device)
    if spec in REGISTRY:
        tower = build_registered(
            spec, dtype=torch_dtype, device=torch_device, max_pixels=max_pixels, seed=seed, backend=image_backend
        )
    else:
        path = Path(spec)
        if not (path / "config.json").is_file():
            raise ValueError(
                f"unknown tower {spec!r}: neither a built-in name ({sorted(REGISTRY)}) nor a folder with config.json"
            )
        tower = _load_checkpoint(
            path, dtype=torch_dtype, device=torch_device, max_pixels=max_pixels, backend=image_backend
        )
    tower.image_loader = image_loader
    tower.video = video_settings(tower, None if spec in REGISTRY else Path(spec))
    return tower


#: where transformers' ``AutoVideoProcessor`` looks for a checkpoint's video processor settings
VIDEO_CONFIG_FILES = ("processor_config.json", "video_preprocessor_config.json", "preprocessor_config.json")


def video_settings(tower: VisionTower, path: Path | None) -> VideoPreprocess | None:
    """The video processor settings of a tower that encodes video (``VisionTower.video_rule``): the
    checkpoint's own (``path``), of the video processor class they resolve to (``video_rule``;
    ``None`` for one visenc does not follow), else the processor class's defaults, with the model's patch, merge
    and temporal sizes where the settings do not state them. Settings that disagree with the model
    raise ``ValueError``."""
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
    path: Path, *, dtype: torch.dtype, device: torch.device, max_pixels: int | None, backend: str
) -> VisionTower:
    model_type = json.loads((path / "config.json").read_text()).get("model_type")
    processor_cfg = _read_json(path / "preprocessor_config.json")
    if model_type in ARCHITECTURES:
        config = AutoConfig.from_pretrained(path).vision_config
        set_attention(config)
        model_class = ARCHITECTURES[model_type][1]
        model = build_empty(lambda: model_class(config))
        digest = _load_vision_weights(model, path)
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
        return QwenVisionTower(
            name=str(path), model=model, preprocess=settings, source=source, dtype=dtype, device=device
        )
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
        digest = _load_vision_weights(model, path)
        return FixedResolutionTower(
            name=str(path),
            model=model,
            preprocess=replace(defaults.with_processor_config(processor_cfg), backend=backend),
            source={"checkpoint": model_type, "weights": digest},
            dtype=dtype,
            device=device,
        )
    if model_type in FAMILIES:
        return _load_family(FAMILIES[model_type], path, dtype=dtype, device=device, backend=backend)
    raise ValueError(
        f"unsupported model_type {model_type!r} in {path}; supported: {[*ARCHITECTURES, *FAMILIES, 'clip', 'siglip']}"
    )


def _load_family(
    family: type[FamilyTower], path: Path, *, dtype: torch.dtype, device: torch.device, backend: str
) -> VisionTower:
    """A VLM family's image path: its vision submodules on a weight-less host, their tensors alone read."""
    config = AutoConfig.from_pretrained(path)
    for sub in (config, getattr(config, "vision_config", None)):
        if sub is not None:
            set_attention(sub)
    model = build_empty(lambda: vision_only(family.model_class(), config, family.vision_modules(config)))
    digest = _load_vision_weights(model, path)
    return family(
        name=str(path),
        config=config,
        model=model,
        processor=load_processor(path, backend),
        source={"checkpoint": config.model_type, "weights": digest},
        dtype=dtype,
        device=device,
        backend=backend,
    )


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _shards(path: Path) -> dict[str, list[str]] | None:
    """shard file → tensor names, from the index; ``None`` for a single-file checkpoint."""
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return None
    by_file: dict[str, list[str]] = {}
    for name, filename in json.loads(index.read_text())["weight_map"].items():
        by_file.setdefault(filename, []).append(name)
    return by_file


def _header(file: Path) -> dict[str, Any]:
    """The safetensors JSON header (8-byte little-endian length, then JSON): no tensor data read."""
    with file.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length))


def derive_renames(names: list[str], params: set[str], buffers: set[str]) -> dict[str, str]:
    """checkpoint tensor name → module state-dict name, derived from the checkpoint itself.

    Checkpoints put the same vision tensors under different prefixes (``visual.``,
    ``model.visual.``, ``vision_tower.``, ``model.vision_tower.``, ``model.vision_model.``
    and ``model.connector.``, ...; the projector's may differ from the tower's). For each
    top-level submodule of the module, the prefix is the one under which the checkpoint
    holds *every* parameter of that submodule; buffers are taken where present. Ties go to
    the prefix more names agree on; a submodule no prefix covers is reported before any
    tensor is read.
    """
    wanted = params | buffers
    votes: dict[tuple[str, str], set[str]] = {}
    for name in names:
        parts = name.split(".")
        for i in range(len(parts)):
            key = ".".join(parts[i:])
            if key in wanted:
                prefix = ".".join(parts[:i]) + ("." if i else "")
                votes.setdefault((key.split(".")[0], prefix), set()).add(key)
    groups: dict[str, set[str]] = {}
    for key in params:
        groups.setdefault(key.split(".")[0], set()).add(key)
    mapping: dict[str, str] = {}
    problems: list[str] = []
    for group, keys in sorted(groups.items()):
        full = [(len(found), prefix) for (g, prefix), found in votes.items() if g == group and keys <= found]
        if not full:
            best = max((len(found & keys) for (g, _), found in votes.items() if g == group), default=0)
            missing = sorted(keys - set().union(*(f for (g, _), f in votes.items() if g == group)))
            problems.append(f"{group}: {len(keys) - best} of {len(keys)} tensors missing (e.g. {missing[:2]})")
            continue
        full.sort(key=lambda c: (-c[0], len(c[1])))
        prefix = full[0][1]
        mapping.update({prefix + key: key for key in votes[(group, prefix)]})
    if problems:
        raise ValueError("checkpoint vision tensors do not match the model: " + "; ".join(problems))
    return mapping


def _transformers_names(model: torch.nn.Module, names: list[str]) -> dict[str, str]:
    """checkpoint name → the name transformers' ``from_pretrained`` gives it for this module
    (its registered key renamings, scoped per submodule); identity where it has none."""
    from transformers import PreTrainedModel
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    if not isinstance(model, PreTrainedModel):
        return {n: n for n in names}
    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    return {n: rename_source_key(n, renamings, [])[0] for n in names}


def _load_vision_weights(model: torch.nn.Module, path: Path) -> str:
    """Read only the vision tensors into ``model`` (every parameter must be found); returns the
    weights digest."""
    shards = _shards(path)
    if shards is None:
        single = path / "model.safetensors"
        if not single.is_file():
            raise ValueError(f"no model.safetensors or model.safetensors.index.json in {path}")
        shards = {single.name: list(_header(single).keys())}
    params = {name for name, _ in model.named_parameters()}
    buffers = set(model.state_dict()) - params
    names = [n for names in shards.values() for n in names]
    try:
        renames = derive_renames(names, params, buffers)
    except ValueError:
        # Hub checkpoints older than the module layout (e.g. SigLIP's ``vision_model.`` inside
        # ``vision_tower.``): read the names as transformers' own loader renames them
        canonical = _transformers_names(model, names)
        found = derive_renames(list(canonical.values()), params, buffers)
        renames = {n: found[c] for n, c in canonical.items() if c in found}
    # shards holding no vision tensor are never opened
    wanted = {f: {n: renames[n] for n in names if n in renames} for f, names in shards.items()}
    wanted = {f: selection for f, selection in wanted.items() if selection}
    hasher = hashlib.sha256()
    state: dict[str, torch.Tensor] = {}
    for filename in sorted(wanted):
        file = path / filename
        header = _header(file)
        selection = wanted[filename]
        entries = {name: header[name] for name in sorted(selection)}
        hasher.update(json.dumps([filename, file.stat().st_size, entries], sort_keys=True).encode())
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in sorted(selection):
                tensor = f.get_tensor(name)
                hasher.update(tensor.contiguous().view(-1).view(torch.uint8).numpy().data)
                state[selection[name]] = tensor
    missing, unexpected = model.load_state_dict(state, strict=False)
    if set(missing) & params or unexpected:
        raise ValueError(f"checkpoint tensors do not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return hasher.hexdigest()
