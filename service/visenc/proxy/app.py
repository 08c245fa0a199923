"""The proxy's routes: chat completions with their images tagged and handed to visenc, the rest passed through."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from visenc.proxy.core import Proxy
from visenc.proxy.errors import ProxyError


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError as e:
        raise ProxyError("the body is not valid JSON") from e
    if not isinstance(body, dict):
        raise ProxyError("the body must be a JSON object")
    return body


def create_proxy_app(proxy: Proxy) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await proxy.start()
        try:
            yield
        finally:
            await proxy.close()

    app = FastAPI(title="visenc proxy", lifespan=lifespan)
    app.state.proxy = proxy

    @app.exception_handler(ProxyError)
    async def _error(request: Request, exc: ProxyError) -> JSONResponse:
        return exc.response()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await _json_body(request)
        images = await proxy.images.tag(body)
        hashes = [i.hash for i in images]
        if proxy.settings.encode_first:
            await proxy.handover.encode(images)
            images = []
        params = body.get("ec_transfer_params")  # the client's own, kept; not an object: vLLM refuses it
        absent = proxy.handover.ask_absent(hashes) if params is None or isinstance(params, dict) else None
        return await proxy.forwarder.forward(
            request,
            "/v1/chat/completions",
            body,
            hashes,
            then=lambda: proxy.handover.later(images),
            absent=absent,
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.forwarder.forward(request, "/v1/completions", await _json_body(request), ())

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await proxy.forwarder.forward(request, "/v1/models", None, ())

    @app.get("/health")
    async def health() -> JSONResponse:
        up = [u for u, ok in proxy.upstreams.healthy.items() if ok]
        return JSONResponse({"upstreams": proxy.upstreams.healthy}, 200 if up else 503)

    return app
