"""Same-host shared memory: index entries exported as tmpfs files, leased to clients."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from visenc import lives
from visenc.errors import Overloaded
from visenc.metrics import Metrics
from visenc.tasks import spawn
from visenc_client.format import Entry

log = logging.getLogger(__name__)

#: a segment (or the probe) of one life: ``visenc-<life>-<n>``, ``visenc-<life>.probe-<token>``
_NAME = re.compile(r"visenc-([0-9a-f]{16})(?:-\d+|\.probe-[0-9a-f]{8})")
#: as earlier versions named them, by PID: swept where that PID does not run
_PID_NAME = re.compile(r"visenc-(\d+)-(?:[0-9a-f]{8}-\d+|probe-[0-9a-f]{8})")


@dataclass(slots=True)
class Segment:
    name: str
    entry: Entry
    expires_at: float

    @property
    def nbytes(self) -> int:
        return self.entry.nbytes


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True


def sweep_stale(directory: str, own: str = "") -> list[str]:
    """Unlink segments left by lives of visenc that no longer run (``own``: this life, kept); returns their
    names. A life runs while it holds its lock (``visenc.lives``), whatever its PID."""
    names = os.listdir(directory)  # raises if shm_dir is not a directory: fail at start-up
    ours = ((n, m.group(1)) for n in names if (m := _NAME.fullmatch(n)))
    removed = lives.sweep(directory, own, ours)
    for name in names:
        m = None if _NAME.fullmatch(name) else _PID_NAME.fullmatch(name)
        if m is not None and not _pid_alive(int(m.group(1))) and lives.unlink(os.path.join(directory, name)):
            removed.append(name)
    return removed


def _write(path: str, data: bytes | bytearray | memoryview) -> None:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def _unlink_all(paths: list[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class SegmentPool:
    """The service's shared-memory segments (see the module docstring for the contract).

    Only touched from the event loop thread; file writes and unlinks run in
    worker threads."""

    def __init__(
        self,
        directory: str,
        *,
        lease_s: float,
        max_bytes: int,
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory = directory
        self.lease_s = lease_s
        self.max_bytes = max_bytes
        self.life = lives.Life(directory)
        #: a file of the pool's own holding ``token``: how a client tells it is on this host
        self.token = secrets.token_hex(16)
        self.bytes = 0
        self._metrics = metrics
        self._clock = clock
        self._segments: dict[str, Segment] = {}
        self._writing: dict[str, asyncio.Future[Segment]] = {}
        self._count = 0
        self._reaper: asyncio.Task[None] | None = None

    @property
    def prefix(self) -> str:
        return f"visenc-{self.life.id}-"

    @property
    def probe(self) -> str:
        return f"visenc-{self.life.id}.probe-{self.token[:8]}"

    async def start(self) -> None:
        await asyncio.to_thread(self.life.begin)
        try:
            await self.sweep()
            await asyncio.to_thread(_write, self._path(self.probe), self.token.encode())
        except BaseException:  # a start that fails leaves nothing: no probe, no lock file
            await asyncio.to_thread(_unlink_all, [self._path(self.probe)])
            self.life.end()
            raise
        self._reaper = spawn(self._reap_forever(), "shm-reaper", self._metrics)

    def describe(self) -> dict[str, str]:
        """Where a client finds the probe segment, and the token it holds: a client that reads the same
        token there shares this host's shared memory with the service."""
        return {"dir": self.directory, "probe": self.probe, "token": self.token}

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            try:
                await self._reaper
            except asyncio.CancelledError:
                pass
        paths = [self._path(s.name) for s in self._segments.values()] + [self._path(self.probe)]
        self._segments.clear()
        self.bytes = 0
        _unlink_all(paths)  # shutdown: nothing else is waiting on the loop
        self.life.end()
        self._gauges()

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def _gauges(self) -> None:
        self._metrics.shm_segments.set(len(self._segments))
        self._metrics.shm_bytes.set(self.bytes)

    async def export(self, key: str, entry: Entry) -> Segment:
        """The segment holding ``entry``, written if needed; its lease is renewed either way."""
        segment = self._segments.get(key)
        if segment is not None and segment.entry is entry:
            segment.expires_at = self._clock() + self.lease_s
            return segment
        pending = self._writing.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[Segment] = asyncio.get_running_loop().create_future()
        self._writing[key] = future
        try:
            segment = await self._create(key, entry)
            future.set_result(segment)
            return segment
        except BaseException as e:
            future.set_exception(e)
            future.exception()  # retrieved: joiners re-raise it, nobody else must log it
            raise
        finally:
            del self._writing[key]

    async def _create(self, key: str, entry: Entry) -> Segment:
        if self.bytes + entry.nbytes > self.max_bytes:
            await self.reap()
            if self.bytes + entry.nbytes > self.max_bytes:
                raise Overloaded(
                    f"shared-memory budget is full (shm_max_bytes={self.max_bytes}); "
                    "fetch over HTTP or retry after the leases expire",
                    retry_after_s=self.lease_s,
                )
        self._count += 1
        name = f"{self.prefix}{self._count}"
        self.bytes += entry.nbytes  # reserved before the write, so concurrent exports see it
        try:
            await asyncio.to_thread(_write, self._path(name), entry.blob)
        except BaseException as e:
            self.bytes -= entry.nbytes
            await asyncio.to_thread(_unlink_all, [self._path(name)])
            if isinstance(e, OSError) and e.errno == errno.ENOSPC:
                raise Overloaded(f"no room left in {self.directory} for shared-memory segments") from e
            raise
        segment = Segment(name, entry, self._clock() + self.lease_s)
        old = self._segments.get(key)
        self._segments[key] = segment
        if old is not None:  # a stale copy of an entry encoded again: its lease still runs
            self._segments[f"{key}#{old.name}"] = old
        self._gauges()
        return segment

    async def reap(self) -> int:
        """Unlink every segment whose lease has expired; returns how many."""
        now = self._clock()
        expired = [k for k, s in self._segments.items() if s.expires_at <= now]
        paths = []
        for k in expired:
            segment = self._segments.pop(k)
            self.bytes -= segment.nbytes
            paths.append(self._path(segment.name))
        if paths:
            await asyncio.to_thread(_unlink_all, paths)
            self._gauges()
        return len(paths)

    async def sweep(self) -> None:
        """Unlink what lives of visenc that ended left in the directory (this one's own are kept)."""
        stale = await asyncio.to_thread(sweep_stale, self.directory, self.life.id)
        if stale:
            log.warning("removed %s shared-memory files left by visenc processes that ended", len(stale))

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 4)
            try:
                await self.reap()
                await self.sweep()  # lives that ended meanwhile: another replica sharing the directory
            except OSError:
                log.exception("reaping shared-memory segments failed")
