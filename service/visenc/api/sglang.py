"""SGLang's encoder endpoints: visenc as an ``--encoder-urls`` target of an SGLang language server
(``--language-only``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from visenc.api.codec import read_body
from visenc.api.deps import RequestRoute, engine_of
from visenc.config import Settings
from visenc.epd import EPD, EncodePart, EPDError, EPDSettings, ReceiveUrl
from visenc.errors import VisencError
from visenc.metrics import Metrics

router = APIRouter(include_in_schema=False, route_class=RequestRoute)
M = TypeVar("M", bound=BaseModel)


def start(settings: Settings, metrics: Metrics, *, auth: bool) -> EPD | None:
    """The protocol's state for the app's lifetime (``None`` where SGLang may not be served)."""
    namespace = settings.sglang_namespace or (None if auth else settings.namespace)
    if namespace is None:
        return None
    return EPD(
        EPDSettings(
            namespace=namespace,
            max_items=settings.max_items,
            max_image_bytes=settings.max_image_bytes,
            image_loader=settings.image_loader,
            max_pixels=settings.max_image_pixels,
            allow_url_prefixes=tuple(settings.sglang_url_prefixes),
            encode_timeout_s=settings.request_timeout_s,
            register_timeout_s=settings.sglang_register_timeout_s,
        ),
        metrics,
    )


async def stop(epd: EPD | None) -> None:
    if epd is not None:
        await epd.close()


def _error(message: str, status: int, req_id: Any) -> JSONResponse:
    return JSONResponse({"status": "error", "message": message, "req_id": req_id}, status)


async def _json(request: Request) -> tuple[Any, Any]:
    """(the body as JSON, its ``req_id`` where it has one)."""
    raw = await read_body(request, request.app.state.settings.max_body_bytes)
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise EPDError("the body is not valid JSON") from e
    return data, data.get("req_id") if isinstance(data, dict) else None


def _parse(model: type[M], data: Any) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "body"
        raise EPDError(f"invalid request: {where}: {first['msg']}") from e


def _epd(request: Request) -> EPD:
    epd: EPD | None = request.app.state.epd
    if epd is None:
        raise EPDError("visenc runs with API keys: set --sglang-namespace to serve SGLang", 403)
    return epd


async def _answer(request: Request, model: type[M], act: Callable[[EPD, M], Awaitable[None]]) -> Response:
    """``null`` once ``act`` is done with the parsed body, or SGLang's error shape with its req_id."""
    req_id = None
    try:
        epd = _epd(request)
        data, req_id = await _json(request)
        await act(epd, _parse(model, data))
    except EPDError as e:
        return _error(str(e), e.status, req_id)
    except VisencError as e:
        return _error(str(e), e.status_code, req_id)
    return JSONResponse(None)


@router.post("/encode")
async def encode(request: Request) -> Response:
    async def serve(epd: EPD, part: EncodePart) -> None:
        await epd.serve(engine_of(request), part)

    return await _answer(request, EncodePart, serve)


@router.post("/scheduler_receive_url")
async def scheduler_receive_url(request: Request) -> Response:
    async def register(epd: EPD, body: ReceiveUrl) -> None:
        epd.register(body)

    return await _answer(request, ReceiveUrl, register)


@router.get("/health")
async def health(request: Request) -> Response:
    engine = getattr(request.app.state, "engine", None)
    reason = "the model is loading" if engine is None else engine.not_ready_reason()
    return Response(status_code=200 if reason is None else 503)
