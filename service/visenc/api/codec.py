"""Request and response encodings: JSON or msgpack, chosen by Content-Type / Accept."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, TypeVar

import msgpack
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from visenc.errors import BadRequest, InvalidBody, PayloadTooLarge, UnsupportedMediaType, VisencError
from visenc.streams import read_capped
from visenc_client.format import JSON, MSGPACK, MSGPACK_TYPES, ROWS_MEDIA_TYPE, frame_head

__all__ = ["MSGPACK", "MSGPACK_TYPES", "ROWS_MEDIA_TYPE"]

M = TypeVar("M", bound=BaseModel)


def _media_type(value: str | None) -> str:
    return (value or "").split(";", 1)[0].strip().lower()


def wants_msgpack(request: Request) -> bool:
    return any(t in request.headers.get("accept", "") for t in MSGPACK_TYPES)


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refusing (413) past ``limit`` bytes before reading them all (from ``Content-Length`` when
    declared, else while a chunked body streams in)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise PayloadTooLarge(f"body of {declared} bytes exceeds max_body_bytes={limit}")
        except ValueError as e:
            raise BadRequest("bad Content-Length header") from e
    return await read_capped(request.stream(), limit, lambda: PayloadTooLarge(f"body exceeds max_body_bytes={limit}"))


def _validation_message(e: ValidationError) -> str:
    parts = []
    for err in e.errors()[:5]:
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


class _TooManyValues(Exception):
    pass


def _unpack_msgpack(body: bytes, max_items: int) -> Any:
    """msgpack → Python with the work bounded by ``max_items``, not by the body size."""
    budget = max_items + 8  # one map per item plus a few; arrays capped at max_items elements
    seen = 0

    def count(value: Any) -> Any:
        nonlocal seen
        seen += 1
        if seen > budget:
            raise _TooManyValues
        return value

    try:
        return msgpack.unpackb(
            body, raw=False, strict_map_key=True, max_array_len=max_items, object_hook=count, list_hook=count
        )
    except _TooManyValues as e:
        raise PayloadTooLarge(f"the body holds more maps and arrays than max_items={max_items} allows") from e
    except ValueError as e:
        if "max_array_len" in str(e):
            raise PayloadTooLarge(f"an array in the body has more than max_items={max_items} elements") from e
        raise BadRequest(f"malformed msgpack body: {type(e).__name__}") from e
    except Exception as e:
        raise BadRequest(f"malformed msgpack body: {type(e).__name__}") from e


def _check_json_size(body: bytes, max_items: int) -> None:
    """Refuse a JSON body whose value count alone exceeds what ``max_items`` allows."""
    commas = body.count(b",")  # a valid body has at most 3 commas per item (base64/hex strings hold none)
    if commas > 4 * max_items + 16:
        raise PayloadTooLarge(
            f"the body holds {commas + 1} or more JSON values, more than max_items={max_items} items can have"
        )


async def parse(request: Request, model: type[M], limit: int, max_items: int) -> M:
    """Parse a JSON or msgpack body into ``model`` (4xx on anything malformed)."""
    media = _media_type(request.headers.get("content-type"))
    if media not in MSGPACK_TYPES and media not in (JSON, ""):
        raise UnsupportedMediaType(
            f"Content-Type {media!r} is not supported; use application/json or application/msgpack"
        )
    body = await read_body(request, limit)
    try:
        if media in MSGPACK_TYPES:
            return model.model_validate(_unpack_msgpack(body, max_items))
        _check_json_size(body, max_items)
        return model.model_validate_json(body)
    except ValidationError as e:
        raise InvalidBody(f"invalid request: {_validation_message(e)}") from e


def render(
    request: Request, payload: dict[str, Any], status_code: int = 200, headers: dict[str, str] | None = None
) -> Response:
    if wants_msgpack(request):
        return Response(msgpack.packb(payload), status_code, headers, media_type=MSGPACK)
    body = json.dumps(payload, separators=(",", ":")).encode()
    return Response(body, status_code, headers, media_type=JSON)


class ChunksResponse(Response):
    """A body sent as several buffers (views into cached entries), never joined into one."""

    def __init__(
        self, chunks: Sequence[bytes | memoryview], media_type: str, headers: dict[str, str] | None = None
    ) -> None:
        self.chunks = [c for c in chunks if len(c)]
        super().__init__(None, 200, headers, media_type)
        self.headers["content-length"] = str(sum(len(c) for c in self.chunks))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        if not self.chunks:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        for i, chunk in enumerate(self.chunks):
            await send({"type": "http.response.body", "body": chunk, "more_body": i < len(self.chunks) - 1})


def rows_response(
    meta: list[dict[str, Any]], views: Sequence[memoryview], headers: dict[str, str] | None = None
) -> ChunksResponse:
    return ChunksResponse([frame_head(meta), *views], ROWS_MEDIA_TYPE, headers)


def error_response(exc: VisencError) -> JSONResponse:
    """The one rendering of an error: ``{"error": {"kind", "message"}}`` with its status and headers; an
    internal error answers a generic 500 that echoes nothing."""
    if not exc.public:
        return JSONResponse({"error": {"kind": "internal", "message": "internal error"}}, 500)
    return JSONResponse({"error": {"kind": exc.kind, "message": exc.message}}, exc.status_code, exc.headers or None)
