"""Tiny checkpoints laid out as real hub repositories are: ``hub_layout(kind, out)``."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any

from harness.tiny_families import save_family
from safetensors.torch import load_file, save_file

#: per kind: the prefixes of its vision tensors (tower and projector), as its checkpoint names them
VISION_PREFIXES = {
    "qwen2_5_vl": ("visual.",),
    "gemma3": ("vision_tower.", "multi_modal_projector."),
    "internvl": ("vision_tower.", "multi_modal_projector."),
}
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def hub_layout(kind: str, out: Path, seed: int = 0) -> Path:
    """A folder with ``kind``'s config and processor files and its weights in two shards."""
    saved = save_family(kind, out.with_name(out.name + "-saved"), seed=seed)
    names = list(load_file(str(saved / "model.safetensors")))
    vision = sorted(n for n in names if n.startswith(VISION_PREFIXES[kind]))
    language = sorted(set(names) - set(vision))
    assert vision and len(language) > 1, (kind, sorted(names)[:5])
    reshard(saved, out, [[*language[:1], *vision], language[1:]])
    shutil.rmtree(saved)
    return out


def reshard(source: Path, out: Path, groups: list[list[str]]) -> list[str]:
    """``source``'s files in ``out``, its single ``model.safetensors`` cut into one shard per group of
    tensor names (every tensor in one group), with the index that maps them; returns the shard names."""
    tensors = load_file(str(source / "model.safetensors"))
    assert sorted(n for g in groups for n in g) == sorted(tensors), "every tensor in exactly one shard"
    out.mkdir(parents=True, exist_ok=True)
    shards = [f"model-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)]
    for shard, names in zip(shards, groups, strict=True):
        save_file({n: tensors[n].contiguous() for n in names}, str(out / shard), metadata={"format": "pt"})
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
        "weight_map": {n: shard for shard, names in zip(shards, groups, strict=True) for n in sorted(names)},
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    for f in source.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "model.safetensors.index.json"):
            shutil.copy(f, out / f.name)
    return shards


def safetensors_header(file: Path) -> tuple[dict[str, Any], int]:
    """A shard's header and where its data starts, read here independently of visenc."""
    with file.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def vision_ranges(kind: str, folder: Path) -> dict[str, list[tuple[int, int]]]:
    """shard → the byte ranges ``[start, end)`` of its vision tensors (by the kind's prefixes)."""
    out: dict[str, list[tuple[int, int]]] = {}
    for shard in SHARDS:
        head, data = safetensors_header(folder / shard)
        for name, entry in head.items():
            if name != "__metadata__" and name.startswith(VISION_PREFIXES[kind]):
                begin, end = entry["data_offsets"]
                out.setdefault(shard, []).append((data + begin, data + end))
    return out
