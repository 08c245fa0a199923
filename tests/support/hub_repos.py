"""What the loopback hub (``tests/support/hub.py``) holds and records: repositories of blobs at
commits, each request it answered, and its JSON entries (repo-info siblings, tree and paths-info
entries) as the Hugging Face Hub writes them."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


@dataclass(frozen=True)
class Blob:
    path: Path
    size: int
    sha256: str
    git_sha1: str
    lfs: bool

    @classmethod
    def of(cls, path: Path) -> Blob:
        data = path.read_bytes()
        git = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        return cls(path, len(data), hashlib.sha256(data).hexdigest(), git, path.suffix in LFS_SUFFIXES)


@dataclass
class Repo:
    repo_id: str
    gated: bool = False
    private: bool = False
    commits: dict[str, dict[str, Blob]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)

    def commit(self, rev: str) -> str | None:
        return self.refs.get(rev) or (rev if rev in self.commits else None)


@dataclass(frozen=True)
class Request:
    origin: str  # "hub" | "cdn"
    method: str
    path: str
    file: str | None  # repo path of the file served
    byte_range: tuple[int, int] | None  # [start, end) of a 206
    sent: int  # body bytes
    status: int
    at: float = field(default_factory=time.monotonic)  # when it was answered


@dataclass
class Busy:
    """One "try later" answer (``status``, ``Retry-After``) to the next request of ``origin`` (either
    where ``None``), or where ``file`` is set, to its next ranged GET of ``file`` from ``from_byte`` on."""

    status: int = 429
    retry_after: str | None = "1"
    origin: str | None = None
    file: str | None = None
    from_byte: int = 0


def blob_fields(b: Blob) -> dict[str, Any]:
    lfs = {"lfs": {"size": b.size, "sha256": b.sha256, "pointerSize": 134}} if b.lfs else {}
    return {"size": b.size, "blobId": b.git_sha1, **lfs}


def entry(path: str, b: Blob) -> dict[str, Any]:
    lfs = {"lfs": {"oid": b.sha256, "size": b.size, "pointerSize": 134}} if b.lfs else {}
    return {"type": "file", "oid": b.git_sha1, "size": b.size, "path": path, **lfs}


def folder_entry(path: str) -> dict[str, Any]:
    return {"type": "directory", "oid": hashlib.sha1(path.encode()).hexdigest(), "size": 0, "path": path}


def tree(files: dict[str, Blob], sub: str, recursive: bool) -> list[dict[str, Any]]:
    """The entries under ``sub`` (its direct children, or all of them), folders first as the hub lists."""
    prefix = f"{sub}/" if sub else ""
    folders: set[str] = set()
    out = []
    for path, blob in sorted(files.items()):
        if not path.startswith(prefix):
            continue
        rest = path[len(prefix) :].split("/")
        for depth in range(1, len(rest)):
            if recursive or depth == 1:
                folders.add(prefix + "/".join(rest[:depth]))
        if recursive or len(rest) == 1:
            out.append(entry(path, blob))
    return [folder_entry(f) for f in sorted(folders)] + out
