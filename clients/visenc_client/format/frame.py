"""Media types, and the rows frame (``application/x-visenc-rows``): the answer that carries rows of
several items, a small header then raw rows, never msgpack in full (``unpackb`` would copy every ``bin``)::

    u32 LE  header_len
    bytes   msgpack {"items": [{"hash", "start", "end", "shape", "dtype", "offset", "nbytes"}
                                | {"hash", "status", "error"}]}
    bytes   the rows of every item, back to back; item k is body[4 + header_len + offset_k : ... + nbytes_k]
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

JSON = "application/json"
MSGPACK = "application/msgpack"
#: every name msgpack goes by that the service accepts (``MSGPACK`` is the one it answers with)
MSGPACK_TYPES = (MSGPACK, "application/x-msgpack", "application/vnd.msgpack")
ROWS_MEDIA_TYPE = "application/x-visenc-rows"

_FRAME_PREFIX = struct.Struct("<I")
FRAME_PREFIX_BYTES = _FRAME_PREFIX.size


class CorruptFrame(ValueError):
    """A rows frame that does not parse: a short body, a bad header, rows out of range."""


def frame_head(items: list[dict[str, Any]]) -> bytes:
    header = msgpack.packb({"items": items})
    return _FRAME_PREFIX.pack(len(header)) + header


def frame_header_length(prefix: bytes | memoryview) -> int:
    if len(prefix) < FRAME_PREFIX_BYTES:
        raise CorruptFrame("body shorter than the frame's length prefix")
    return int(_FRAME_PREFIX.unpack_from(prefix, 0)[0])


def frame_items(header: bytes | memoryview) -> list[dict[str, Any]]:
    try:
        items = msgpack.unpackb(header)["items"]
    except Exception as e:
        raise CorruptFrame(f"unreadable frame header: {type(e).__name__}: {e}") from e
    if not isinstance(items, list) or not all(isinstance(it, dict) for it in items):
        raise CorruptFrame("the frame header's items are not a list of maps")
    return items


def split_frame(body: bytes | memoryview) -> list[tuple[dict[str, Any], memoryview | None]]:
    """A rows frame as (item header, view of its rows or ``None``) pairs, in order."""
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
