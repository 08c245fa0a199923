"""A checkpoint's weights identity, computed the same way by visenc and by an engine's connector: per tensor,
its name, dtype, shape and a sample of its bytes (docs/integration-vllm.md)."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: a tensor this small is digested whole
SAMPLE_BYTES = 4096
#: else this many slices of ``SAMPLE_BYTES // SAMPLES`` bytes: its start, end and evenly between
SAMPLES = 4
INDEX_FILE = "model.safetensors.index.json"


def read_header(file: Path) -> tuple[dict[str, Any], int]:
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length)), 8 + length


def tensor_files(folder: Path) -> dict[str, Path]:
    """tensor name → the safetensors file of ``folder`` that holds it (its index, else every file's header)."""
    index = folder / INDEX_FILE
    if index.is_file():
        return {n: folder / f for n, f in json.loads(index.read_text())["weight_map"].items()}
    out: dict[str, Path] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(dict.fromkeys((n for n in read_header(file)[0] if n != "__metadata__"), file))
    return out


def _sample(fd: int, start: int, nbytes: int) -> bytes:
    if nbytes <= SAMPLE_BYTES:
        return os.pread(fd, nbytes, start)
    part = SAMPLE_BYTES // SAMPLES
    offsets = [(nbytes - part) * i // (SAMPLES - 1) for i in range(SAMPLES)]
    return b"".join(os.pread(fd, part, start + at) for at in offsets)


def weights_identity(where: Mapping[str, Path]) -> str:
    """128-bit digest (32 hex) of the tensors ``where`` names (name → its safetensors file)."""
    digest = hashlib.sha256()
    headers: dict[Path, tuple[dict[str, Any], int]] = {}
    fds: dict[Path, int] = {}
    try:
        for name in sorted(where):
            file = where[name]
            if file not in headers:
                headers[file] = read_header(file)
                fds[file] = os.open(file, os.O_RDONLY)
            head, data = headers[file]
            entry = head[name]
            begin, end = entry["data_offsets"]
            digest.update(json.dumps([name, entry["dtype"], entry["shape"]]).encode())
            digest.update(_sample(fds[file], data + begin, end - begin))
    finally:
        for fd in fds.values():
            os.close(fd)
    return digest.hexdigest()[:32]
