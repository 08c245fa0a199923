"""``POST /v1/embeddings/shm``: rows handed out as shared-memory segments (same host)."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from visenc.api.codec import render
from visenc.api.deps import ERRORS, RequestRoute, body_schema, engine_of, namespace_of
from visenc.api.embeddings import resolve_ranges
from visenc.api.schemas import FetchRequest
from visenc.config import Settings
from visenc.errors import Overloaded, TransportDisabled
from visenc.metrics import Metrics
from visenc.shm import SegmentPool
from visenc_client.format import DATA_OFFSET, entry_key

log = logging.getLogger(__name__)
router = APIRouter(route_class=RequestRoute)


def _room(directory: str) -> int | None:
    """Free bytes in ``directory``; ``None`` when it is not a directory this process may write to."""
    if not os.path.isdir(directory) or not os.access(directory, os.W_OK):
        return None
    return shutil.disk_usage(directory).free


async def start_pool(settings: Settings, metrics: Metrics) -> SegmentPool | None:
    """The segment pool, or ``None`` when shared memory is off or ``shm_dir`` cannot hold segments (said in the
    log: rows are then served over HTTP only)."""
    if not settings.shm_enabled:
        return None
    room = await asyncio.to_thread(_room, settings.shm_dir)
    if room is None:
        log.warning("shared memory is off: %s is not a writable directory", settings.shm_dir)
        return None
    max_bytes = min(settings.shm_max_bytes or 0, room)
    if max_bytes <= 0:
        log.warning("shared memory is off: no room in %s", settings.shm_dir)
        return None
    pool = SegmentPool(settings.shm_dir, lease_s=settings.shm_lease_s, max_bytes=max_bytes, metrics=metrics)
    await pool.start()
    log.info("shared-memory rows: up to %.1f GiB of segments in %s", max_bytes / 2**30, settings.shm_dir)
    return pool


async def stop_pool(pool: SegmentPool | None) -> None:
    if pool is not None:
        await pool.close()


@router.post("/v1/embeddings/shm", responses=ERRORS, openapi_extra=body_schema(FetchRequest))
async def fetch_shm(request: Request) -> Response:
    """Several ``(hash, start, end)`` ranges as shared-memory handles instead of bytes."""
    pool: SegmentPool | None = getattr(request.app.state, "shm", None)
    if pool is None:
        raise TransportDisabled("the shared-memory transport is off (start the service with --shm-enabled true)")
    engine = engine_of(request)
    ns = namespace_of(request)
    items: list[dict[str, Any]] = []
    served = 0
    for r in await resolve_ranges(request):
        if isinstance(r, dict):
            items.append(r)
            continue
        try:
            segment = await pool.export(entry_key(ns, engine.fingerprint, r.hash), r.entry)
        except Overloaded as e:  # the budget is full: this range alone is refused (the client reads it over HTTP)
            items.append({"hash": r.hash, "status": e.status_code, "error": e.message})
            continue
        # exported: the segment holds every row for its own lease, so the pin in L1 goes, whatever the range
        engine.read(r.hash, ns, r.lease, last=True)
        nbytes = (r.end - r.start) * r.entry.row_bytes
        items.append(
            {
                "hash": r.hash,
                "start": r.start,
                "end": r.end,
                "shape": [r.end - r.start, r.entry.hidden],
                "dtype": r.entry.dtype,
                "segment": segment.name,
                "offset": DATA_OFFSET + r.start * r.entry.row_bytes,
                "nbytes": nbytes,
            }
        )
        served += nbytes
    request.app.state.metrics.bytes_served.labels("shm").inc(served)
    return render(request, {"dir": pool.directory, "lease_s": pool.lease_s, "items": items})
