"""The steps a flow yields (``Client`` drives them with blocking calls, ``AsyncClient`` with awaits), and the
readers of streamed answers built on them."""

from __future__ import annotations

import json
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import httpx
import numpy as np

from visenc_client._exceptions import ProtocolError, error_for
from visenc_client.format import FRAME_PREFIX_BYTES, NUMPY_DTYPES, CorruptFrame, frame_header_length, frame_items

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Head:
    """A streamed answer's status and headers (its body is read by later steps)."""

    status_code: int
    reason_phrase: str
    headers: httpx.Headers


@dataclass(frozen=True, slots=True)
class Ask:
    """Step: send this request; its ``httpx.Response`` comes back, read whole. Each driver sends it its own
    way (no flow knows the transport)."""

    method: str
    #: with its query string
    path: str
    headers: dict[str, str]
    content: bytes = b""


Flow = Generator[Ask, httpx.Response, T]
#: a flow that may also stream: yields ``Ask | Stream | ReadInto | Read``
AnyFlow = Generator[Any, Any, T]


@dataclass(frozen=True, slots=True)
class Stream:
    """Step: send ``request``; its ``Head`` comes back, the body unread."""

    request: Ask


@dataclass(frozen=True, slots=True)
class ReadInto:
    """Step: fill ``view`` with the streamed body's next ``len(view)`` bytes."""

    view: memoryview


class Read:
    """Step: the next chunk of the streamed body, ``b""`` at its end."""


READ = Read()


def send_streamed(request: Ask) -> Generator[Stream, Any, Head]:
    head = yield Stream(request)
    return cast(Head, head)


def read_chunk() -> Generator[Read, Any, bytes]:
    chunk = yield READ
    return cast(bytes, chunk)


def read_exactly(n: int) -> Generator[ReadInto, Any, bytes]:
    buf = bytearray(n)
    yield ReadInto(memoryview(buf))
    return bytes(buf)


def read_all() -> Generator[Read, Any, bytes]:
    parts = []
    while chunk := (yield from read_chunk()):
        parts.append(chunk)
    return b"".join(parts)


def expect_end() -> Generator[Read, Any, None]:
    if (yield from read_chunk()):
        raise ProtocolError("the response body is longer than its header says")


def read_frame(head: Head, place: Callable[[dict[str, Any]], memoryview]) -> Generator[Any, Any, list[dict[str, Any]]]:
    """A streamed rows frame's items; each item's rows are read straight into ``place(item)``."""
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
    return array.reshape(-1).view(np.uint8).data


def owned_array(item: dict[str, Any]) -> np.ndarray:
    rows, hidden = (int(x) for x in item["shape"])
    return np.empty((rows, hidden), NUMPY_DTYPES[str(item["dtype"])])


def as_array(buf: bytes | memoryview, dtype: str, rows: int, hidden: int) -> np.ndarray:
    if dtype not in NUMPY_DTYPES:
        raise ProtocolError(f"unknown dtype {dtype!r}")
    array: np.ndarray = np.frombuffer(buf, dtype=NUMPY_DTYPES[dtype])
    return array.reshape(rows, hidden)


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


def failed_range(item: dict[str, Any]) -> Exception:
    return error_for(int(item.get("status", 500)), "fetch_failed", f"{item.get('hash')}: {item.get('error')}")
