"""``POST /v1/embeddings/shm``: rows handed out as shared-memory segments (same host).

Off unless ``shm_enabled``; the segment pool (``visenc.shm``) is built in the
app's lifespan and closed (every segment unlinked) at shutdown.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from visenc.api.codec import parse, render
from visenc.api.routes import _ERRORS, _body_schema, _encoder, check_range, namespace_of
from visenc.api.schemas import FetchRequest
from visenc.config import Settings
from visenc.errors import PayloadTooLarge, TransportDisabled, VisencError
from visenc.index.format import DATA_OFFSET
from visenc.index.keys import entry_key
from visenc.metrics import Metrics
from visenc.shm import SegmentPool

router = APIRouter()


async def start_pool(settings: Settings, metrics: Metrics) -> SegmentPool | None:
    if not settings.shm_enabled:
        return None
    pool = SegmentPool(settings.shm_dir, lease_s=settings.shm_lease_s, max_bytes=settings.shm_max_bytes,
                       metrics=metrics)
    await pool.start()
    return pool


async def stop_pool(pool: SegmentPool | None) -> None:
    if pool is not None:
        await pool.close()


@router.post("/v1/embeddings/shm", responses=_ERRORS, openapi_extra=_body_schema(FetchRequest))
async def fetch_shm(request: Request) -> Response:
    """Several ``(hash, start, end)`` ranges as shared-memory handles instead of bytes.

    Answer: ``{"dir", "lease_s", "items": [{"hash", "start", "end", "shape", "dtype",
    "segment", "offset", "nbytes"} | {"hash", "status", "error"}]}``. Item rows are
    bytes ``[offset, offset + nbytes)`` of file ``dir/segment``, openable for at
    least ``lease_s`` seconds; map it read-only (the mapping outlives the file)."""
    pool: SegmentPool | None = getattr(request.app.state, "shm", None)
    if pool is None:
        raise TransportDisabled("the shared-memory transport is off (start the service with --shm-enabled true)")
    settings = request.app.state.settings
    body = await parse(request, FetchRequest, settings.max_body_bytes)
    if len(body.ranges) > settings.max_items:
        raise PayloadTooLarge(f"{len(body.ranges)} ranges exceed max_items={settings.max_items}")
    encoder = _encoder(request)
    ns = namespace_of(request)
    items: list[dict[str, Any]] = []
    served = 0
    for r in body.ranges:
        try:
            entry = await encoder.lookup(r.hash, ns, timeout_s=None if body.wait else 0.0)
            s, e = check_range(entry, r.start, r.end)
        except VisencError as err:
            if not err.public:
                raise
            items.append({"hash": r.hash, "status": err.status_code, "error": err.message})
            continue
        segment = await pool.export(entry_key(ns, encoder.fingerprint, r.hash), entry)
        nbytes = (e - s) * entry.row_bytes
        items.append({"hash": r.hash, "start": s, "end": e, "shape": [e - s, entry.hidden], "dtype": entry.dtype,
                      "segment": segment.name, "offset": DATA_OFFSET + s * entry.row_bytes, "nbytes": nbytes})
        served += nbytes
    request.app.state.metrics.bytes_served.labels("shm").inc(served)
    return render(request, {"dir": pool.directory, "lease_s": pool.lease_s, "items": items})
