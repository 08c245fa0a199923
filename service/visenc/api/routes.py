"""HTTP routes: encode, fetch, model info, health and metrics.

Handlers only translate between the wire and the engine: no torch here, no
CPU-heavy work on the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import re
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from visenc.api.codec import ROWS_MEDIA_TYPE, parse, render, rows_response, wants_msgpack
from visenc.api.guard import guarded, remaining, within
from visenc.api.schemas import MAX_ROW, EncodeRequest, EncodeResponse, ErrorResponse, FetchRequest
from visenc.engine.encoder import EncodeItem, Encoder
from visenc.engine.job import Timing
from visenc.errors import BadRequest, NotReady, PayloadTooLarge, VisencError
from visenc.index.format import Entry

router = APIRouter()
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text}
    for code, text in [(400, "Bad input"), (404, "Unknown image"), (413, "Over a limit"),
                       (415, "Unsupported content type"), (422, "Invalid body"), (429, "Queue full"),
                       (503, "Not ready"), (504, "Deadline exceeded")]
}


def _body_schema(model: type) -> dict[str, Any]:
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": ref}, "application/msgpack": {"schema": ref}}}}


def _encoder(request: Request) -> Encoder:
    return request.app.state.encoder  # type: ignore[no-any-return]


def namespace_of(request: Request) -> str:
    """The caller's key namespace: set by auth when enabled, else the header or the default."""
    ns = getattr(request.state, "namespace", None)
    if ns is not None:
        return str(ns)
    ns = request.headers.get("x-visenc-namespace")
    if ns is None:  # present but empty is malformed, not the default
        ns = request.app.state.settings.namespace
    if not _NAMESPACE_RE.fullmatch(ns):
        raise BadRequest("X-Visenc-Namespace must be 1-64 characters of [A-Za-z0-9_.-]")
    return ns


def check_range(entry: Entry, start: int | None, end: int | None) -> tuple[int, int]:
    s = 0 if start is None else start
    e = entry.rows if end is None else end
    if not 0 <= s <= e <= entry.rows:
        raise BadRequest(f"range [{s}, {e}) is outside the image's {entry.rows} token rows")
    return s, e


@router.post("/v1/encode", response_model=EncodeResponse, responses=_ERRORS,
             openapi_extra=_body_schema(EncodeRequest))
async def encode(request: Request) -> Response:
    """Look images up by hash and encode the misses that came with bytes.

    Each item is ``{"hash"}``, ``{"data"}`` or both. A hash-only item that is not
    in the index answers ``missing`` (upload its bytes next: hash-first). With
    ``wait=false`` the answer comes at once with ``pending`` handles that already
    carry ``num_tokens``; fetch the rows later.

    ``X-Visenc-Queue-Time`` / ``X-Visenc-Encode-Time`` (seconds) say how long the
    images this response waited for queued and how long their forwards took."""
    settings = request.app.state.settings
    limit = f"request_timeout_s={settings.request_timeout_s}"
    deadline = asyncio.get_running_loop().time() + settings.request_timeout_s
    ns = namespace_of(request)
    body = await within(parse(request, EncodeRequest, settings.max_body_bytes, settings.max_items), deadline,
                        f"the request body did not arrive within {limit}")
    encoder = _encoder(request)
    inputs = [EncodeItem(it.hash, it.data) for it in body.items]
    timing = Timing()
    # the engine's own wait ends at the deadline; the guard (1 s later) backs it up and
    # cancels the wait if the client goes away first
    handles = await guarded(
        request, encoder.encode(inputs, ns, wait=body.wait, timing=timing, timeout_s=remaining(deadline)),
        deadline + 1.0, f"the request was not answered within {limit}",
    )
    items = [h.to_wire() for h in handles]
    if body.include_rows:
        await _inline_rows(request, items, settings.max_body_bytes)
    return render(request, {"model": encoder.fingerprint, "items": items},
                  headers={"X-Visenc-Queue-Time": f"{timing.queue_s:.6f}",
                           "X-Visenc-Encode-Time": f"{timing.encode_s:.6f}"})


async def _inline_rows(request: Request, items: list[dict[str, Any]], limit: int) -> None:
    """Put each ready item's rows into its answer: views for msgpack, base64 text for JSON."""
    encoder = _encoder(request)
    ns = namespace_of(request)
    ready = [it for it in items if it["status"] == "ready"]
    entries = [await encoder.lookup(it["hash"], ns) for it in ready]
    total = sum(len(e.rows_view()) for e in entries)
    if total > limit:
        raise PayloadTooLarge(f"{total} bytes of rows exceed max_body_bytes={limit} inline; fetch them instead")
    binary = wants_msgpack(request)
    for it, entry in zip(ready, entries):
        view = entry.rows_view()
        it["rows"] = view if binary else base64.b64encode(view).decode()
    request.app.state.metrics.bytes_served.labels("inline").inc(total)


@router.get(
    "/v1/embeddings/{image_hash}",
    responses={200: {"content": {"application/octet-stream": {}},
                     "description": "Raw little-endian rows; shape and dtype in headers."}, **_ERRORS},
    response_class=Response,
)
async def get_embedding(
    request: Request,
    image_hash: str,
    start: int | None = Query(None, ge=0, le=MAX_ROW, description="First token row."),
    end: int | None = Query(None, ge=0, le=MAX_ROW, description="One past the last token row."),
) -> Response:
    """Token rows ``[start, end)`` of one image as raw bytes, waiting while it is pending."""
    settings = request.app.state.settings
    deadline = asyncio.get_running_loop().time() + settings.fetch_timeout_s
    entry = await guarded(request, _encoder(request).lookup(image_hash, namespace_of(request)), deadline + 1.0,
                          f"image {image_hash} was not ready within fetch_timeout_s={settings.fetch_timeout_s}")
    s, e = check_range(entry, start, end)
    view = entry.rows_view(s, e)
    request.app.state.metrics.bytes_served.labels("http").inc(len(view))
    return Response(view, media_type="application/octet-stream", headers={
        "X-Visenc-Shape": f"{e - s},{entry.hidden}", "X-Visenc-Dtype": entry.dtype,
        "X-Visenc-Rows": f"{s}-{e}", "X-Visenc-Total-Rows": str(entry.rows),
        "X-Visenc-Grid-Thw": ",".join(map(str, entry.grid_thw)),
    })


@dataclass(frozen=True, slots=True)
class Resolved:
    """One requested range, found: its entry and checked bounds ``[start, end)``."""

    hash: str
    entry: Entry
    start: int
    end: int


async def resolve_ranges(request: Request) -> list[Resolved | dict[str, Any]]:
    """Parse a fetch body and find every range's entry, looked up (and, if pending, bumped) all at once.

    Waiting on the ranges one after the other would raise the priority of the
    second image only once the first is done: a chunk's images must all move to
    the front of the queue together. A range that fails with a public error
    answers ``{"hash", "status", "error"}`` in its place; any other error raises."""
    settings = request.app.state.settings
    limit = f"fetch_timeout_s={settings.fetch_timeout_s}"
    deadline = asyncio.get_running_loop().time() + settings.fetch_timeout_s  # one for the whole request
    ns = namespace_of(request)
    body = await within(parse(request, FetchRequest, settings.max_body_bytes, settings.max_items), deadline,
                        f"the request body did not arrive within {limit}")
    if len(body.ranges) > settings.max_items:
        raise PayloadTooLarge(f"{len(body.ranges)} ranges exceed max_items={settings.max_items}")
    encoder = _encoder(request)
    timeout_s = remaining(deadline) if body.wait else 0.0
    lookups = asyncio.gather(*(encoder.lookup(r.hash, ns, timeout_s=timeout_s) for r in body.ranges),
                             return_exceptions=True)
    found = await guarded(request, lookups, deadline + 1.0, f"the ranges were not ready within {limit}")
    out: list[Resolved | dict[str, Any]] = []
    for r, f in zip(body.ranges, found):
        try:
            if isinstance(f, BaseException):
                raise f
            out.append(Resolved(r.hash, f, *check_range(f, r.start, r.end)))
        except VisencError as err:
            if not err.public:
                raise
            out.append({"hash": r.hash, "status": err.status_code, "error": err.message})
    return out


@router.post(
    "/v1/embeddings/fetch",
    responses={200: {"content": {ROWS_MEDIA_TYPE: {}},
                     "description": "u32 header length, msgpack header, then raw rows."}, **_ERRORS},
    response_class=Response,
    openapi_extra=_body_schema(FetchRequest),
)
async def fetch(request: Request) -> Response:
    """Several ``(hash, start, end)`` ranges in one round trip (one response, rows back to back)."""
    meta: list[dict[str, Any]] = []
    views: list[memoryview] = []
    offset = 0
    for r in await resolve_ranges(request):
        if isinstance(r, dict):
            meta.append(r)
            continue
        view = r.entry.rows_view(r.start, r.end)
        meta.append({"hash": r.hash, "start": r.start, "end": r.end, "shape": [r.end - r.start, r.entry.hidden],
                     "dtype": r.entry.dtype, "offset": offset, "nbytes": len(view)})
        views.append(view)
        offset += len(view)
    request.app.state.metrics.bytes_served.labels("http").inc(offset)
    return rows_response(meta, views)


@router.get("/v1/model")
async def model_info(request: Request) -> Response:
    """The served tower: name, fingerprint, hidden size, dtype, device."""
    encoder = _encoder(request)
    return render(request, encoder.tower.describe())


@router.get("/healthz", response_class=PlainTextResponse)
async def healthz() -> str:
    """Liveness: the process answers."""
    return "ok"


@router.get("/readyz")
async def readyz(request: Request) -> Response:
    """Readiness: model loaded and device worker alive (503 otherwise).

    ``status`` is ``degraded`` (still 200: the replica serves from its own LRU and
    by encoding) while the shared Redis index is unreachable, else ``ready``."""
    encoder: Encoder | None = getattr(request.app.state, "encoder", None)
    if encoder is None:
        raise NotReady("the model is loading")
    reason = encoder.not_ready_reason()
    if reason is not None:
        raise NotReady(reason, **{"Retry-After": "5"})
    index = encoder.index.health()
    return render(request, {"status": "ready" if index.get("ok", True) else "degraded", "index": index,
                            "queue_depth": encoder.scheduler.depth})


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> Response:
    """Prometheus exposition."""
    m = request.app.state.metrics
    encoder = request.app.state.encoder
    m.queue_depth.set(encoder.scheduler.depth)
    m.worker_alive.set(1 if encoder.ready else 0)  # a worker task that died reads 0 at the next scrape
    m.export_index_health(encoder.index.health())
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)
