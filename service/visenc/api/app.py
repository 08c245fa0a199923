"""``create_app(settings)``: everything is wired in the lifespan, nothing at import time."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from visenc.api import shm as shm_api
from visenc.api.auth import AuthMiddleware, load_api_keys
from visenc.api.codec import InvalidParams, error_response
from visenc.api.openapi import install_openapi
from visenc.api.routes import router
from visenc.config import Settings
from visenc.engine.encoder import Encoder
from visenc.engine.faults import with_faults
from visenc.errors import VisencError
from visenc.index.base import Index
from visenc.index.memory import MemoryIndex
from visenc.metrics import Metrics
from visenc.models.base import VisionTower

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


def build_index(settings: Settings, metrics: Metrics) -> Index:
    """The in-process LRU; with ``redis_url``, the LRU in front of the shared Redis tier."""
    local = MemoryIndex(settings.cache_bytes, metrics)
    if settings.redis_url is None:
        return local
    from visenc.index.redis import RedisIndex
    from visenc.index.tiered import TieredIndex

    remote = RedisIndex.from_settings(settings, metrics)
    log.info("shared index: redis %s (%s)", remote.location, settings.redis_mode)
    return TieredIndex(local, remote)


def load_tower(settings: Settings) -> VisionTower:
    import torch

    from visenc.models.loading import load_tower as _load

    device = settings.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = settings.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    from visenc.engine.threads import default_torch_threads

    torch.set_num_threads(settings.torch_threads or default_torch_threads(torch.device(device)))
    return _load(settings.model, dtype=dtype, device=device, max_pixels=settings.max_pixels)


def create_app(settings: Settings | None = None, *, tower: VisionTower | None = None) -> FastAPI:
    """Build the service. ``tower`` may be passed in (tests share one loaded tower)."""
    settings = settings or Settings()
    metrics = Metrics()
    api_keys = load_api_keys(settings)  # fails fast on a malformed key list

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loaded = tower if tower is not None else await asyncio.to_thread(load_tower, settings)
        index = build_index(settings, metrics)
        claims = getattr(index, "remote", None)  # the Redis tier also holds cross-replica claims
        loaded, index = with_faults(settings, loaded, index)  # unchanged unless a fault_* setting is on
        encoder = Encoder(loaded, index, settings, metrics, claims=claims)
        d = loaded.describe()
        metrics.model_info.labels(d["name"], d["fingerprint"], d["dtype"], d["device"],
                                  str(d["hidden_size"])).set(1)
        app.state.shm = await shm_api.start_pool(settings, metrics)  # None unless shm_enabled
        await encoder.start()
        app.state.encoder = encoder
        log.info("visenc ready: model=%s fingerprint=%s settings=%s", d["name"], d["fingerprint"],
                 settings.redacted())
        try:
            yield
        finally:
            await encoder.stop()
            await shm_api.stop_pool(app.state.shm)
            await index.close()

    app = FastAPI(title="visenc", version="0.1.0", lifespan=lifespan,
                  description="Vision-encoder service: per-image embedding index, batched encoding, "
                              "lazy per-chunk fetch.")
    app.state.settings = settings
    app.state.metrics = metrics
    app.include_router(router)
    app.include_router(shm_api.router)
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

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        metrics.errors.labels("internal").inc()
        log.exception("unhandled error on %s", request.url.path)
        return error_response(VisencError())

    return app
