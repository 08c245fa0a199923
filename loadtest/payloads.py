"""What the load test sends and how it checks the answers; no Locust, no I/O."""

from __future__ import annotations

import hashlib
import io
import itertools
import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
from PIL import Image

from visenc_client.format import (
    FRAME_PREFIX_BYTES,
    MSGPACK,
    NUMPY_DTYPES,
    ROWS_MEDIA_TYPE,
    CorruptFrame,
    frame_header_length,
    split_frame,
)

__all__ = ["MSGPACK", "ROWS_MEDIA_TYPE"]
#: the wire dtypes whose raw values numpy reads as floats, for the finiteness check (bfloat16 has none: skipped)
FLOAT_DTYPES = {name: raw for name, raw in NUMPY_DTYPES.items() if raw.kind == "f"}


class PayloadError(Exception):
    """A 200 response whose body does not answer the request that was sent."""


# --- images -------------------------------------------------------------------


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from any printable parts (run id, user, turn, ...), stable across processes."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def screenshot_array(seed: int, width: int, height: int) -> np.ndarray:
    """A ``[height, width, 3]`` uint8 screenshot-like picture (flat colours, thin strokes: a 1280x720 PNG
    is tens of KB and cheap to draw), a pure function of its arguments."""
    rng = np.random.default_rng(seed)
    img = np.empty((height, width, 3), np.uint8)
    img[:] = rng.integers(200, 256, 3, dtype=np.uint8)  # desktop background
    title = max(4, height // 30)
    for _ in range(int(rng.integers(2, 5))):  # windows: frame, title bar, lines of "text"
        x0, y0 = int(rng.integers(0, max(1, width * 3 // 4))), int(rng.integers(0, max(1, height * 3 // 4)))
        x1 = min(width, x0 + int(rng.integers(max(2, width // 4), max(3, width // 2 + 1))))
        y1 = min(height, y0 + int(rng.integers(max(2, height // 4), max(3, height // 2 + 1))))
        img[y0:y1, x0:x1] = rng.integers(225, 256, 3, dtype=np.uint8)
        img[y0 : min(y1, y0 + title), x0:x1] = rng.integers(30, 160, 3, dtype=np.uint8)
        line = max(3, height // 60)
        for y in range(y0 + title + line, y1 - line, 2 * line):
            end = x0 + int(rng.integers(0, max(1, x1 - x0)))
            stroke = img[y : y + max(1, line // 2), x0 + line : end]
            stroke[:, (np.arange(stroke.shape[1]) // max(2, line)) % 4 != 3] = 40  # words and gaps
    stamp = np.unpackbits(np.frombuffer(seed.to_bytes(8, "little"), np.uint8))  # 64 bits, one per pixel
    n = min(width, stamp.size)
    img[0, :n] = (stamp[:n, None] * 255).astype(np.uint8)
    return img


def screenshot_png(seed: int, width: int, height: int) -> bytes:
    """:func:`screenshot_array` as PNG bytes (fast compression: the client's CPU is the server's too)."""
    buf = io.BytesIO()
    Image.fromarray(screenshot_array(seed, width, height), "RGB").save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def image_hash(data: bytes) -> str:
    """The service's image key: SHA-256 of the raw bytes, 64 lowercase hex digits."""
    return hashlib.sha256(data).hexdigest()


#: ramp stages of loadtest/shapes.py: until END_S hold USERS users, spawning SPAWN_RATE a second
DEFAULT_STAGES = "30:1:1,60:2:1,90:4:2,120:8:4"


def parse_stages(text: str) -> list[tuple[float, int, float]]:
    """``"30:1:1,60:4:2"`` -> ``[(30.0, 1, 1.0), (60.0, 4, 2.0)]``; end times must increase."""
    try:
        stages = [(float(e), int(u), float(r)) for e, u, r in (part.strip().split(":") for part in text.split(","))]
    except ValueError as e:
        raise ValueError(f"--stages must be END_S:USERS:SPAWN_RATE,..., got {text!r}") from e
    ends = [s[0] for s in stages]
    if ends[0] <= 0 or any(b <= a for a, b in itertools.pairwise(ends)):
        raise ValueError(f"--stages needs increasing positive end times, got {text!r}")
    return stages


def parse_timespan(text: str) -> float:
    """Locust's time spans (``90``, ``30s``, ``2m``, ``1h20m``) in seconds."""
    if text.strip().isdigit():
        return float(text)
    parts = re.fullmatch(r"\s*(?:(\d+)h)?\s*(?:(\d+)m)?\s*(?:(\d+)s)?\s*", text)
    if not parts or not any(parts.groups()):
        raise ValueError(f"not a time span: {text!r}")
    h, m, s = (int(g or 0) for g in parts.groups())
    return float(h * 3600 + m * 60 + s)


def parse_size(text: str) -> tuple[int, int]:
    """``"1280x720"`` -> ``(1280, 720)``."""
    try:
        w, h = (int(x) for x in text.lower().split("x"))
    except ValueError as e:
        raise ValueError(f"size must look like WIDTHxHEIGHT, got {text!r}") from e
    if w < 1 or h < 1:
        raise ValueError(f"size must be positive, got {text!r}")
    return w, h


# --- chunk planning -------------------------------------------------------------


@dataclass(frozen=True)
class Range:
    """Token rows ``[start, end)`` of image ``index`` (position in the request)."""

    index: int
    start: int
    end: int


def plan_chunks(num_tokens: Sequence[int], chunk_tokens: int) -> list[list[Range]]:
    """Prefill chunks of ``chunk_tokens`` rows over the images' rows laid end to end: together they cover
    every row once, in prompt order; no range is empty."""
    if chunk_tokens < 1:
        raise ValueError("chunk_tokens must be >= 1")
    chunks: list[list[Range]] = []
    current: list[Range] = []
    room = chunk_tokens
    for index, n in enumerate(num_tokens):
        pos = 0
        while pos < n:
            take = min(room, n - pos)
            current.append(Range(index, pos, pos + take))
            pos += take
            room -= take
            if room == 0:
                chunks.append(current)
                current, room = [], chunk_tokens
    if current:
        chunks.append(current)
    return chunks


# --- request bodies -------------------------------------------------------------


def encode_body(items: Sequence[dict[str, Any]], wait: bool) -> bytes:
    return msgpack.packb({"items": list(items), "wait": wait})  # type: ignore[no-any-return]


def fetch_body(ranges: Sequence[tuple[str, int, int]], wait: bool = True) -> bytes:
    payload = {"ranges": [{"hash": h, "start": s, "end": e} for h, s, e in ranges], "wait": wait}
    return msgpack.packb(payload)  # type: ignore[no-any-return]


# --- checks ---------------------------------------------------------------------


def check_handles(body: bytes, hashes: Sequence[str], allowed: frozenset[str]) -> list[dict[str, Any]]:
    """The items of an encode answer (msgpack), checked against the hashes sent, in order, and their
    status against ``allowed``."""
    try:
        items = msgpack.unpackb(body)["items"]
    except Exception as e:
        raise PayloadError(f"unreadable encode answer: {type(e).__name__}: {e}") from e
    if len(items) != len(hashes):
        raise PayloadError(f"encode answered {len(items)} items for {len(hashes)} sent")
    for i, (item, h) in enumerate(zip(items, hashes)):
        if item.get("hash") != h:
            raise PayloadError(f"item {i}: hash {item.get('hash')!r} is not the one sent ({h})")
        status = item.get("status")
        if status not in allowed:
            raise PayloadError(f"item {i}: status {status!r} (expected one of {sorted(allowed)}): {item.get('error')}")
        if status in ("ready", "pending"):
            if not (isinstance(item.get("num_tokens"), int) and item["num_tokens"] > 0):
                raise PayloadError(f"item {i}: num_tokens {item.get('num_tokens')!r} is not a positive int")
            if not (isinstance(item.get("hidden_size"), int) and item["hidden_size"] > 0):
                raise PayloadError(f"item {i}: hidden_size {item.get('hidden_size')!r} is not a positive int")
            if item.get("dtype") not in NUMPY_DTYPES:
                raise PayloadError(f"item {i}: unknown dtype {item.get('dtype')!r}")
    return list(items)


def _check_rows(
    label: str, rows: int, hidden: int, dtype: str, data: bytes | memoryview, expect: dict[str, Any]
) -> None:
    if (hidden, dtype) != (expect["hidden_size"], expect["dtype"]):
        raise PayloadError(
            f"{label}: hidden/dtype {hidden}/{dtype} differ from the handle's {expect['hidden_size']}/{expect['dtype']}"
        )
    want = rows * hidden * NUMPY_DTYPES[dtype].itemsize
    if len(data) != want:
        raise PayloadError(f"{label}: {len(data)} bytes for {rows} rows x {hidden} x {dtype} (want {want})")
    np_dtype = FLOAT_DTYPES.get(dtype)
    if np_dtype is not None and not np.isfinite(np.frombuffer(data, np_dtype)).all():
        raise PayloadError(f"{label}: rows hold NaN or inf")


class RowLedger:
    """A CRC of every row of every image as first read: a later read that differs
    is a wrong answer (a partial, corrupt or another image's entry served), even
    across index restarts and replicas. One per load-generator process."""

    def __init__(self) -> None:
        self._rows: dict[str, dict[int, int]] = {}

    def check(self, image_hash: str, start: int, data: memoryview | bytes, rows: int) -> None:
        if rows <= 0:
            return
        known = self._rows.setdefault(image_hash, {})
        width = len(data) // rows
        view = memoryview(data)
        for i in range(rows):
            crc = zlib.crc32(view[i * width : (i + 1) * width])
            if known.setdefault(start + i, crc) != crc:
                raise PayloadError(f"{image_hash[:12]} row {start + i} differs from an earlier read")


def check_rows_body(
    body: bytes,
    ranges: Sequence[tuple[str, int, int]],
    handles: Sequence[dict[str, Any]],
    ledger: RowLedger | None = None,
) -> int:
    """Check a ``POST /v1/embeddings/fetch`` answer against ``ranges`` (``handles[k]``: ``ranges[k]``'s
    image); returns the row bytes."""
    try:
        pieces = split_frame(body)
        head = FRAME_PREFIX_BYTES + frame_header_length(body)
    except CorruptFrame as e:
        raise PayloadError(f"unreadable rows answer: {e}") from e
    if len(pieces) != len(ranges):
        raise PayloadError(f"fetch answered {len(pieces)} ranges for {len(ranges)} asked")
    total = 0
    for k, ((item, data), (h, s, e), handle) in enumerate(zip(pieces, ranges, handles)):
        label = f"range {k} ({h[:12]} [{s},{e}))"
        if data is None:
            raise PayloadError(f"{label}: status {item.get('status')}: {item.get('error')}")
        if (item.get("hash"), item.get("start"), item.get("end")) != (h, s, e):
            raise PayloadError(f"{label}: answered {item.get('hash')} [{item.get('start')},{item.get('end')})")
        rows, hidden = item["shape"]
        if rows != e - s:
            raise PayloadError(f"{label}: shape {item['shape']} for {e - s} rows")
        _check_rows(label, rows, hidden, item["dtype"], data, handle)
        if ledger is not None:
            ledger.check(h, s, data, rows)
        total += len(data)
    if head + total != len(body):
        raise PayloadError(f"body is {len(body)} bytes; header + rows account for {head + total}")
    return total


def check_rows_get(
    headers: Any, content: bytes, start: int, end: int, handle: dict[str, Any], ledger: RowLedger | None = None
) -> None:
    """Check a ``GET /v1/embeddings/{hash}`` answer: shape header, dtype header, byte count."""
    shape = headers.get("X-Visenc-Shape") or headers.get("x-visenc-shape")
    dtype = headers.get("X-Visenc-Dtype") or headers.get("x-visenc-dtype")
    try:
        rows, hidden = (int(x) for x in str(shape).split(","))
    except ValueError as e:
        raise PayloadError(f"bad X-Visenc-Shape header {shape!r}") from e
    if rows != end - start:
        raise PayloadError(f"X-Visenc-Shape {shape} for {end - start} rows asked")
    _check_rows(f"rows [{start},{end})", rows, hidden, str(dtype), content, handle)
    if ledger is not None:
        ledger.check(handle["hash"], start, content, rows)


def timing_headers(headers: Any) -> dict[str, float]:
    """Server timing headers present on an answer, in milliseconds (absent ones are left out)."""
    out: dict[str, float] = {}
    for name, label in (("X-Visenc-Queue-Time", "queue"), ("X-Visenc-Encode-Time", "encode")):
        value = headers.get(name) or headers.get(name.lower())
        if value is not None:
            try:
                out[label] = float(value) * 1000.0  # the service sends seconds
            except ValueError:
                continue
    return out
