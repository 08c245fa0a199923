"""What the client says and how it reads the answers, independent of I/O.

Each operation is a generator that yields steps and is sent back their
results; ``Client`` drives it with blocking calls, ``AsyncClient`` with awaits.
One implementation of the protocol, two drivers. Steps:

* an ``httpx.Request``: send it, read the whole body, send back the response;
* ``Stream(request)``: send it and send back its ``Head`` (status and headers), the
  body unread; the flow then reads the body itself with
* ``ReadInto(view)``: fill ``view`` with the body's next ``len(view)`` bytes, so rows
  go from the socket straight to their destination (``visenc_client._http``), and
* ``READ``: send back the next chunk of the body (``b""`` at the end).

Every answer that carries rows is streamed: a single range, a rows frame (several
ranges, or an encode's ``include_rows``), a prefill chunk.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import httpx
import msgpack
import numpy as np

from visenc_client._exceptions import ProtocolError, VisencClientError, error_for
from visenc_client._http import Head
from visenc_client._types import Handle, ImageInput, RowRange, Video, image_hash, video_hash
from visenc_client.format import (
    FRAME_PREFIX_BYTES,
    LEASE_HEADER,
    MSGPACK,
    NUMPY_DTYPES,
    ROWS_MEDIA_TYPE,
    CorruptFrame,
    frame_header_length,
    frame_items,
)

__all__ = ["MSGPACK", "ROWS_MEDIA_TYPE"]

T = TypeVar("T")
Flow = Generator[httpx.Request, httpx.Response, T]


@dataclass(frozen=True, slots=True)
class Stream:
    """Step: send ``request``; its ``Head`` comes back, the body unread (``ReadInto``, ``READ``)."""

    request: httpx.Request


@dataclass(frozen=True, slots=True)
class ReadInto:
    """Step: fill ``view`` with the streamed body's next ``len(view)`` bytes (``ProtocolError`` if it ends first)."""

    view: memoryview


class Read:
    """Step: the next chunk of the streamed body, ``b""`` once it is exhausted."""


READ = Read()
#: a flow that may also stream: yields ``httpx.Request | Stream | ReadInto | Read``
AnyFlow = Generator[Any, Any, T]


def send_streamed(request: httpx.Request) -> Generator[Stream, Any, Head]:
    head = yield Stream(request)
    return cast(Head, head)


def read_chunk() -> Generator[Read, Any, bytes]:
    chunk = yield READ
    return cast(bytes, chunk)


def read_exactly(n: int) -> Generator[ReadInto, Any, bytes]:
    """The body's next ``n`` bytes (small headers only)."""
    buf = bytearray(n)
    yield ReadInto(memoryview(buf))
    return bytes(buf)


def read_all() -> Generator[Read, Any, bytes]:
    """The rest of a streamed body (for small bodies: error answers)."""
    parts = []
    while chunk := (yield from read_chunk()):
        parts.append(chunk)
    return b"".join(parts)


def expect_end() -> Generator[Read, Any, None]:
    if (yield from read_chunk()):
        raise ProtocolError("the response body is longer than its header says")


def read_frame(head: Head, place: Callable[[dict[str, Any]], memoryview]) -> Generator[Any, Any, list[dict[str, Any]]]:
    """A streamed rows frame: its items; the rows of each item that has some are read straight into
    the buffer ``place(item)`` gives (called in order, after the item's size is checked)."""
    if head.status_code >= 400:
        raise_for_status(head, (yield from read_all()))
    try:
        hlen = frame_header_length((yield from read_exactly(FRAME_PREFIX_BYTES)))
        items = frame_items((yield from read_exactly(hlen)))
    except CorruptFrame as e:
        raise ProtocolError(f"unreadable rows response: {e}") from e
    at = 0
    for item in items:
        if "offset" not in item:
            continue
        try:
            offset, nbytes, dtype = int(item["offset"]), int(item["nbytes"]), str(item["dtype"])
            rows, hidden = (int(x) for x in item["shape"])
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"a rows item without a readable offset, size or shape: {e}") from e
        if dtype not in NUMPY_DTYPES or nbytes != rows * hidden * NUMPY_DTYPES[dtype].itemsize:
            raise ProtocolError(f"{item.get('hash')}: {nbytes} bytes are not [{rows}, {hidden}] {dtype}")
        if offset != at:
            raise ProtocolError(f"{item.get('hash')}: rows at offset {offset}, expected {at}")
        yield ReadInto(place(item))
        at += nbytes
    yield from expect_end()
    return items


def byte_view(array: np.ndarray) -> memoryview:
    """A C-contiguous array's bytes, writable through (empty arrays included)."""
    return array.reshape(-1).view(np.uint8).data


def owned_array(item: dict[str, Any]) -> np.ndarray:
    """A new ``[rows, hidden]`` array for a rows item (checked by ``read_frame``)."""
    rows, hidden = (int(x) for x in item["shape"])
    return np.empty((rows, hidden), NUMPY_DTYPES[str(item["dtype"])])


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


def raise_for_status(resp: httpx.Response | Head, content: bytes | None = None) -> None:
    """Raise the client exception of an error answer (``content``: its body, if it was streamed)."""
    if resp.status_code < 400:
        return
    kind, message = "http_error", resp.reason_phrase
    try:
        err = json.loads(resp.content if content is None else content)["error"]  # type: ignore[union-attr]
        kind, message = err["kind"], err["message"]
    except Exception:
        pass
    raise error_for(resp.status_code, kind, message, resp.headers.get("retry-after"))


def msgpack_request(
    client: httpx.Client | httpx.AsyncClient,
    path: str,
    payload: dict[str, Any],
    headers: dict[str, str] | None = None,
    *,
    accept: str = MSGPACK,
) -> httpx.Request:
    return client.build_request(
        "POST",
        path,
        content=msgpack.packb(payload),
        headers={"content-type": MSGPACK, "accept": accept, **(headers or {})},
    )


def _handles(resp: httpx.Response) -> list[Handle]:
    raise_for_status(resp)
    return _parse_handles(resp.content)


def _parse_handles(content: bytes) -> list[Handle]:
    """Handles of a msgpack encode answer (rows inline, from a service that answers no rows frames)."""
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


def _ask(
    client: httpx.Client | httpx.AsyncClient, payload: dict[str, Any], headers: dict[str, str] | None
) -> AnyFlow[list[Handle]]:
    """One ``/v1/encode``. With ``include_rows`` the answer is a rows frame whose items are the handles,
    each ready one's rows read into an array of its own."""
    if not payload.get("include_rows"):
        return _handles((yield msgpack_request(client, "/v1/encode", payload, headers)))
    request = msgpack_request(client, "/v1/encode", payload, headers, accept=f"{ROWS_MEDIA_TYPE}, {MSGPACK}")
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
    client: httpx.Client | httpx.AsyncClient,
    images: Sequence[ImageInput | Video],
    *,
    wait: bool,
    hash_first: bool,
    headers: dict[str, str] | None,
    include_rows: bool = False,
) -> AnyFlow[list[Handle]]:
    """Hash-first: send hashes; upload bytes (a video's frames) only for items the index answers
    ``missing``. A video uploaded again sends every frame, but only its missing tubes are encoded.

    ``include_rows``: ready handles carry their rows (one round trip less than a fetch)."""
    uploads = [_item(im) for im in images]
    options = {"wait": wait, **({"include_rows": True} if include_rows else {})}
    if not hash_first:
        return (yield from _ask(client, {"items": uploads, **options}, headers))
    payload = {"items": [{"hash": u["hash"]} for u in uploads], **options}
    handles = yield from _ask(client, payload, headers)
    missing = [i for i, h in enumerate(handles) if h.status == "missing"]
    if missing:
        items = [uploads[i] for i in missing]
        try:
            uploaded = yield from _ask(client, {"items": items, **options}, headers)
        except VisencClientError:  # answered with an error: the caller reads none of the look-up's answers
            yield from hand_back_flow(client, handles, headers)
            raise
        for i, h in zip(missing, uploaded):
            handles[i] = h
    return handles


def hand_back_flow(
    client: httpx.Client | httpx.AsyncClient, handles: Sequence[Handle], headers: dict[str, str] | None
) -> AnyFlow[None]:
    """Hand back the leases of ready ``handles`` whose rows will not be read: one request reading no
    rows at the end of each image (a video: of each tube), which releases its pin. Best effort: an
    error answer is ignored (the lease lapses)."""
    ranges: list[RowRange] = []
    for h in handles:
        if h.lease is None or h.status != "ready" or h.rows is not None or not h.num_tokens:
            continue
        per = h.num_tokens // len(h.tubes) if h.tubes else h.num_tokens
        ranges += [RowRange(t, per, per, h.lease) for t in h.tubes or (h.hash,)]
    if ranges:
        yield ranges_request(client, "/v1/embeddings/fetch", ranges, wait=False, headers=headers)


def lookup_flow(
    client: httpx.Client | httpx.AsyncClient,
    hashes: Sequence[str],
    headers: dict[str, str] | None,
    *,
    wait: bool = False,
    include_rows: bool = False,
) -> AnyFlow[list[Handle]]:
    """Hash-only, never uploading: ``ready``, ``pending`` (being encoded, here or on another replica;
    a fetch waits for it) or ``missing`` per hash, in one round trip. ``wait``: a pending image is
    waited for (a missing one still answers at once); ``include_rows`` (needs ``wait``): ready
    handles carry their rows, so look-up and fetch are one round trip."""
    payload = {
        "items": [{"hash": h} for h in hashes],
        "wait": wait,
        **({"include_rows": True} if include_rows else {}),
    }
    return (yield from _ask(client, payload, headers))


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
) -> AnyFlow[np.ndarray]:
    """Rows ``[start, end)`` of one image, read into a new array."""
    h = image.hash if isinstance(image, Handle) else image
    lease = image.lease if isinstance(image, Handle) else None
    params = {k: v for k, v in (("start", start), ("end", end), ("lease", lease)) if v is not None}
    head = yield from send_streamed(client.build_request("GET", f"/v1/embeddings/{h}", params=params, headers=headers))
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
    client: httpx.Client | httpx.AsyncClient,
    path: str,
    ranges: Sequence[RowRange],
    *,
    wait: bool,
    headers: dict[str, str] | None,
) -> httpx.Request:
    """A request for several ranges (``/v1/embeddings/fetch`` or ``/v1/embeddings/shm``)."""
    payload = {"ranges": [_range(r) for r in ranges], "wait": wait}
    return msgpack_request(client, path, payload, headers)


def _range(r: RowRange) -> dict[str, Any]:
    """A range on the wire; its lease only where it has one (a service before leases takes none)."""
    out: dict[str, Any] = {"hash": r.hash, "start": r.start, "end": r.end}
    if r.lease is not None:
        out["lease"] = r.lease
    return out


def pinning(headers: dict[str, str] | None, pin: bool) -> dict[str, str]:
    """``headers`` asking for a lease id on each ready or pending handle (``pin``), or for no pin at all:
    a caller that will not read the rows from this service (a service before leases ignores the header)."""
    return {**(headers or {}), LEASE_HEADER: "id" if pin else "none"}


def fetch_many_flow(
    client: httpx.Client | httpx.AsyncClient, ranges: Sequence[RowRange], *, wait: bool, headers: dict[str, str] | None
) -> AnyFlow[list[np.ndarray]]:
    """Several ranges in one round trip, each read into a new array."""
    head = yield from send_streamed(ranges_request(client, "/v1/embeddings/fetch", ranges, wait=wait, headers=headers))
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


def failed_range(item: dict[str, Any]) -> Exception:
    """The exception of a range the service answered with an error in its place."""
    return error_for(int(item.get("status", 500)), "fetch_failed", f"{item.get('hash')}: {item.get('error')}")


def simple_flow(
    client: httpx.Client | httpx.AsyncClient, method: str, path: str, headers: dict[str, str] | None
) -> Flow[dict[str, Any]]:
    """One request whose answer is a JSON object (``ProtocolError`` if it is anything else: a page of
    another server on the way, a body cut short)."""
    resp = yield client.build_request(method, path, headers=headers)
    raise_for_status(resp)
    try:
        body = resp.json()
    except ValueError as e:  # not JSON (nor UTF-8)
        raise ProtocolError(f"{method} {path}: unreadable answer ({resp.headers.get('content-type')}): {e}") from e
    if not isinstance(body, dict):
        raise ProtocolError(f"{method} {path}: the answer is not a JSON object but {type(body).__name__}")
    return body
