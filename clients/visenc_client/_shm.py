"""Mapping the service's shared-memory segments read-only (docs/internals.md, "Shared-memory segments")."""

from __future__ import annotations

import mmap
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from visenc_client._exceptions import ProtocolError, TransportError, describe
from visenc_client._types import RowRange

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,200}")
#: ``MADV_POPULATE_READ`` (Linux 5.14+; named in Python 3.12+): one call instead of a fault per page
_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22 if os.uname().sysname == "Linux" else None)


@dataclass(slots=True)
class _Mapped:
    map: mmap.mmap
    populated: set[tuple[int, int]]
    file: tuple[int, int]


def _file(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


class _MapCache:
    """Process-wide LRU of segment mappings, bounded in mapped bytes; maps of unlinked segments are dropped."""

    def __init__(self, max_bytes: int, sweep_s: float) -> None:
        self.max_bytes, self.sweep_s = max_bytes, sweep_s
        self._maps: OrderedDict[str, _Mapped] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._sweeper: threading.Thread | None = None

    def get(self, path: str) -> _Mapped | None:
        with self._lock:
            found = self._maps.get(path)
            if found is None:
                return None
            if _file(path) != found.file:
                self._drop(path)
                return None
            self._maps.move_to_end(path)
            return found

    def put(self, path: str, mapped: mmap.mmap, file: tuple[int, int]) -> _Mapped:
        entry = _Mapped(mapped, set(), file)
        with self._lock:
            kept = self._maps.get(path)
            if kept is not None and kept.file == file:
                return kept
            if kept is not None:
                self._drop(path)
            if len(mapped) > self.max_bytes:
                return entry  # too big to keep
            self._maps[path] = entry
            self._bytes += len(mapped)
            while self._bytes > self.max_bytes:
                self._drop(next(iter(self._maps)))
            self._start_sweeper()
        return entry

    def _drop(self, path: str) -> None:
        self._bytes -= len(self._maps.pop(path).map)

    def sweep(self) -> None:
        with self._lock:
            kept = list(self._maps.items())
        gone = [(path, entry) for path, entry in kept if _file(path) != entry.file]
        with self._lock:
            for path, entry in gone:
                if self._maps.get(path) is entry:
                    self._drop(path)

    def _start_sweeper(self) -> None:
        if self.sweep_s > 0 and (self._sweeper is None or not self._sweeper.is_alive()):
            self._sweeper = threading.Thread(target=self._sweep_while_kept, name="visenc-shm-sweep", daemon=True)
            self._sweeper.start()

    def _sweep_while_kept(self) -> None:
        while True:
            time.sleep(self.sweep_s)
            self.sweep()
            with self._lock:
                if not self._maps:
                    self._sweeper = None
                    return

    @property
    def mapped_bytes(self) -> int:
        with self._lock:
            return self._bytes


_CACHE = _MapCache(
    int(os.environ.get("VISENC_SHM_MAP_CACHE_BYTES", 1 << 30)), float(os.environ.get("VISENC_SHM_MAP_SWEEP_S", 1.0))
)


class SegmentMaps:
    def __init__(self, directory: str) -> None:
        self.directory = directory

    def _map(self, name: str) -> _Mapped:
        if not _NAME.fullmatch(name) or name in (".", ".."):
            raise ProtocolError(f"bad shared-memory segment name {name!r}")
        path = os.path.join(self.directory, name)
        found = _CACHE.get(path)
        if found is not None:
            return found
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError as e:
            raise ProtocolError(f"shared-memory segment {name} is gone (lease expired)") from e
        except OSError as e:
            raise TransportError(f"cannot open the segment: {describe(e)}", path) from e
        try:
            st = os.fstat(fd)
            mapped = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except (OSError, ValueError) as e:  # ValueError: an empty file
            raise TransportError(f"cannot map the segment: {describe(e)}", path) from e
        finally:
            os.close(fd)
        return _CACHE.put(path, mapped, (st.st_dev, st.st_ino))

    def nbytes(self, name: str) -> int:
        return len(self._map(name).map)

    def view(self, name: str, offset: int, nbytes: int, dtype: np.dtype, rows: int, hidden: int) -> np.ndarray:
        if nbytes != rows * hidden * dtype.itemsize:
            raise ProtocolError(f"segment range of {nbytes} bytes does not hold [{rows}, {hidden}] {dtype}")
        if nbytes == 0:
            return np.empty((rows, hidden), dtype)
        found = self._map(name)
        mapped, populated = found.map, found.populated
        if offset < 0 or offset + nbytes > len(mapped):
            raise ProtocolError(f"range {offset}+{nbytes} is outside segment {name} ({len(mapped)} bytes)")
        if (offset, nbytes) not in populated:
            _populate(mapped, offset, nbytes)
            populated.add((offset, nbytes))
        array: np.ndarray = np.frombuffer(mapped, dtype=dtype, count=rows * hidden, offset=offset)
        return array.reshape(rows, hidden)


def _populate(mapped: mmap.mmap, offset: int, nbytes: int) -> None:
    if _POPULATE_READ is None or nbytes < (1 << 20):
        return
    start = offset - offset % mmap.PAGESIZE
    try:
        mapped.madvise(_POPULATE_READ, start, offset + nbytes - start)
    except (OSError, ValueError):
        pass


@dataclass(frozen=True, slots=True)
class _Known:
    directory: str
    segment: str
    base: int
    hidden: int
    dtype: np.dtype
    fresh_until: float  #: monotonic


class SegmentHandles:
    """Per client: the segment each image's rows were last named in."""

    def __init__(self, max_images: int = 4096) -> None:
        self.max_images = max_images
        self._known: OrderedDict[str, _Known] = OrderedDict()
        self._spent: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._lock = threading.Lock()
        self.http_fallbacks = 0

    def learn(self, directory: str, lease_s: float, item: dict, dtype: np.dtype) -> None:
        hidden = int(item["shape"][1])
        base = int(item["offset"]) - int(item["start"]) * hidden * dtype.itemsize
        known = _Known(directory, str(item["segment"]), base, hidden, dtype, time.monotonic() + lease_s / 2)
        with self._lock:
            self._known[str(item["hash"])] = known
            self._known.move_to_end(str(item["hash"]))
            while len(self._known) > self.max_images:
                self._known.popitem(last=False)

    def spend(self, ranges: Sequence[RowRange]) -> None:
        with self._lock:
            for r in ranges:
                if r.lease is not None:
                    self._spent[(r.hash, r.lease)] = None
            while len(self._spent) > self.max_images:
                self._spent.popitem(last=False)

    def knows(self, image_hash: str) -> bool:
        with self._lock:
            k = self._known.get(image_hash)
        return k is not None and time.monotonic() < k.fresh_until

    def views(self, ranges: Sequence[RowRange]) -> list[np.ndarray] | None:
        now, out = time.monotonic(), []
        for r in ranges:
            with self._lock:
                k = self._known.get(r.hash)
                owed = r.lease is not None and (r.hash, r.lease) not in self._spent
            if owed or k is None or now >= k.fresh_until or not os.path.exists(os.path.join(k.directory, k.segment)):
                return None
            maps = SegmentMaps(k.directory)
            row_bytes = k.hidden * k.dtype.itemsize
            try:  # swept since the check (a restarted life removes a killed one's): asked for again
                rows = (maps.nbytes(k.segment) - k.base) // row_bytes
                start, end = 0 if r.start is None else r.start, rows if r.end is None else r.end
                if not 0 <= start <= end <= rows:
                    return None
                offset = k.base + start * row_bytes
                out.append(maps.view(k.segment, offset, (end - start) * row_bytes, k.dtype, end - start, k.hidden))
            except ProtocolError:
                return None
        return out


def same_host(model_info: dict[str, object]) -> bool:
    """Whether the service that answered ``model_info`` shares this host's shared memory (its probe reads here)."""
    shm = model_info.get("shm")
    if not isinstance(shm, dict):
        return False
    try:
        name, token = str(shm["probe"]), str(shm["token"])
        if not _NAME.fullmatch(name):
            return False
        with open(os.path.join(str(shm["dir"]), name), "rb") as f:
            return f.read(len(token) + 1) == token.encode()
    except (KeyError, OSError):
        return False
