"""What the client says and how it reads the answers, independent of I/O.

Each operation is a generator that yields steps and is sent back their
results; ``Client`` drives it with blocking calls, ``AsyncClient`` with awaits.
One implementation of the protocol, two drivers. Steps:

* an ``httpx.Request``: send it, read the whole body, send back the response;
* ``Stream(request)``: send it and send back the response *unread*; the flow
  then reads the body itself with
* ``READ``: send back the next chunk of the streamed body (``b""`` at the end),
  so a flow can copy rows from the network chunks straight into their
  destination (one copy, no body-sized intermediate).
"""

from __future__ import annotations

import json
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import httpx
import msgpack
import numpy as np

from visenc_client._exceptions import ProtocolError, error_for
from visenc_client._types import Handle, ImageInput, RowRange, Video, image_hash, video_hash
from visenc_client.format import MSGPACK, NUMPY_DTYPES, ROWS_MEDIA_TYPE, CorruptFrame, split_frame

__all__ = ["MSGPACK", "ROWS_MEDIA_TYPE"]

T = TypeVar("T")
Flow = Generator[httpx.Request, httpx.Response, T]


@dataclass(frozen=True, slots=True)
class Stream:
    """Step: send ``request``; the response comes back with its body unread (read it with ``READ``)."""

    request: httpx.Request


class Read:
    """Step: the next chunk of the streamed body, ``b""`` once it is exhausted."""


READ = Read()
#: a flow that may also stream: yields ``httpx.Request | Stream | Read``
AnyFlow = Generator[Any, Any, T]


def send_streamed(request: httpx.Request) -> Generator[Stream, Any, httpx.Response]:
    response = yield Stream(request)
    return cast(httpx.Response, response)


def read_chunk() -> Generator[Read, Any, bytes]:
    chunk = yield READ
    return cast(bytes, chunk)


def read_all() -> Generator[Read, Any, bytes]:
    """The rest of a streamed body (for small bodies: error answers)."""
    parts = []
    while chunk := (yield from read_chunk()):
        parts.append(chunk)
    return b"".join(parts)


def _item(image: ImageInput | Video) -> dict[str, Any]:
    """An encode item with its hash and what it uploads (``data``, or a video's ``frames``)."""
    if isinstance(image, Video):
        frames = [read_image(f) for f in image.frames]
        return {"hash": video_hash([image_hash(f) for f in frames]), "frames": frames}
    data = read_image(image)
    return {"hash": image_hash(data), "data": data}


def read_image(image: ImageInput) -> bytes:
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    with open(image, "rb") as f:
        return f.read()


def raise_for_status(resp: httpx.Response, content: bytes | None = None) -> None:
    """Raise the client exception of an error answer (``content``: its body, if it was streamed)."""
    if resp.status_code < 400:
        return
    kind, message = "http_error", resp.reason_phrase
    try:
        err = json.loads(resp.content if content is None else content)["error"]
        kind, message = err["kind"], err["message"]
    except Exception:
        pass
    raise error_for(resp.status_code, kind, message, resp.headers.get("retry-after"))


def msgpack_request(
    client: httpx.Client | httpx.AsyncClient, path: str, payload: dict[str, Any], headers: dict[str, str] | None = None
) -> httpx.Request:
    return client.build_request(
        "POST",
        path,
        content=msgpack.packb(payload),
        headers={"content-type": MSGPACK, "accept": MSGPACK, **(headers or {})},
    )


def _handles(resp: httpx.Response) -> list[Handle]:
    raise_for_status(resp)
    try:
        body = msgpack.unpackb(resp.content)
        return [
            Handle.from_wire(
                d, None if d.get("rows") is None else as_array(d["rows"], d["dtype"], d["num_tokens"], d["hidden_size"])
            )
            for d in body["items"]
        ]
    except Exception as e:
        raise ProtocolError(f"unreadable encode response: {e}") from e


def encode_flow(
    client: httpx.Client | httpx.AsyncClient,
    images: Sequence[ImageInput | Video],
    *,
    wait: bool,
    hash_first: bool,
    headers: dict[str, str] | None,
    include_rows: bool = False,
) -> Flow[list[Handle]]:
    """Hash-first: send hashes; upload bytes (a video's frames) only for items the index answers
    ``missing``. A video uploaded again sends every frame, but only its missing tubes are encoded.

    ``include_rows``: ready handles carry their rows (one round trip less than a fetch)."""
    uploads = [_item(im) for im in images]
    options = {"wait": wait, **({"include_rows": True} if include_rows else {})}
    if not hash_first:
        return _handles((yield msgpack_request(client, "/v1/encode", {"items": uploads, **options}, headers)))
    payload = {"items": [{"hash": u["hash"]} for u in uploads], **options}
    handles = _handles((yield msgpack_request(client, "/v1/encode", payload, headers)))
    missing = [i for i, h in enumerate(handles) if h.status == "missing"]
    if missing:
        items = [uploads[i] for i in missing]
        uploaded = _handles((yield msgpack_request(client, "/v1/encode", {"items": items, **options}, headers)))
        for i, h in zip(missing, uploaded):
            handles[i] = h
    return handles


def lookup_flow(
    client: httpx.Client | httpx.AsyncClient,
    hashes: Sequence[str],
    headers: dict[str, str] | None,
    *,
    wait: bool = False,
    include_rows: bool = False,
) -> Flow[list[Handle]]:
    """Hash-only, never uploading: ``ready``, ``pending`` (being encoded, here or on another replica;
    a fetch waits for it) or ``missing`` per hash, in one round trip. ``wait``: a pending image is
    waited for (a missing one still answers at once); ``include_rows`` (needs ``wait``): ready
    handles carry their rows, so look-up and fetch are one round trip."""
    payload = {
        "items": [{"hash": h} for h in hashes],
        "wait": wait,
        **({"include_rows": True} if include_rows else {}),
    }
    return _handles((yield msgpack_request(client, "/v1/encode", payload, headers)))


def as_array(buf: bytes | memoryview, dtype: str, rows: int, hidden: int) -> np.ndarray:
    if dtype not in NUMPY_DTYPES:
        raise ProtocolError(f"unknown dtype {dtype!r}")
    array: np.ndarray = np.frombuffer(buf, dtype=NUMPY_DTYPES[dtype])
    return array.reshape(rows, hidden)


def fetch_flow(
    client: httpx.Client | httpx.AsyncClient,
    image: str | Handle,
    start: int | None,
    end: int | None,
    headers: dict[str, str] | None,
) -> Flow[np.ndarray]:
    """Rows ``[start, end)`` of one image: a read-only view of the response body (no copy)."""
    h = image.hash if isinstance(image, Handle) else image
    params = {k: v for k, v in (("start", start), ("end", end)) if v is not None}
    resp = yield client.build_request("GET", f"/v1/embeddings/{h}", params=params, headers=headers)
    raise_for_status(resp)
    try:
        rows, hidden = (int(x) for x in resp.headers["x-visenc-shape"].split(","))
        return as_array(resp.content, resp.headers["x-visenc-dtype"], rows, hidden)
    except (KeyError, ValueError) as e:
        raise ProtocolError(f"unreadable embedding response: {e}") from e


def parse_rows(body: bytes) -> list[tuple[dict[str, Any], memoryview | None]]:
    """Split an ``application/x-visenc-rows`` body into (item header, rows view) pairs
    (``ProtocolError`` for anything malformed: a short body, a bad header, rows out of range)."""
    try:
        return split_frame(body)
    except CorruptFrame as e:
        raise ProtocolError(f"unreadable rows response: {e}") from e


def fetch_many_flow(
    client: httpx.Client | httpx.AsyncClient, ranges: Sequence[RowRange], *, wait: bool, headers: dict[str, str] | None
) -> Flow[list[np.ndarray]]:
    """Several ranges in one round trip; each result is a read-only view of the one response body."""
    payload = {"ranges": [{"hash": r.hash, "start": r.start, "end": r.end} for r in ranges], "wait": wait}
    resp = yield msgpack_request(client, "/v1/embeddings/fetch", payload, headers)
    raise_for_status(resp)
    arrays = []
    for item, rows in parse_rows(resp.content):
        if rows is None:
            raise error_for(int(item.get("status", 500)), "fetch_failed", f"{item.get('hash')}: {item.get('error')}")
        n, hidden = item["shape"]
        arrays.append(as_array(rows, item["dtype"], n, hidden))
    return arrays


def simple_flow(
    client: httpx.Client | httpx.AsyncClient, method: str, path: str, headers: dict[str, str] | None
) -> Flow[Any]:
    resp = yield client.build_request(method, path, headers=headers)
    raise_for_status(resp)
    return resp.json()
