"""Mapping the service's shared-memory segments (same host, same user, Linux tmpfs).

The client owns nothing here: it opens a segment the service created, maps it
read-only and closes the descriptor at once. The mapping lives as long as the
arrays viewing it and stays valid after the service unlinks the file, so a
client that exits or is killed leaves nothing behind.
"""

from __future__ import annotations

import mmap
import os
import re

import numpy as np

from visenc_client._exceptions import ProtocolError

#: segment names are plain file names: never a path
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,200}")
#: ``madvise(MADV_POPULATE_READ)`` (Linux 5.14+; Python names it from 3.12): map a range's pages in
#: one call instead of one page fault per 4 KiB as the copy first touches them
_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22 if os.uname().sysname == "Linux" else None)


class SegmentMaps:
    """Segments mapped during one call, each mapped once however many ranges it serves."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._maps: dict[str, mmap.mmap] = {}

    def _map(self, name: str) -> mmap.mmap:
        mapped = self._maps.get(name)
        if mapped is None:
            if not _NAME.fullmatch(name) or name in (".", ".."):
                raise ProtocolError(f"bad shared-memory segment name {name!r}")
            try:
                fd = os.open(os.path.join(self.directory, name), os.O_RDONLY)
            except FileNotFoundError as e:
                # its lease ran out before we got to it: the rows are still served over HTTP
                raise ProtocolError(f"shared-memory segment {name} is gone (lease expired)") from e
            try:
                size = os.fstat(fd).st_size
                mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            self._maps[name] = mapped
        return mapped

    def view(self, name: str, offset: int, nbytes: int, dtype: np.dtype, rows: int, hidden: int) -> np.ndarray:
        """Rows as a read-only ``[rows, hidden]`` array over the mapping (no copy)."""
        if nbytes != rows * hidden * dtype.itemsize:
            raise ProtocolError(f"segment range of {nbytes} bytes does not hold [{rows}, {hidden}] {dtype}")
        if nbytes == 0:
            return np.empty((rows, hidden), dtype)
        mapped = self._map(name)
        if offset < 0 or offset + nbytes > len(mapped):
            raise ProtocolError(f"range {offset}+{nbytes} is outside segment {name} ({len(mapped)} bytes)")
        _populate(mapped, offset, nbytes)
        array: np.ndarray = np.frombuffer(mapped, dtype=dtype, count=rows * hidden, offset=offset)
        return array.reshape(rows, hidden)


def _populate(mapped: mmap.mmap, offset: int, nbytes: int) -> None:
    """Fault in the pages of ``[offset, offset + nbytes)`` at once (a no-op where unsupported)."""
    if _POPULATE_READ is None or nbytes < (1 << 20):
        return
    start = offset - offset % mmap.PAGESIZE
    try:
        mapped.madvise(_POPULATE_READ, start, offset + nbytes - start)
    except (OSError, ValueError):
        pass  # an older kernel: pages fault in as they are read
