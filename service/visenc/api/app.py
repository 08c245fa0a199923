"""The FastAPI app: routes, middleware, error handlers."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from visenc.api import embeddings, encode, ops, sglang
from visenc.api import shm as shm_api
from visenc.api.auth import AuthMiddleware, load_api_keys
from visenc.api.codec import error_response
from visenc.api.openapi import install_openapi
from visenc.config import Settings
from visenc.engine.interface import EngineAPI
from visenc.errors import ClientClosed, InvalidParams, VisencError
from visenc.metrics import Metrics

log = logging.getLogger("visenc")


class MetricsMiddleware:
    """Counts every request by route template and status, and times it."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        t0 = time.perf_counter()

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            endpoint = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.labels(endpoint, str(status)).inc()
            self.metrics.request_seconds.labels(endpoint).observe(time.perf_counter() - t0)


EngineContext = Callable[[FastAPI], AbstractAsyncContextManager[EngineAPI]]


def create_api(settings: Settings, metrics: Metrics, engine: EngineContext) -> FastAPI:
    """The HTTP service around an engine."""
    api_keys = load_api_keys(settings)  # fails fast on a malformed key list

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.shm = await shm_api.start_pool(settings, metrics)  # None: shared memory off
        try:
            async with engine(app) as started:
                app.state.epd = sglang.start(settings, metrics, auth=bool(api_keys))  # None: refused
                app.state.engine = started
                try:
                    yield
                finally:
                    app.state.engine = None
                    await sglang.stop(app.state.epd)
        finally:
            await shm_api.stop_pool(app.state.shm)

    app = FastAPI(
        title="visenc",
        version="0.1.0",
        lifespan=lifespan,
        description="Vision-encoder service: per-image embedding index, batched encoding, lazy per-chunk fetch.",
    )
    app.state.settings = settings
    app.state.metrics = metrics
    for module in (encode, embeddings, shm_api, ops, sglang):
        app.include_router(module.router)
    if api_keys:
        log.info("API keys on: %d keys, tenants %s", len(api_keys), sorted(set(api_keys.values())))
        app.add_middleware(AuthMiddleware, keys=api_keys, metrics=metrics)
    app.add_middleware(MetricsMiddleware, metrics=metrics)  # outermost: counts 401s too
    install_openapi(app, auth=bool(api_keys), max_items=settings.max_items)

    @app.exception_handler(VisencError)
    async def _visenc_error(request: Request, exc: VisencError) -> JSONResponse:
        metrics.errors.labels(exc.kind).inc()
        if not exc.public:
            log.error("internal error on %s: %r", request.url.path, exc)
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.errors.labels("invalid_params").inc()
        errs: list[Any] = list(exc.errors())[:5]
        msg = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}" for e in errs)
        return error_response(InvalidParams(msg or "invalid parameters"))

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect) -> JSONResponse:
        return await _visenc_error(request, ClientClosed("the client closed the connection mid-body"))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        metrics.errors.labels("internal").inc()
        log.exception("unhandled error on %s", request.url.path)
        return error_response(VisencError())

    return app
