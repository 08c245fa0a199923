"""What the service and its clients agree on, defined once: the stored value of
an embedding, the wire's dtypes and media types, the rows frame, index keys,
image hashes, namespaces, the handle (its fields and statuses) and the per-item
error reasons. Pure Python + numpy + msgpack (no torch, no I/O), so the
service, every client, the engine connectors and the load tests import the
same definitions.

Stored value, version 1 (all integers little-endian)::

    offset  size  field
    0       4     magic  b"VENC"
    4       1     version (1)
    5       3     reserved, zero
    8       4     header_len: length of the msgpack header that follows
    12      n     msgpack map {"shape": [rows, hidden], "dtype": str,
                               "grid_thw": [t, h, w], "fingerprint": str, "hash": str}
    12+n    ...   zero padding up to DATA_OFFSET
    256     rows * hidden * itemsize   the rows, C-contiguous, little-endian

Rows always start at byte ``DATA_OFFSET`` (256), so token rows ``[start, end)``
are the byte range ``256 + start*row_bytes .. 256 + end*row_bytes``: one Redis
``GETRANGE``, or one ``memoryview`` slice in memory. A value whose length,
magic, version or header does not match is corrupt and must be treated as a
miss (never served). No pickle: the header is msgpack of plain types.

The rows frame (``application/x-visenc-rows``, the answer of a multi-range
fetch) is a small header followed by raw rows, never msgpack in full
(``unpackb`` would copy every ``bin`` value)::

    u32 LE  header_len
    bytes   msgpack {"items": [{"hash", "start", "end", "shape", "dtype",
                                "offset", "nbytes"} | {"hash", "status", "error"}]}
    bytes   the rows of every item, back to back; item k is
            body[4 + header_len + offset_k : ... + nbytes_k]

Index keys are ``visenc:{namespace}:{fingerprint}:{image_hash}``. The
fingerprint covers the model, its weights, dtype and preprocessing, so two
models or two resolutions never share an entry; the namespace isolates tenants.
None of the three parts contains ``:``, so a key splits back unambiguously.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import msgpack
import numpy as np

# --- media types ----------------------------------------------------------------------------
JSON = "application/json"
MSGPACK = "application/msgpack"
#: every name msgpack goes by that the service accepts (``MSGPACK`` is the one it answers with)
MSGPACK_TYPES = (MSGPACK, "application/x-msgpack", "application/vnd.msgpack")
#: the rows frame (module docstring)
ROWS_MEDIA_TYPE = "application/x-visenc-rows"

MAGIC = b"VENC"
VERSION = 1
DATA_OFFSET = 256
_PREFIX = struct.Struct("<4sB3xI")

#: dtype name -> (itemsize, numpy dtype used to move the raw bytes): the one table of the wire's dtypes
DTYPES: dict[str, tuple[int, np.dtype]] = {
    "float32": (4, np.dtype("<f4")),
    "float16": (2, np.dtype("<f2")),
    "bfloat16": (2, np.dtype("<u2")),  # numpy has no bfloat16: carried as raw 16-bit words
}
#: wire dtype -> the numpy dtype of its raw values (bfloat16: its 16-bit words)
NUMPY_DTYPES: dict[str, np.dtype] = {name: raw for name, (_, raw) in DTYPES.items()}
#: wire dtype -> the name torch gives it (``str(tensor.dtype)``)
TORCH_NAMES: dict[str, str] = {name: f"torch.{name}" for name in DTYPES}


def bfloat16_as_float32(words: np.ndarray) -> np.ndarray:
    """bfloat16 values carried as their 16-bit words, as float32 (exact: the words are the high halves)."""
    return (words.astype(np.uint32) << 16).view(np.float32)


def tensor_words(t: Any) -> np.ndarray:
    """A CPU torch tensor's values as numpy without a copy, as the wire carries them (bfloat16 as its
    16-bit words)."""
    import torch

    t = t.detach()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def words_tensor(rows: np.ndarray, dtype: str) -> Any:
    """Raw wire values (numpy, bfloat16 as 16-bit words) as a torch tensor of ``dtype``, sharing memory."""
    import torch

    if dtype == "bfloat16":
        return torch.from_numpy(rows.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(rows)


#: what a stored value holds: token rows, or a video's manifest
KINDS = ("rows", "video")


class CorruptEntry(ValueError):
    """A stored value that does not parse, or does not match its header."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One image's embedding, held as the stored value itself (no second copy)."""

    blob: bytes | bytearray
    rows: int
    hidden: int
    dtype: str
    grid_thw: tuple[int, int, int]
    fingerprint: str
    hash: str
    #: ``rows``: an image's (or a tube's) rows; ``video``: a video's manifest (``pack_manifest``)
    kind: str = "rows"

    @property
    def row_bytes(self) -> int:
        return self.hidden * DTYPES[self.dtype][0]

    @property
    def nbytes(self) -> int:
        """Bytes of the stored value (header + rows): what a cache budget counts."""
        return len(self.blob)

    def rows_view(self, start: int = 0, end: int | None = None) -> memoryview:
        """Token rows ``[start, end)`` as a view into the stored value (no copy)."""
        end = self.rows if end is None else end
        rb = self.row_bytes
        return memoryview(self.blob)[DATA_OFFSET + start * rb : DATA_OFFSET + end * rb]

    def array(self) -> np.ndarray:
        """All rows as a read-only ``[rows, hidden]`` numpy view (raw uint16 for bfloat16)."""
        return np.frombuffer(self.rows_view(), dtype=DTYPES[self.dtype][1]).reshape(self.rows, self.hidden)


def pack_entry(
    rows: np.ndarray | Sequence[np.ndarray],
    *,
    dtype: str,
    grid_thw: tuple[int, int, int],
    fingerprint: str,
    hash: str,
    kind: str = "rows",
) -> Entry:
    """Build a stored value from a ``[rows, hidden]`` array, or from such arrays one after another
    (a video's tubes), copying the rows once.

    ``rows`` holds the tensor's raw values (for bfloat16, its 16-bit words); ``kind`` is written
    into the header unless it is ``rows`` (so rows' values are as they always were)."""
    if kind not in KINDS:
        raise ValueError(f"unknown entry kind {kind!r}")
    if dtype not in DTYPES:
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
    npdtype = DTYPES[dtype][1]
    blob = bytearray(DATA_OFFSET + n * hidden * npdtype.itemsize)
    _PREFIX.pack_into(blob, 0, MAGIC, VERSION, len(header))
    blob[_PREFIX.size : _PREFIX.size + len(header)] = header
    out, at = np.frombuffer(blob, dtype=npdtype, offset=DATA_OFFSET).reshape(n, hidden), 0
    for part in parts:
        out[at : at + part.shape[0]] = part.view(npdtype)
        at += part.shape[0]
    return Entry(blob, n, hidden, dtype, tuple(grid_thw), fingerprint, hash, kind)  # type: ignore[arg-type]


def parse_header(prefix: bytes | bytearray | memoryview) -> dict:
    """Parse the header from the first ``DATA_OFFSET`` bytes of a stored value."""
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
        if header["dtype"] not in DTYPES or rows < 0 or hidden <= 0 or len(header["grid_thw"]) != 3:
            raise CorruptEntry("bad header fields")
        if header.get("kind", "rows") not in KINDS:
            raise CorruptEntry(f"unknown entry kind {header['kind']!r}")
        str(header["fingerprint"]), str(header["hash"])
    except CorruptEntry:
        raise
    except Exception as e:
        raise CorruptEntry(f"unreadable header: {e}") from e
    return header


def unpack_entry(blob: bytes | bytearray, *, fingerprint: str | None = None, hash: str | None = None) -> Entry:
    """Check a stored value against its header (and the expected key) and wrap it without copying."""
    header = parse_header(memoryview(blob)[:DATA_OFFSET])
    rows, hidden = header["shape"]
    dtype = header["dtype"]
    expected = DATA_OFFSET + rows * hidden * DTYPES[dtype][0]
    if len(blob) != expected:
        raise CorruptEntry(f"value is {len(blob)} bytes, header says {expected}")
    if fingerprint is not None and header["fingerprint"] != fingerprint:
        raise CorruptEntry("fingerprint does not match the key")
    if hash is not None and header["hash"] != hash:
        raise CorruptEntry("image hash does not match the key")
    grid = tuple(header["grid_thw"])
    return Entry(blob, rows, hidden, dtype, grid, header["fingerprint"], header["hash"], header.get("kind", "rows"))  # type: ignore[arg-type]


# --- keys, hashes, namespaces -------------------------------------------------------------
#: a tenant / key namespace: 1-64 characters of [A-Za-z0-9_.-]
NAMESPACE_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
NAMESPACE_RULE = "1-64 characters of [A-Za-z0-9_.-]"
_NAMESPACE_RE = re.compile(NAMESPACE_PATTERN)
#: the key of a vLLM request's ``ec_transfer_params`` that lists the images visenc lacks
#: (``visenc proxy`` writes it, ``VisencConnector`` reads it)
ABSENT_KEY = "visenc_absent"
#: an image hash: SHA-256 of the raw image bytes, 64 lowercase hex digits
HASH_PATTERN = r"^[0-9a-f]{64}$"
_HASH_RE = re.compile(HASH_PATTERN)


def image_hash(data: bytes | bytearray | memoryview) -> str:
    """The image key: SHA-256 of the raw image bytes, 64 lowercase hex digits."""
    return hashlib.sha256(data).hexdigest()


def video_hash(frame_hashes: Sequence[str]) -> str:
    """A video's key, from its frames' ``image_hash`` values in order (so a client computes it from
    the frames it sends): SHA-256 of a tag and the frames' raw digests."""
    h = hashlib.sha256(b"visenc-video\0")
    for frame in frame_hashes:
        h.update(bytes.fromhex(frame))
    return h.hexdigest()


_DIGEST_BYTES = 32


def pack_manifest(tubes: Sequence[str], *, grid_thw: tuple[int, int, int], fingerprint: str, video: str) -> Entry:
    """A video's manifest, stored under the video's hash like an image's rows: a value of kind
    ``video`` whose rows are its tubes' raw 32-byte digests, in order (``grid_thw``: the video's
    ``(tubes, grid_h, grid_w)``), checked like any value when read. One key answers a look-up by
    hash, image or video."""
    digests = np.frombuffer(b"".join(bytes.fromhex(t) for t in tubes), dtype="<f4").reshape(len(tubes), -1)
    return pack_entry(digests, dtype="float32", grid_thw=grid_thw, fingerprint=fingerprint, hash=video, kind="video")


def manifest_tubes(entry: Entry) -> list[str]:
    """The tube hashes of a manifest read from the index (``CorruptEntry`` if it is not one)."""
    if entry.kind != "video" or entry.dtype != "float32" or entry.hidden * 4 != _DIGEST_BYTES:
        raise CorruptEntry("not a video manifest")
    if entry.rows != entry.grid_thw[0]:
        raise CorruptEntry("a video manifest whose tube count is not its grid's")
    raw = bytes(entry.rows_view())
    return [raw[i : i + _DIGEST_BYTES].hex() for i in range(0, len(raw), _DIGEST_BYTES)]


def is_valid_hash(value: str) -> bool:
    return _HASH_RE.fullmatch(value) is not None


def is_valid_namespace(value: str) -> bool:
    return _NAMESPACE_RE.fullmatch(value) is not None


def entry_key(namespace: str, fingerprint: str, image_hash: str) -> str:
    """The index key of one image's embedding."""
    return f"visenc:{namespace}:{fingerprint}:{image_hash}"


def split_key(key: str) -> tuple[str, str, str]:
    """``(namespace, fingerprint, image_hash)`` of an entry key."""
    prefix, namespace, fingerprint, image_hash = key.split(":")
    if prefix != "visenc":
        raise ValueError(f"not an entry key: {key!r}")
    return namespace, fingerprint, image_hash


# --- handles ---------------------------------------------------------------------------------
#: ``ready``: fetch now; ``pending``: being encoded (a fetch waits); ``missing``: not in the
#: index and no bytes were sent; ``error``: this item failed (see ``reason``)
Status = Literal["ready", "pending", "missing", "error"]
STATUSES: tuple[str, ...] = get_args(Status)

#: the stable reason code of an item whose ``status`` is ``error`` (the table is in docs/api.md)
Reason = Literal[
    "invalid_hash",  # 'hash' is not 64 lowercase hex digits
    "hash_mismatch",  # the uploaded bytes hash to another value than the given 'hash'
    "invalid_image",  # the bytes are not a decodable image (empty, unknown format, corrupt, truncated)
    "invalid_video",  # a video the tower does not take (no video processor, frames of two sizes, no frames)
    "image_too_large",  # over max_image_bytes, or over max_image_pixels (decided from the header)
    "encode_failed",  # the image decoded but the model could not encode it
    "out_of_memory",  # the image alone does not fit in the device's memory (batches are split and retried first)
]
REASONS: tuple[str, ...] = get_args(Reason)


@dataclass(frozen=True, slots=True)
class Handle:
    """One image's embedding handle: what a caller learns about one image, enough to lay out its prompt.

    ``status`` is ``ready`` (fetch now), ``pending`` (being encoded; a fetch
    waits), ``missing`` (not in the index and no bytes were sent) or ``error``
    (``reason`` says why: ``Reason``). ``num_tokens`` / ``grid_thw`` are known
    even while pending, so a prompt can be laid out before the embeddings exist.
    ``rows`` (client side) holds the embedding itself (a read-only ``[num_tokens,
    hidden]`` array) when the encode asked for ``include_rows`` and the image was
    ready; it travels beside the wire fields, not among them."""

    hash: str
    status: Status
    num_tokens: int | None = None
    hidden_size: int | None = None
    dtype: str | None = None
    grid_thw: tuple[int, int, int] | None = None
    error: str | None = None
    reason: Reason | None = None
    rows: np.ndarray | None = field(default=None, compare=False, repr=False)
    #: a video's tubes' hashes, in order (``grid_thw[0]`` of them, ``num_tokens / grid_thw[0]`` rows
    #: each); ``None`` for an image
    tubes: tuple[str, ...] | None = None

    def to_wire(self) -> dict[str, Any]:
        """The handle's wire fields (``error`` and ``reason`` only on an error; ``tubes`` null for an image)."""
        out: dict[str, Any] = {
            "hash": self.hash,
            "status": self.status,
            "num_tokens": self.num_tokens,
            "hidden_size": self.hidden_size,
            "dtype": self.dtype,
            "grid_thw": list(self.grid_thw) if self.grid_thw else None,
        }
        if self.error is not None:
            out["error"] = self.error
            out["reason"] = self.reason
        out["tubes"] = list(self.tubes) if self.tubes is not None else None
        return out

    @classmethod
    def from_wire(cls, d: dict[str, Any], rows: np.ndarray | None = None) -> Handle:
        """A handle from its wire fields (``KeyError`` / ``ValueError`` / ``TypeError`` if malformed)."""
        if d["status"] not in STATUSES:
            raise ValueError(f"unknown handle status {d['status']!r}")
        grid = d.get("grid_thw")
        return cls(
            str(d["hash"]),
            d["status"],
            d.get("num_tokens"),
            d.get("hidden_size"),
            d.get("dtype"),
            (int(grid[0]), int(grid[1]), int(grid[2])) if grid else None,
            d.get("error"),
            d.get("reason"),
            rows,
            tuple(str(t) for t in d["tubes"]) if d.get("tubes") is not None else None,
        )


#: the wire fields of a handle (``Handle.to_wire``), in order; the rows travel beside them
HANDLE_FIELDS: tuple[str, ...] = (
    "hash",
    "status",
    "num_tokens",
    "hidden_size",
    "dtype",
    "grid_thw",
    "error",
    "reason",
    "tubes",
)


# --- the rows frame ---------------------------------------------------------------------------
_FRAME_PREFIX = struct.Struct("<I")
#: bytes of the frame's length prefix
FRAME_PREFIX_BYTES = _FRAME_PREFIX.size


class CorruptFrame(ValueError):
    """A rows frame that does not parse: a short body, a bad header, rows out of range."""


def frame_head(items: list[dict[str, Any]]) -> bytes:
    """The frame's length prefix and header; the items' rows follow, back to back."""
    header = msgpack.packb({"items": items})
    return _FRAME_PREFIX.pack(len(header)) + header


def frame_header_length(prefix: bytes | memoryview) -> int:
    """The header length a frame's first ``FRAME_PREFIX_BYTES`` announce."""
    if len(prefix) < FRAME_PREFIX_BYTES:
        raise CorruptFrame("body shorter than the frame's length prefix")
    return int(_FRAME_PREFIX.unpack_from(prefix, 0)[0])


def frame_items(header: bytes | memoryview) -> list[dict[str, Any]]:
    """The item list of a frame's header."""
    try:
        items = msgpack.unpackb(header)["items"]
    except Exception as e:
        raise CorruptFrame(f"unreadable frame header: {type(e).__name__}: {e}") from e
    if not isinstance(items, list) or not all(isinstance(it, dict) for it in items):
        raise CorruptFrame("the frame header's items are not a list of maps")
    return items


def split_frame(body: bytes | memoryview) -> list[tuple[dict[str, Any], memoryview | None]]:
    """A whole rows frame as (item header, view of its rows | ``None`` for a failed item) pairs, in order."""
    view = memoryview(body)
    hlen = frame_header_length(view)
    base = FRAME_PREFIX_BYTES + hlen
    if base > len(view):
        raise CorruptFrame(f"a {hlen}-byte header overruns the {len(view)}-byte body")
    out: list[tuple[dict[str, Any], memoryview | None]] = []
    for item in frame_items(view[FRAME_PREFIX_BYTES:base]):
        if "offset" not in item:
            out.append((item, None))
            continue
        try:
            start = base + int(item["offset"])
            end = start + int(item["nbytes"])
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptFrame(f"an item without a readable offset and size: {e}") from e
        if not base <= start <= end <= len(view):
            raise CorruptFrame(f"rows [{start}, {end}) are outside the {len(view)}-byte body")
        out.append((item, view[start:end]))
    return out
