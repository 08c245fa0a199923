"""Operations: model info, liveness, readiness, Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from visenc.api.codec import render
from visenc.api.deps import RequestRoute, engine_of, namespace_of
from visenc.errors import NotReady

router = APIRouter(route_class=RequestRoute)


@router.get("/v1/model")
async def model_info(request: Request) -> Response:
    """The served tower: name, fingerprint, hidden size, dtype, device, and the shared-memory probe (``shm``)."""
    info = engine_of(request).describe()
    settings = request.app.state.settings
    info["served_model_name"] = settings.served_model_name or settings.model
    pool = getattr(request.app.state, "shm", None)
    if pool is not None:
        info["shm"] = pool.describe()
    return render(request, info)


@router.get("/v1/model/layout")
async def model_layout(
    request: Request,
    width: int = Query(..., ge=1, le=1 << 20, description="Image width in pixels."),
    height: int = Query(..., ge=1, le=1 << 20, description="Image height in pixels."),
) -> Response:
    """What an image of this size becomes: rows, grid, row layout, and its placeholder span in the prompt."""
    namespace_of(request)
    return render(request, engine_of(request).layout(width, height))


@router.get("/healthz", response_class=PlainTextResponse)
async def healthz() -> str:
    """Liveness: the process answers."""
    return "ok"


@router.get("/readyz")
async def readyz(request: Request) -> Response:
    """Readiness: model loaded and device worker healthy (503 with the reason otherwise)."""
    engine = engine_of(request)
    reason = engine.not_ready_reason()
    if reason is not None:
        raise NotReady(reason)
    health = engine.health()
    index = health["index"]
    status = "ready" if index.get("ok", True) else "degraded"
    body = {"status": status, "index": index, "queue_depth": health["queue_depth"], "compile": health["compile"]}
    return render(request, body)


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> Response:
    """Prometheus exposition."""
    engine = getattr(request.app.state, "engine", None)
    if engine is not None:
        engine.export_gauges()
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
