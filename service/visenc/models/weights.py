"""Where a checkpoint's tensors are, and which of them a vision module takes: ``Checkpoint``."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from visenc.errors import ModelUnavailable

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class Weights(Protocol):
    def names(self) -> list[str]: ...

    def files(self, wanted: set[str]) -> dict[Path, list[str]]: ...


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint to build a tower from: its served ``name``, config ``folder`` and ``weights``."""

    name: str
    folder: Path
    weights: Weights


def header(file: Path) -> dict[str, Any]:
    """The safetensors JSON header (8-byte little-endian length, then JSON): no tensor data read."""
    with file.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length))  # type: ignore[no-any-return]


def tensor_names(safetensors_header: dict[str, Any]) -> list[str]:
    return [n for n in safetensors_header if n != "__metadata__"]


def shard_map(index: dict[str, Any]) -> dict[str, list[str]]:
    by_file: dict[str, list[str]] = {}
    for name, filename in index["weight_map"].items():
        by_file.setdefault(filename, []).append(name)
    return by_file


@dataclass(frozen=True)
class LocalWeights:
    folder: Path

    def shards(self) -> dict[str, list[str]]:
        index = self.folder / INDEX_FILE
        if index.is_file():
            return shard_map(json.loads(index.read_text()))
        single = self.folder / SINGLE_FILE
        if not single.is_file():
            raise ModelUnavailable(f"no {SINGLE_FILE} or {INDEX_FILE} in {self.folder}")
        return {SINGLE_FILE: tensor_names(header(single))}

    def names(self) -> list[str]:
        return [n for names in self.shards().values() for n in names]

    def files(self, wanted: set[str]) -> dict[Path, list[str]]:
        out = {self.folder / f: [n for n in names if n in wanted] for f, names in self.shards().items()}
        return {f: names for f, names in out.items() if names}


def derive_renames(names: list[str], params: set[str], buffers: set[str]) -> dict[str, str]:
    """checkpoint tensor name → module state-dict name, derived from the checkpoint itself."""
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
        raise ModelUnavailable("its vision tensors do not match the model: " + "; ".join(problems))
    return mapping


def transformers_names(model: Any, names: list[str]) -> dict[str, str]:
    """checkpoint name → the name transformers' ``from_pretrained`` gives it for this module (its key renamings)."""
    from transformers import PreTrainedModel
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    if not isinstance(model, PreTrainedModel):
        return {n: n for n in names}
    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    return {n: rename_source_key(n, renamings, [])[0] for n in names}


def vision_renames(model: Any, names: list[str]) -> dict[str, str]:
    """checkpoint name → ``model`` state-dict name for every vision tensor (``derive_renames``, else transformers')."""
    params = {name for name, _ in model.named_parameters()}
    buffers = set(model.state_dict()) - params
    try:
        return derive_renames(names, params, buffers)
    except ModelUnavailable:
        canonical = transformers_names(model, names)
        found = derive_renames(list(canonical.values()), params, buffers)
        return {n: found[c] for n, c in canonical.items() if c in found}
