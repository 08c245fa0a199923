"""``POST /v1/encode``: look images up by hash and encode the misses that came with bytes."""

from __future__ import annotations

import asyncio
import base64

from fastapi import APIRouter, Request
from fastapi.responses import Response

from visenc.api.codec import ROWS_MEDIA_TYPE, parse, render, rows_response, wants_msgpack
from visenc.api.deps import ERRORS, RequestRoute, body_schema, engine_of, lease_mode, namespace_of, priority_of
from visenc.api.guard import guarded, remaining, within
from visenc.api.schemas import EncodeRequest, EncodeResponse
from visenc.engine.interface import EncodeItem, Timing
from visenc.errors import PayloadTooLarge

router = APIRouter(route_class=RequestRoute)


@router.post(
    "/v1/encode",
    response_model=EncodeResponse,
    responses={
        200: {
            "content": {ROWS_MEDIA_TYPE: {}},
            "description": "With include_rows and Accept: application/x-visenc-rows: a rows frame whose items are "
            "the handles, each ready one with its rows' offset, nbytes and shape.",
        },
        **ERRORS,
    },
    openapi_extra=body_schema(EncodeRequest),
)
async def encode(request: Request) -> Response:
    """Look images up by hash and encode the misses that came with bytes."""
    settings = request.app.state.settings
    limit = f"request_timeout_s={settings.request_timeout_s}"
    deadline = asyncio.get_running_loop().time() + settings.request_timeout_s
    ns = namespace_of(request)
    engine = engine_of(request)
    engine.precheck(ns)  # a tenant at its quota is refused before its body is read
    body = await within(
        parse(request, EncodeRequest, settings.max_body_bytes, settings.max_items),
        deadline,
        f"the request body did not arrive within {limit}",
    )
    inputs = [EncodeItem(it.hash, it.data, it.frames) for it in body.items]
    timing = Timing()
    # rows inline come with the answer itself: nothing is kept for a later read
    lease = "none" if body.include_rows else lease_mode(request)
    priority = priority_of(request, body.priority)
    # the engine's own wait ends at the deadline; the guard (1 s later) backs it up and
    # cancels the wait if the client goes away first
    handles = await guarded(
        request,
        engine.encode(
            inputs,
            ns,
            wait=body.wait,
            timing=timing,
            timeout_s=remaining(deadline),
            lease=lease,
            rows=body.include_rows,
            priority=priority,
        ),
        deadline + 1.0,
        f"the request was not answered within {limit}",
    )
    items = [h.to_wire() for h in handles]
    headers = {"X-Visenc-Queue-Time": f"{timing.queue_s:.6f}", "X-Visenc-Encode-Time": f"{timing.encode_s:.6f}"}
    if not body.include_rows:
        return render(request, {"model": engine.fingerprint, "items": items}, headers=headers)
    rows = [(it, h.rows.data.cast("B")) for it, h in zip(items, handles) if h.rows is not None]
    total = sum(len(view) for _, view in rows)
    if total > settings.max_body_bytes:
        raise PayloadTooLarge(
            f"{total} bytes of rows exceed max_body_bytes={settings.max_body_bytes} inline; fetch them instead"
        )
    request.app.state.metrics.bytes_served.labels("inline").inc(total)
    if ROWS_MEDIA_TYPE in request.headers.get("accept", ""):  # a rows frame: the handles, then raw rows
        offset = 0
        for it, view in rows:
            it.update(offset=offset, nbytes=len(view), shape=[it["num_tokens"], it["hidden_size"]])
            offset += len(view)
        return rows_response(items, [view for _, view in rows], headers)
    binary = wants_msgpack(request)
    for it, view in rows:
        it["rows"] = view if binary else base64.b64encode(view).decode()
    return render(request, {"model": engine.fingerprint, "items": items}, headers=headers)
