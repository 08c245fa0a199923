"""Rows of encoded images: one range as raw bytes, or many ranges in one round trip."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from visenc.api.codec import ROWS_MEDIA_TYPE, parse, rows_response
from visenc.api.deps import ERRORS, RequestRoute, body_schema, check_range, engine_of, namespace_of, read_lease
from visenc.api.guard import guarded, remaining, within
from visenc.api.schemas import MAX_ROW, FetchRequest
from visenc.errors import PayloadTooLarge, VisencError
from visenc_client.format import Entry

router = APIRouter(route_class=RequestRoute)


@router.get(
    "/v1/embeddings/{image_hash}",
    responses={
        200: {
            "content": {"application/octet-stream": {}},
            "description": "Raw little-endian rows; shape and dtype in headers.",
        },
        **ERRORS,
    },
    response_class=Response,
)
async def get_embedding(
    request: Request,
    image_hash: str,
    start: int | None = Query(None, ge=0, le=MAX_ROW, description="First token row."),
    end: int | None = Query(None, ge=0, le=MAX_ROW, description="One past the last token row."),
    lease: str | None = Query(
        None, max_length=64, description="The lease its handle carried: renewed, or unpinned by a read to the last row."
    ),
) -> Response:
    """Token rows ``[start, end)`` of one image as raw bytes, waiting while it is pending."""
    settings = request.app.state.settings
    deadline = asyncio.get_running_loop().time() + settings.fetch_timeout_s
    entry = await guarded(
        request,
        engine_of(request).lookup(image_hash, namespace_of(request)),
        deadline + 1.0,
        f"image {image_hash} was not ready within fetch_timeout_s={settings.fetch_timeout_s}",
    )
    s, e = check_range(entry, start, end)
    view = entry.rows_view(s, e)
    request.app.state.metrics.bytes_served.labels("http").inc(len(view))
    engine_of(request).read(image_hash, namespace_of(request), read_lease(request, lease), last=e == entry.rows)
    headers = {
        "X-Visenc-Shape": f"{e - s},{entry.hidden}",
        "X-Visenc-Dtype": entry.dtype,
        "X-Visenc-Rows": f"{s}-{e}",
        "X-Visenc-Total-Rows": str(entry.rows),
        "X-Visenc-Grid-Thw": ",".join(map(str, entry.grid_thw)),
    }
    return Response(view, media_type="application/octet-stream", headers=headers)


@dataclass(frozen=True, slots=True)
class Resolved:
    """One requested range, found: its entry and checked bounds ``[start, end)``."""

    hash: str
    entry: Entry
    start: int
    end: int
    lease: str | None


async def resolve_ranges(request: Request) -> list[Resolved | dict[str, Any]]:
    """Parse a fetch body and find every range's entry: located in one pass, then waited for (and, if
    pending, bumped) together."""
    settings = request.app.state.settings
    limit = f"fetch_timeout_s={settings.fetch_timeout_s}"
    deadline = asyncio.get_running_loop().time() + settings.fetch_timeout_s  # one for the whole request
    ns = namespace_of(request)
    engine = engine_of(request)
    body = await within(
        parse(request, FetchRequest, settings.max_body_bytes, settings.max_items),
        deadline,
        f"the request body did not arrive within {limit}",
    )
    if len(body.ranges) > settings.max_items:
        raise PayloadTooLarge(f"{len(body.ranges)} ranges exceed max_items={settings.max_items}")
    timeout_s = remaining(deadline) if body.wait else 0.0
    lookups = engine.lookup_many([r.hash for r in body.ranges], ns, timeout_s=timeout_s)
    found = await guarded(request, lookups, deadline + 1.0, f"the ranges were not ready within {limit}")
    out: list[Resolved | dict[str, Any]] = []
    for r, f in zip(body.ranges, found):
        try:
            if isinstance(f, VisencError):
                raise f
            out.append(Resolved(r.hash, f, *check_range(f, r.start, r.end), read_lease(request, r.lease)))
        except VisencError as err:
            if not err.public:
                raise
            out.append({"hash": r.hash, "status": err.status_code, "error": err.message})
    return out


@router.post(
    "/v1/embeddings/fetch",
    responses={
        200: {
            "content": {ROWS_MEDIA_TYPE: {}},
            "description": "u32 header length, msgpack header, then raw rows.",
        },
        **ERRORS,
    },
    response_class=Response,
    openapi_extra=body_schema(FetchRequest),
)
async def fetch(request: Request) -> Response:
    """Several ``(hash, start, end)`` ranges in one round trip (one response, rows back to back)."""
    meta: list[dict[str, Any]] = []
    views: list[memoryview] = []
    offset = 0
    engine, ns = engine_of(request), namespace_of(request)
    for r in await resolve_ranges(request):
        if isinstance(r, dict):
            meta.append(r)
            continue
        engine.read(r.hash, ns, r.lease, last=r.end == r.entry.rows)  # to the last row: the pin goes
        view = r.entry.rows_view(r.start, r.end)
        shape = [r.end - r.start, r.entry.hidden]
        meta.append(
            {
                "hash": r.hash,
                "start": r.start,
                "end": r.end,
                "shape": shape,
                "dtype": r.entry.dtype,
                "offset": offset,
                "nbytes": len(view),
            }
        )
        views.append(view)
        offset += len(view)
    request.app.state.metrics.bytes_served.labels("http").inc(offset)
    return rows_response(meta, views)
