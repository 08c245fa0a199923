"""The stored value of one image's embedding, version 1 (integers little-endian)::

    offset  size  field
    0       4     magic  b"VENC"
    4       1     version (1)
    5       3     reserved, zero
    8       4     header_len: length of the msgpack header that follows
    12      n     msgpack map {"shape": [rows, hidden], "dtype", "grid_thw": [t, h, w], "fingerprint", "hash"}
    12+n    ...   zero padding up to DATA_OFFSET
    256     rows * hidden * itemsize   the rows, C-contiguous, little-endian

A value that does not match its header is corrupt: a miss, never served.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack
import numpy as np

from visenc_client.format.dtypes import NUMPY_DTYPES

MAGIC = b"VENC"
VERSION = 1
DATA_OFFSET = 256
_PREFIX = struct.Struct("<4sB3xI")

KINDS = ("rows", "video")


class CorruptEntry(ValueError):
    """A stored value that does not parse, or does not match its header."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One image's embedding, held as the stored value itself (no second copy)."""

    blob: bytes | bytearray | memoryview
    rows: int
    hidden: int
    dtype: str
    grid_thw: tuple[int, int, int]
    fingerprint: str
    hash: str
    kind: str = "rows"

    @property
    def row_bytes(self) -> int:
        return self.hidden * NUMPY_DTYPES[self.dtype].itemsize

    @property
    def nbytes(self) -> int:
        return len(self.blob)

    def rows_view(self, start: int = 0, end: int | None = None) -> memoryview:
        end = self.rows if end is None else end
        rb = self.row_bytes
        return memoryview(self.blob)[DATA_OFFSET + start * rb : DATA_OFFSET + end * rb]

    def array(self) -> np.ndarray:
        """All rows as a read-only ``[rows, hidden]`` numpy view (raw uint16 for bfloat16)."""
        return np.frombuffer(self.rows_view(), dtype=NUMPY_DTYPES[self.dtype]).reshape(self.rows, self.hidden)


def pack_entry(
    rows: np.ndarray | Sequence[np.ndarray],
    *,
    dtype: str,
    grid_thw: tuple[int, int, int],
    fingerprint: str,
    hash: str,
    kind: str = "rows",
) -> Entry:
    """A stored value from ``[rows, hidden]`` arrays (raw values: bfloat16 as 16-bit words), copied once."""
    if kind not in KINDS:
        raise ValueError(f"unknown entry kind {kind!r}")
    if dtype not in NUMPY_DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}")
    parts = [rows] if isinstance(rows, np.ndarray) else list(rows)
    if not parts or any(p.ndim != 2 or p.shape[1] != parts[0].shape[1] for p in parts):
        raise ValueError(f"rows must be 2-D of one width, got shapes {[p.shape for p in parts]}")
    n, hidden = sum(int(p.shape[0]) for p in parts), int(parts[0].shape[1])
    fields = {
        "shape": [n, hidden],
        "dtype": dtype,
        "grid_thw": list(grid_thw),
        "fingerprint": fingerprint,
        "hash": hash,
    }
    header = msgpack.packb(fields if kind == "rows" else {**fields, "kind": kind})
    if _PREFIX.size + len(header) > DATA_OFFSET:
        raise ValueError("entry header does not fit before DATA_OFFSET")
    npdtype = NUMPY_DTYPES[dtype]
    # not zero-filled: a bytearray's fill holds the GIL for a page fault of every page (the rows' copy
    # below faults them in with the GIL released); the header's 256 bytes are zeroed: no stale byte is stored
    blob = np.empty(DATA_OFFSET + n * hidden * npdtype.itemsize, np.uint8).data
    blob[:DATA_OFFSET] = bytes(DATA_OFFSET)
    _PREFIX.pack_into(blob, 0, MAGIC, VERSION, len(header))
    blob[_PREFIX.size : _PREFIX.size + len(header)] = header
    out, at = np.frombuffer(blob, dtype=npdtype, offset=DATA_OFFSET).reshape(n, hidden), 0
    for part in parts:
        out[at : at + part.shape[0]] = part.view(npdtype)
        at += part.shape[0]
    return Entry(blob, n, hidden, dtype, tuple(grid_thw), fingerprint, hash, kind)  # type: ignore[arg-type]


def parse_header(prefix: bytes | bytearray | memoryview) -> dict:
    if len(prefix) < _PREFIX.size:
        raise CorruptEntry("value shorter than its prefix")
    magic, version, header_len = _PREFIX.unpack_from(prefix, 0)
    if magic != MAGIC:
        raise CorruptEntry("bad magic")
    if version != VERSION:
        raise CorruptEntry(f"unsupported entry version {version}")
    if _PREFIX.size + header_len > min(DATA_OFFSET, len(prefix)):
        raise CorruptEntry("header overruns the data offset")
    try:
        header = msgpack.unpackb(bytes(prefix[_PREFIX.size : _PREFIX.size + header_len]))
        rows, hidden = (int(x) for x in header["shape"])
        if header["dtype"] not in NUMPY_DTYPES or rows < 0 or hidden <= 0 or len(header["grid_thw"]) != 3:
            raise CorruptEntry("bad header fields")
        if header.get("kind", "rows") not in KINDS:
            raise CorruptEntry(f"unknown entry kind {header['kind']!r}")
        str(header["fingerprint"]), str(header["hash"])
    except CorruptEntry:
        raise
    except Exception as e:
        raise CorruptEntry(f"unreadable header: {e}") from e
    return header


def unpack_entry(
    blob: bytes | bytearray | memoryview, *, fingerprint: str | None = None, hash: str | None = None
) -> Entry:
    """Check a stored value against its header and the expected key; wrap it without copying."""
    header = parse_header(memoryview(blob)[:DATA_OFFSET])
    rows, hidden = header["shape"]
    dtype = header["dtype"]
    expected = DATA_OFFSET + rows * hidden * NUMPY_DTYPES[dtype].itemsize
    if len(blob) != expected:
        raise CorruptEntry(f"value is {len(blob)} bytes, header says {expected}")
    if fingerprint is not None and header["fingerprint"] != fingerprint:
        raise CorruptEntry("fingerprint does not match the key")
    if hash is not None and header["hash"] != hash:
        raise CorruptEntry("image hash does not match the key")
    grid = tuple(header["grid_thw"])
    return Entry(blob, rows, hidden, dtype, grid, header["fingerprint"], header["hash"], header.get("kind", "rows"))  # type: ignore[arg-type]
