"""One life of a process: a lock file it holds with ``flock`` while it runs (docs/operations.md, "Restarts").

The kernel drops the lock when the process ends, however it ends, so what a life left behind is known to
be left once its lock can be taken, whatever PID the next life gets (a container's PID 1 every time)."""

from __future__ import annotations

import fcntl
import os
import re
import secrets
from collections.abc import Iterable

PREFIX = "visenc-life-"
#: ``visenc-life-<id>.lock``; ``.new`` while it is being taken (renamed once held)
LOCK = re.compile(PREFIX + r"([0-9a-f]{16})\.lock(\.new)?")


def lock_path(directory: str, life: str) -> str:
    return os.path.join(directory, f"{PREFIX}{life}.lock")


class Life:
    """This life's lock file in ``directory``, held from ``begin`` to ``end`` (or to the process's end)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.id = secrets.token_hex(8)
        self._fd = -1

    def begin(self) -> None:
        """Take a new id and hold its lock. The file is locked under a temporary name and renamed, so a
        sweeper never finds it unlocked under its final name."""
        life = self.id
        while True:
            final = lock_path(self.directory, life)
            fd = os.open(final + ".new", os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                os.rename(final + ".new", final)
            except FileNotFoundError:  # a sweeper took it for a dead life's before it was held
                os.close(fd)
                life = secrets.token_hex(8)
                continue
            self.id, self._fd = life, fd
            return

    def end(self) -> None:
        """Release the lock (its file removed first: a clean stop leaves nothing)."""
        if self._fd >= 0:
            try:
                os.unlink(lock_path(self.directory, self.id))
            except FileNotFoundError:
                pass
            os.close(self._fd)
            self._fd = -1


def _taken(path: str) -> int | None:
    """A descriptor holding the lock at ``path`` if no live process holds it; ``None`` if one does, the file
    is gone, or it may not be opened here (another user's: its life may run)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, PermissionError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def unlink(path: str) -> bool:
    try:
        os.unlink(path)
    except (FileNotFoundError, PermissionError):
        return False
    return True


def sweep(directory: str, own: str, files: Iterable[tuple[str, str]]) -> list[str]:
    """Unlink the lock files of lives that no longer run, and ``files`` (``(name, life)``) of those lives or of
    lives without a lock file; never anything of ``own`` or of a life whose lock is held. Returns the names."""
    removed = []
    by_life: dict[str, list[str]] = {}
    for name, life in files:
        by_life.setdefault(life, []).append(name)
    for name in os.listdir(directory):
        m = LOCK.fullmatch(name)
        if m is None or m.group(1) == own:
            continue
        fd = _taken(os.path.join(directory, name))
        if fd is None:
            continue
        try:  # that life is over: its files go, then its lock file, while the lock is held here
            removed += [f for f in by_life.pop(m.group(1), []) if unlink(os.path.join(directory, f))]
            if unlink(os.path.join(directory, name)):
                removed.append(name)
        finally:
            os.close(fd)
    for life, names in by_life.items():  # a life's files are made after its lock file and removed before it
        if life != own and not os.path.exists(lock_path(directory, life)):
            removed += [f for f in names if unlink(os.path.join(directory, f))]
    return removed
