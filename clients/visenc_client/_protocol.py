"""What the client says, one flow per operation, independent of I/O (``_steps``); rows answers are streamed."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import quote, urlencode

import httpx
import msgpack
import numpy as np

from visenc_client._exceptions import ProtocolError, VisencClientError
from visenc_client._steps import (
    AnyFlow,
    Ask,
    Flow,
    ReadInto,
    as_array,
    byte_view,
    expect_end,
    failed_range,
    owned_array,
    raise_for_status,
    read_all,
    read_frame,
    send_streamed,
)
from visenc_client._types import Handle, ImageInput, RowRange, Video, image_hash, video_hash
from visenc_client.format import LEASE_HEADER, MSGPACK, ROWS_MEDIA_TYPE, is_valid_hash


def _item(image: ImageInput | Video) -> dict[str, Any]:
    if isinstance(image, Video):
        frames = [read_image(f) for f in image.frames]
        return {"hash": video_hash([image_hash(f) for f in frames]), "frames": frames}
    data = read_image(image)
    return {"hash": image_hash(data), "data": data}


def read_image(image: ImageInput) -> bytes:
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    if isinstance(image, str) and is_valid_hash(image) and not os.path.exists(image):
        raise ValueError(
            f"{image} is an image hash, not a file: encode takes bytes or paths; lookup([hash]) asks by hash"
        )
    with open(image, "rb") as f:
        return f.read()


def msgpack_request(
    path: str, payload: dict[str, Any], headers: dict[str, str] | None = None, *, accept: str = MSGPACK
) -> Ask:
    return Ask("POST", path, {"content-type": MSGPACK, "accept": accept, **(headers or {})}, msgpack.packb(payload))


def _handles(resp: httpx.Response) -> list[Handle]:
    raise_for_status(resp)
    return _parse_handles(resp.content)


def _parse_handles(content: bytes) -> list[Handle]:
    try:
        body = msgpack.unpackb(content)
        return [
            Handle.from_wire(
                d, None if d.get("rows") is None else as_array(d["rows"], d["dtype"], d["num_tokens"], d["hidden_size"])
            )
            for d in body["items"]
        ]
    except Exception as e:
        raise ProtocolError(f"unreadable encode response: {e}") from e


def _ask(payload: dict[str, Any], headers: dict[str, str] | None) -> AnyFlow[list[Handle]]:
    """One ``/v1/encode``; with ``include_rows``, a rows frame whose items are the handles."""
    if not payload.get("include_rows"):
        return _handles((yield msgpack_request("/v1/encode", payload, headers)))
    request = msgpack_request("/v1/encode", payload, headers, accept=f"{ROWS_MEDIA_TYPE}, {MSGPACK}")
    head = yield from send_streamed(request)
    if head.status_code < 400 and not head.headers.get("content-type", "").startswith(ROWS_MEDIA_TYPE):
        return _parse_handles((yield from read_all()))  # a service that answers rows inline in msgpack
    rows: list[np.ndarray] = []

    def place(item: dict[str, Any]) -> memoryview:
        rows.append(owned_array(item))
        return byte_view(rows[-1])

    items = yield from read_frame(head, place)
    filled = iter(rows)
    try:
        return [Handle.from_wire(d, next(filled) if "offset" in d else None) for d in items]
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(f"unreadable encode response: {e}") from e


def encode_flow(
    images: Sequence[ImageInput | Video],
    *,
    wait: bool,
    hash_first: bool,
    headers: dict[str, str] | None,
    include_rows: bool = False,
) -> AnyFlow[list[Handle]]:
    """Hash-first: send hashes; upload bytes only for items the index answers ``missing``."""
    uploads = [_item(im) for im in images]
    options = {"wait": wait, **({"include_rows": True} if include_rows else {})}
    if not hash_first:
        return (yield from _ask({"items": uploads, **options}, headers))
    payload = {"items": [{"hash": u["hash"]} for u in uploads], **options}
    handles = yield from _ask(payload, headers)
    missing = [i for i, h in enumerate(handles) if h.status == "missing"]
    if missing:
        items = [uploads[i] for i in missing]
        try:
            uploaded = yield from _ask({"items": items, **options}, headers)
        except VisencClientError:  # the caller reads none of the look-up's answers
            yield from unpin_flow(handles, headers)
            raise
        for i, h in zip(missing, uploaded):
            handles[i] = h
    return handles


def unpin_flow(handles: Sequence[Handle], headers: dict[str, str] | None) -> AnyFlow[None]:
    """Unpin ready ``handles`` whose rows will not be read: one read of no rows at the end of each image."""
    ranges: list[RowRange] = []
    for h in handles:
        if h.lease is None or h.status != "ready" or h.rows is not None or not h.num_tokens:
            continue
        per = h.num_tokens // len(h.tubes) if h.tubes else h.num_tokens
        ranges += [RowRange(t, per, per, h.lease) for t in h.tubes or (h.hash,)]
    if ranges:
        yield ranges_request("/v1/embeddings/fetch", ranges, wait=False, headers=headers)


def lookup_hashes_flow(
    hashes: Sequence[str],
    headers: dict[str, str] | None,
    *,
    wait: bool = False,
    include_rows: bool = False,
) -> AnyFlow[list[Handle]]:
    """One hash-only request, never uploading: ``ready``, ``pending`` or ``missing`` per hash."""
    payload = {
        "items": [{"hash": h} for h in hashes],
        "wait": wait,
        **({"include_rows": True} if include_rows else {}),
    }
    return (yield from _ask(payload, headers))


def lookup_split_by_pin_flow(
    hashes: Sequence[str],
    headers: dict[str, str],
    reads_unpinned: Callable[[str], bool],
    wait: bool,
    include_rows: bool,
    pin: bool,
) -> AnyFlow[list[Handle]]:
    """Look up ``hashes``; with ``pin``, images this client reads with no request (``reads_unpinned``: no
    read would unpin them) go in a request of their own that pins nothing."""
    free = {i for i, h in enumerate(hashes) if reads_unpinned(h)} if pin and not include_rows else set()
    owed = [i for i in range(len(hashes)) if i not in free]
    parts = [(part, pinned) for part, pinned in ((sorted(free), False), (owed, pin)) if part] or [(owed, pin)]
    handles: dict[int, Handle] = {}
    for part, pinned in parts:
        asked = [hashes[i] for i in part]
        got = yield from lookup_hashes_flow(asked, pinning(headers, pinned), wait=wait, include_rows=include_rows)
        handles.update(zip(part, got))
    return [handles[i] for i in range(len(hashes))]


def fetch_flow(
    image: str | Handle,
    start: int | None,
    end: int | None,
    headers: dict[str, str] | None,
) -> AnyFlow[np.ndarray]:
    h = image.hash if isinstance(image, Handle) else image
    lease = image.lease if isinstance(image, Handle) else None
    params = {k: v for k, v in (("start", start), ("end", end), ("lease", lease)) if v is not None}
    query = f"?{urlencode(params)}" if params else ""
    head = yield from send_streamed(Ask("GET", f"/v1/embeddings/{quote(h)}{query}", dict(headers or {})))
    if head.status_code >= 400:
        raise_for_status(head, (yield from read_all()))
    try:
        rows, hidden = (int(x) for x in head.headers["x-visenc-shape"].split(","))
        array = owned_array({"shape": (rows, hidden), "dtype": head.headers["x-visenc-dtype"]})
    except (KeyError, ValueError) as e:
        raise ProtocolError(f"unreadable embedding response: {e}") from e
    if int(head.headers.get("content-length", array.nbytes)) != array.nbytes:
        raise ProtocolError(f"a body of {head.headers['content-length']} bytes does not hold {array.shape} rows")
    yield ReadInto(byte_view(array))
    yield from expect_end()
    return array


def ranges_request(
    path: str,
    ranges: Sequence[RowRange],
    *,
    wait: bool,
    headers: dict[str, str] | None,
) -> Ask:
    payload = {"ranges": [_range(r) for r in ranges], "wait": wait}
    return msgpack_request(path, payload, headers)


def _range(r: RowRange) -> dict[str, Any]:
    out: dict[str, Any] = {"hash": r.hash, "start": r.start, "end": r.end}
    if r.lease is not None:
        out["lease"] = r.lease
    return out


def pinning(headers: dict[str, str] | None, pin: bool) -> dict[str, str]:
    """``headers`` asking for a lease id on each handle (``pin``), or for no pin at all."""
    return {**(headers or {}), LEASE_HEADER: "id" if pin else "none"}


def fetch_many_flow(
    ranges: Sequence[RowRange], *, wait: bool, headers: dict[str, str] | None
) -> AnyFlow[list[np.ndarray]]:
    head = yield from send_streamed(ranges_request("/v1/embeddings/fetch", ranges, wait=wait, headers=headers))
    arrays: list[np.ndarray] = []

    def place(item: dict[str, Any]) -> memoryview:
        arrays.append(owned_array(item))
        return byte_view(arrays[-1])

    items = yield from read_frame(head, place)
    for item in items:
        if "offset" not in item:
            raise failed_range(item)
    if len(items) != len(ranges):
        raise ProtocolError(f"asked for {len(ranges)} ranges, got {len(items)}")
    return arrays


def simple_flow(method: str, path: str, headers: dict[str, str] | None) -> Flow[dict[str, Any]]:
    """One request whose answer is a JSON object (``ProtocolError`` if it is anything else)."""
    resp = yield Ask(method, path, dict(headers or {}))
    raise_for_status(resp)
    try:
        body = resp.json()
    except ValueError as e:  # not JSON (nor UTF-8)
        raise ProtocolError(f"{method} {path}: unreadable answer ({resp.headers.get('content-type')}): {e}") from e
    if not isinstance(body, dict):
        raise ProtocolError(f"{method} {path}: the answer is not a JSON object but {type(body).__name__}")
    return body
