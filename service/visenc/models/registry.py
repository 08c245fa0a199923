"""The one family registry. A family is a module of ``models/families/`` (or of a package named by a
``visenc.families`` entry point) whose ``FAMILIES`` lists what it serves: ``config.json`` ``model_type``
values and the built-in towers (seeded random weights) it offers by name. ``vlm_families`` is the entry
point of a ``FamilyTower``; a family with another way to load brings its own ``load``."""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import pkgutil
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig

from visenc.errors import ModelUnavailable
from visenc.models.base import VisionTower
from visenc.models.construct import build_empty, set_attention
from visenc.models.vlm import FamilyTower, load_processor, vision_only
from visenc.models.weights import Checkpoint, Weights, vision_renames

#: the entry point group of families outside this package (each names a module with ``FAMILIES``)
ENTRY_POINTS = "visenc.families"


@dataclass(frozen=True)
class TowerOptions:
    dtype: torch.dtype
    device: torch.device
    max_pixels: int | None
    backend: str
    seed: int = 0


#: a tower from a checkpoint: ``(checkpoint, its model_type, options)``
Load = Callable[[Checkpoint, str, TowerOptions], VisionTower]
#: a built-in tower: ``(its name, options)``
Build = Callable[[str, TowerOptions], VisionTower]


@dataclass(frozen=True)
class Family:
    model_types: tuple[str, ...]
    load: Load
    built_in: dict[str, Build] = field(default_factory=dict)


def _modules() -> Iterator[Any]:
    from visenc.models import families

    for found in sorted(pkgutil.iter_modules(families.__path__), key=lambda m: m.name):
        if not found.name.startswith("_"):
            yield importlib.import_module(f"{families.__name__}.{found.name}")
    for point in sorted(entry_points(group=ENTRY_POINTS), key=lambda p: p.name):
        yield point.load()


@functools.cache
def registered() -> tuple[dict[str, Family], dict[str, Build]]:
    """Every family by ``model_type``, and every built-in tower by name (each name registered once)."""
    by_type: dict[str, Family] = {}
    built: dict[str, Build] = {}
    for module in _modules():
        for family in getattr(module, "FAMILIES", ()):
            for name, table in [*((t, by_type) for t in family.model_types), *((n, built) for n in family.built_in)]:
                if name in table:
                    raise ValueError(f"{module.__name__}: {name!r} is registered twice")
            by_type.update(dict.fromkeys(family.model_types, family))
            built.update(family.built_in)
    return by_type, built


def built_in_names() -> list[str]:
    return sorted(registered()[1])


def build_registered(name: str, options: TowerOptions) -> VisionTower:
    """A built-in tower by name."""
    builders = registered()[1]
    if name not in builders:
        raise ValueError(f"unknown tower {name!r}; built-in towers are {sorted(builders)}")
    return builders[name](name, options)


def load_registered(checkpoint: Checkpoint, model_type: str, options: TowerOptions) -> VisionTower:
    """The tower of a checkpoint whose ``config.json`` says ``model_type``."""
    families = registered()[0]
    if model_type not in families:
        raise ModelUnavailable(f"unsupported model_type {model_type!r}: visenc serves {sorted(families)}")
    return families[model_type].load(checkpoint, model_type, options)


def vlm_families(*towers: type[FamilyTower]) -> tuple[Family, ...]:
    """A family per ``FamilyTower`` subclass: the VLM's own image path, read from a full checkpoint."""
    return tuple(Family(tower.model_types, functools.partial(_load_vlm, tower)) for tower in towers)


def _load_vlm(family: type[FamilyTower], checkpoint: Checkpoint, _: str, options: TowerOptions) -> VisionTower:
    config = AutoConfig.from_pretrained(checkpoint.folder)
    for sub in (config, getattr(config, "vision_config", None)):
        if sub is not None:
            set_attention(sub)
    model = build_empty(lambda: vision_only(family.model_class(), config, family.vision_modules(config)))
    digest = read_vision_weights(model, checkpoint.weights)
    return family(
        name=checkpoint.name,
        config=config,
        model=model,
        processor=load_processor(checkpoint.folder, options.backend),
        source={"checkpoint": config.model_type, "weights": digest},
        dtype=options.dtype,
        device=options.device,
        backend=options.backend,
    )


def read_json(path: Any) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def read_vision_weights(model: torch.nn.Module, weights: Weights) -> str:
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
