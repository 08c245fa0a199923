"""A model named by its hub id (``ORG/NAME[@REVISION]``): ``open_repo``."""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from visenc.errors import ModelUnavailable
from visenc.models.hub_errors import Offline, Patience, Unreachable, first_line, hub_answers
from visenc.models.hub_fetch import (
    DATA_SHA256,
    RangesNotServed,
    RemoteFile,
    data_sha256,
    fetch_tensors,
    leftovers,
    size_text,
)
from visenc.models.weights import INDEX_FILE, SINGLE_FILE, Checkpoint, header, shard_map, tensor_names

log = logging.getLogger("visenc")

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
#: the files a tower is built from, besides the weights (the index says where the weights are)
CONFIG_FILES = (
    "config.json",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    INDEX_FILE,
)
VISION_FILE = "vision.safetensors"
#: how long a start waits out a hub that says "try later" (``Settings.hub_wait_s``)
HUB_WAIT_S = 300.0
#: ``--download-dir``: the vision-only files go under its ``visenc/``; unset: under ``$HF_HOME/visenc``
DOWNLOAD_DIR: Path | None = None


def looks_like_path(spec: str) -> bool:
    """A spelling only a path has: it starts with ``.``, ``/`` or ``~``, or has more than one ``/`` before any
    ``@REVISION`` (a hub id has one)."""
    return spec.startswith((".", "/", "~")) or spec.partition("@")[0].count("/") > 1


def parse_spec(spec: str, revision: str | None) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` of ``ORG/NAME[@REVISION]`` (``revision`` where it has none); ``None`` otherwise."""
    repo_id, at, pinned = spec.partition("@")
    if not REPO_ID.match(repo_id) or (at and not pinned):
        return None
    if pinned and revision and pinned != revision:
        raise ModelUnavailable(f"two revisions asked: {pinned!r} in the name and {revision!r} by --revision")
    return repo_id, pinned or revision


@dataclass(frozen=True)
class Snapshot:
    """A repository at one commit, its config files in the hub cache's snapshot ``folder``."""

    repo_id: str
    revision: str
    commit: str
    folder: Path
    files: frozenset[str]
    offline: Unreachable | None


def open_repo(repo_id: str, revision: str | None, wait_s: float = HUB_WAIT_S) -> Checkpoint:
    """The checkpoint of ``repo_id`` at ``revision``; a hub that says "try later" is waited out for ``wait_s``."""
    patience = Patience(wait_s)
    snapshot = resolve(repo_id, revision, patience)
    name = repo_id if revision is None else f"{repo_id}@{revision}"
    return Checkpoint(name=name, folder=snapshot.folder, weights=HubWeights(snapshot, patience))


def resolve(repo_id: str, pinned: str | None, patience: Patience) -> Snapshot:
    """The revision as the hub resolves it, config files fetched; from the cache where the hub cannot serve."""
    from huggingface_hub import constants

    revision = pinned or "main"
    while True:
        try:
            if constants.is_offline_mode():
                raise Offline("HF_HUB_OFFLINE is set")
            return ask_hub(repo_id, pinned)
        except Unreachable as e:
            cached = from_cache(repo_id, revision, e)
            if cached is not None:
                return cached
            if not patience.after(e):
                where = f"the hub cache ({constants.HF_HUB_CACHE}) does not hold {revision}"
                waited = "" if not e.waited_out else f" ({patience.spent()})"
                raise ModelUnavailable(f"{e}, and {where}{waited}") from e


def ask_hub(repo_id: str, pinned: str | None) -> Snapshot:
    from huggingface_hub import HfApi, constants, hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import RemoteEntryNotFoundError

    revision = pinned or "main"
    started, fetched = time.monotonic(), 0
    with hub_answers(revision):
        api = HfApi()
        info = api.model_info(repo_id, revision=pinned, timeout=constants.HF_HUB_ETAG_TIMEOUT)
        try:  # the revision's commit, recorded in the cache's refs (what a start without the hub reads)
            folder = Path(hf_hub_download(repo_id, "config.json", revision=revision)).parent
        except RemoteEntryNotFoundError as e:
            raise ModelUnavailable(f"the repository has no config.json at {revision}: not a transformers model") from e
        files = listing(api, repo_id, folder.name, info.siblings if info.sha == folder.name else None)
        for name in CONFIG_FILES[1:]:
            if name in files and not isinstance(try_to_load_from_cache(repo_id, name, revision=folder.name), str):
                fetched += Path(hf_hub_download(repo_id, name, revision=folder.name)).stat().st_size
    log.info(
        "%s@%s: commit %s; config files in %s (%s fetched in %.1f s)",
        repo_id,
        revision,
        folder.name,
        folder,
        size_text(fetched),
        time.monotonic() - started,
    )
    return Snapshot(repo_id, revision, folder.name, folder, files, None)


def listing(api: Any, repo_id: str, commit: str, siblings: list[Any] | None) -> frozenset[str]:
    from huggingface_hub.hf_api import RepoFile

    if siblings is not None:
        return frozenset(s.rfilename for s in siblings)
    tree = api.list_repo_tree(repo_id, revision=commit, recursive=True)
    return frozenset(f.path for f in tree if isinstance(f, RepoFile))


def from_cache(repo_id: str, revision: str, why: Unreachable) -> Snapshot | None:
    from huggingface_hub import try_to_load_from_cache

    config = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    if not isinstance(config, str):
        return None
    folder = Path(config).parent
    files = frozenset(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    log.warning("%s@%s: %s; serving commit %s from the cache (%s)", repo_id, revision, why, folder.name, folder)
    return Snapshot(repo_id, revision, folder.name, folder, files, why)


@dataclass
class HubWeights:
    """The weights of a ``Snapshot``: the vision-only file, else cached shards, else the wanted bytes fetched."""

    snapshot: Snapshot
    patience: Patience = field(default_factory=lambda: Patience(HUB_WAIT_S))
    _remote: dict[str, RemoteFile] = field(default_factory=dict)
    #: the vision file's header where it is whole, else ``None``, by the file's (inode, size, mtime)
    _checked: dict[tuple[int, int, int], dict[str, Any] | None] = field(default_factory=dict)

    @property
    def vision_file(self) -> Path:
        from huggingface_hub import constants
        from huggingface_hub.file_download import repo_folder_name

        repo = repo_folder_name(repo_id=self.snapshot.repo_id, repo_type="model")
        root = DOWNLOAD_DIR if DOWNLOAD_DIR is not None else Path(constants.HF_HOME)
        return root / "visenc" / repo / self.snapshot.commit / VISION_FILE

    def vision_header(self) -> dict[str, Any] | None:
        """The vision file's header if it is there and whole, checked once per version of the file."""
        try:
            st = self.vision_file.stat()
        except FileNotFoundError:
            return None
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        if key not in self._checked:
            self._checked[key] = whole_file(self.vision_file)
        return self._checked[key]

    def names(self) -> list[str]:
        head = self.vision_header()
        if head is not None:
            return json.loads(head["__metadata__"]["checkpoint_names"])  # type: ignore[no-any-return]
        with hub_answers(self.snapshot.revision):
            return [n for names in self.shards().values() for n in names]

    def shards(self) -> dict[str, list[str]]:
        s = self.snapshot
        if INDEX_FILE in s.files:
            return shard_map(json.loads((s.folder / INDEX_FILE).read_text()))
        if SINGLE_FILE in s.files:
            local = s.folder / SINGLE_FILE
            if not local.is_file():
                try:
                    return {SINGLE_FILE: tensor_names(self.remote(SINGLE_FILE).header()[0])}
                except RangesNotServed as e:
                    local = self._whole([SINGLE_FILE], e)[SINGLE_FILE]
            return {SINGLE_FILE: tensor_names(header(local))}
        if isinstance(s.offline, Offline):
            raise ModelUnavailable(f"{s.offline}, and the cache holds none of its weights")
        raise ModelUnavailable(f"the repository has no safetensors weights ({SINGLE_FILE} or {INDEX_FILE})")

    def remote(self, filename: str) -> RemoteFile:
        if filename not in self._remote:
            self._remote[filename] = RemoteFile.open(self.snapshot.repo_id, filename, self.snapshot.commit)
        return self._remote[filename]

    def files(self, wanted: set[str]) -> dict[Path, list[str]]:
        s, vision = self.snapshot, self.vision_file
        if self._holds(wanted):
            log.info("%s: vision weights read from %s (nothing fetched)", s.repo_id, vision)
            return {vision: sorted(wanted)}
        while True:  # a hub that says "try later" is asked again: a fetch resumes where it stopped
            try:
                with hub_answers(s.revision):
                    return self._fetched(wanted)
            except Unreachable as e:
                if not self.patience.after(e):
                    state = "is damaged" if self.vision_header() is None else "lacks some of them"
                    found = f" (its vision file {vision} {state})" if vision.exists() else ""
                    waited = "" if not e.waited_out else f" ({self.patience.spent()})"
                    raise ModelUnavailable(f"{e}, and its vision weights are not in the cache{found}{waited}") from e

    def _fetched(self, wanted: set[str]) -> dict[Path, list[str]]:
        from huggingface_hub import try_to_load_from_cache

        s = self.snapshot
        needed = {f: [n for n in names if n in wanted] for f, names in self.shards().items()}
        needed = {f: names for f, names in needed.items() if names}
        cached = {f: try_to_load_from_cache(s.repo_id, f, revision=s.commit) for f in needed}
        if all(isinstance(p, str) for p in cached.values()):
            log.info("%s: vision weights read from the hub cache's %d shards (nothing fetched)", s.repo_id, len(needed))
            return {Path(str(cached[f])): names for f, names in needed.items()}
        if s.offline is not None:
            if isinstance(s.offline, Offline):
                raise Offline(str(s.offline))
            log.info("%s: the cache lacks its vision weights: fetching them at commit %s", s.repo_id, s.commit)
        try:
            self._fetch(needed)
        except RangesNotServed as e:
            return {path: needed[f] for f, path in self._whole(list(needed), e).items()}
        return {self.vision_file: sorted(wanted)}

    def _whole(self, filenames: list[str], why: RangesNotServed) -> dict[str, Path]:
        """``filenames`` downloaded whole into the hub cache, where the hub does not serve ranges."""
        from huggingface_hub import hf_hub_download

        s = self.snapshot
        log.warning(
            "%s: %s, not the range asked: downloading the %d shard(s) that hold vision weights whole, into the "
            "hub cache",
            s.repo_id,
            why,
            len(filenames),
        )
        return {f: Path(hf_hub_download(s.repo_id, f, revision=s.commit)) for f in filenames}

    def _holds(self, wanted: set[str]) -> bool:
        head = self.vision_header()
        return head is not None and wanted <= set(tensor_names(head))

    @contextmanager
    def _locked(self) -> Iterator[None]:
        from huggingface_hub.utils import WeakFileLock

        lock = self.vision_file.with_suffix(".lock")
        with ExitStack() as held:
            try:
                held.enter_context(WeakFileLock(lock, timeout=0.01))
            except TimeoutError:
                who = self.snapshot.repo_id
                log.info("%s: another process is fetching its vision weights (it holds %s): waiting for it", who, lock)
                held.enter_context(WeakFileLock(lock))
            yield

    def _fetch(self, needed: dict[str, list[str]]) -> None:
        """The needed tensors into the vision file, once however many replicas share the cache."""
        s, vision = self.snapshot, self.vision_file
        vision.parent.mkdir(parents=True, exist_ok=True)
        with self._locked():
            if self._holds({n for names in needed.values() for n in names}):
                log.info("%s: vision weights fetched by another process meanwhile: %s", s.repo_id, vision)
                return
            for stale in leftovers(vision):
                log.info("%s: removing %s, left by a fetch that did not end", s.repo_id, stale)
                stale.unlink(missing_ok=True)
            started = time.monotonic()
            metadata = {"format": "pt", "repo": s.repo_id, "commit": s.commit}
            metadata["checkpoint_names"] = json.dumps(self.names())
            wanted = {self.remote(f): names for f, names in needed.items()}
            done = fetch_tensors(vision, wanted, metadata, f"{s.repo_id} vision weights")
        log.info(
            "%s: fetched %s of vision weights%s (%d tensors from %d of %d shards; %s of shard headers; %d ranged "
            "requests) in %.1f s into %s",
            s.repo_id,
            size_text(done.tensor_bytes),
            f" ({size_text(done.kept_bytes)} kept from an earlier fetch)" if done.kept_bytes else "",
            sum(len(v) for v in needed.values()),
            done.shards,
            len(self.shards()),
            size_text(done.header_bytes),
            done.requests,
            time.monotonic() - started,
            vision,
        )


def whole_file(file: Path) -> dict[str, Any] | None:
    """The header of the vision file where it is whole (its data's checksum matches ``DATA_SHA256``)."""
    try:
        with file.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            (length,) = struct.unpack("<Q", f.read(8))
            if 8 + length > size:
                raise ValueError(f"a header of {length} bytes in a file of {size}")
            head = json.loads(f.read(length))
            meta = head["__metadata__"]
            end = 8 + length + max((e["data_offsets"][1] for n, e in head.items() if n != "__metadata__"), default=0)
            if end != size:
                raise ValueError(f"{size} bytes where its header says {end}")
            json.loads(meta["checkpoint_names"])
            if data_sha256(f.fileno(), 8 + length, size) != meta[DATA_SHA256]:
                raise ValueError("its bytes do not match their checksum")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        log.warning("%s is damaged (%s): not read", file, first_line(e))
        return None
    return head  # type: ignore[no-any-return]
