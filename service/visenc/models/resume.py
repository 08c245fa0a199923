"""A vision file being fetched, kept across processes: ``Partial``."""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import threading
from pathlib import Path
from types import TracebackType

log = logging.getLogger("visenc")

#: the largest block (a power of two dividing ``hub_fetch.PART_BYTES``), the smallest, and blocks per fetch
BLOCK_BYTES = 4 << 20
MIN_BLOCK_BYTES = 16 << 10
BLOCKS_PER_FETCH = 64
#: how often the blocks written meanwhile are logged (the data synced first): what a killed fetch loses
RECORD_EVERY_S = 1.0
INCOMPLETE = ".incomplete"
BLOCKS = ".blocks"
LOG_FORMAT = "visenc-blocks 1"


def block_bytes(total: int) -> int:
    """The block size of a fetch of ``total`` bytes: a power of two from ``MIN_BLOCK_BYTES`` to ``BLOCK_BYTES``."""
    n = max(1, total // BLOCKS_PER_FETCH)
    return max(MIN_BLOCK_BYTES, min(BLOCK_BYTES, 1 << (n.bit_length() - 1)))


class Partial:
    """The partial file of ``dest``: ``head`` then the data, block ``[start, end)`` at ``len(head) + start``."""

    def __init__(self, dest: Path, head: bytes, size: int, identity: str) -> None:
        self.path = dest.with_name(dest.name + INCOMPLETE)
        self.log_path = dest.with_name(dest.name + INCOMPLETE + BLOCKS)
        self.head, self.size, self.title = head, size, f"{LOG_FORMAT} {identity}\n"
        self.logged: dict[tuple[int, int], str] = {}
        self.pending: list[tuple[int, int, str]] = []
        self.lock = threading.Lock()
        if not self._resumable():
            self._start()
        self.fd = os.open(self.path, os.O_RDWR)

    def _resumable(self) -> bool:
        try:
            if self.path.stat().st_size != self.size:
                return False
            with self.path.open("rb") as f:
                if f.read(len(self.head)) != self.head:
                    return False
            lines = self.log_path.read_text().splitlines(keepends=True)
        except (FileNotFoundError, UnicodeDecodeError):
            return False
        if not lines or lines[0] != self.title:
            return False
        for line in lines[1:]:
            parts = line.split()
            if line.endswith("\n") and len(parts) == 3 and parts[0].isdigit() and parts[1].isdigit():
                self.logged[int(parts[0]), int(parts[1])] = parts[2]
        if not lines[-1].endswith("\n"):  # a line cut by a kill: the next ones start on their own
            with self.log_path.open("a") as f:
                f.write("\n")
        return True

    def _start(self) -> None:
        with self.path.open("wb") as f:
            f.write(self.head)
            f.truncate(self.size)
        with self.log_path.open("w") as f:
            f.write(self.title)
            f.flush()
            os.fsync(f.fileno())

    def kept(self, blocks: list[tuple[int, int]]) -> set[tuple[int, int]]:
        out = set()
        for block in blocks:
            digest = self.logged.get(block)
            if digest is not None and self._digest(*block) == digest:
                out.add(block)
            elif digest is not None:
                log.warning("%s: bytes %d-%d do not match their logged sha256: fetched again", self.path, *block)
        return out

    def _digest(self, start: int, end: int) -> str:
        return hashlib.sha256(os.pread(self.fd, end - start, len(self.head) + start)).hexdigest()

    def write(self, at: int, data: bytes) -> None:
        os.pwrite(self.fd, data, len(self.head) + at)

    def record(self, start: int, end: int, digest: str) -> None:
        with self.lock:
            self.pending.append((start, end, digest))

    def flush(self) -> None:
        with self.lock:
            pending, self.pending = self.pending, []
        if not pending:
            return
        os.fdatasync(self.fd)
        with self.log_path.open("a") as f:
            f.writelines(f"{s} {e} {d}\n" for s, e, d in pending)
            f.flush()
            os.fsync(f.fileno())

    def finish(self, dest: Path, patch: tuple[int, bytes]) -> None:
        """``patch`` (offset, bytes: the data's checksum) written, the file synced and renamed to ``dest``."""
        with self.lock:
            self.pending.clear()
        os.pwrite(self.fd, patch[1], patch[0])
        os.fsync(self.fd)
        os.replace(self.path, dest)
        self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> Partial:
        return self

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        try:
            self.flush()
        finally:
            os.close(self.fd)


def downloads() -> Path:
    """The folder the vision files are fetched into (``--download-dir`` or ``$HF_HOME``, then ``visenc/``)."""
    from huggingface_hub import constants

    from visenc.models import hub

    return (hub.DOWNLOAD_DIR or Path(constants.HF_HOME)) / "visenc"


def sweep(root: Path) -> list[Path]:
    """Remove the partial files under ``root`` (``<repo>/<commit>/``) of fetches no process runs any more: a
    fetch holds its file's lock (``flock``, by huggingface_hub's ``FileLock``) from its start to its end, so a
    lock this call can take is held by no live process. Returns what was removed."""
    removed: list[Path] = []
    partials = sorted(root.glob(f"*/*/*{INCOMPLETE}*"))
    for lock in sorted({p.with_name(p.name.split(".")[0] + ".lock") for p in partials}):
        try:  # read-only is enough to lock: another user's lock file (0664) is taken as any other
            fd = os.open(lock, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except PermissionError:  # not ours to open: its fetch may run
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a fetch runs: its partial file is its own
            os.close(fd)
            continue
        try:
            for p in lock.parent.glob(lock.stem + f".*{INCOMPLETE}*"):
                p.unlink(missing_ok=True)
                removed.append(p)
        finally:
            os.close(fd)
    return removed
