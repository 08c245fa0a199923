"""What every route needs: the engine, the caller's namespace, a range check, OpenAPI bits."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request
from fastapi.routing import APIRoute
from starlette.responses import Response

from visenc.api.schemas import ErrorResponse
from visenc.engine.interface import EngineAPI, LeaseMode
from visenc.errors import BadRequest, NotReady
from visenc_client.format import (
    DEFAULT_PRIORITY,
    JSON,
    LEASE_HEADER,
    MSGPACK,
    NAMESPACE_RULE,
    PRIORITIES,
    PRIORITY_HEADER,
    Entry,
    Priority,
    is_valid_namespace,
)


class RequestRoute(APIRoute):
    """A route documented by FastAPI; an endpoint that takes the request alone (and parses its own body) is
    called with it directly, with no dependencies solved per request. The routers are included with none."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        d = self.dependant
        takes = (d.path_params, d.query_params, d.header_params, d.cookie_params, d.body_params, d.dependencies)
        if d.request_param_name is None or any(takes) or not inspect.iscoroutinefunction(self.endpoint):
            return super().get_route_handler()
        return self.endpoint  # type: ignore[no-any-return]


#: the error answers every /v1 route may give, for the OpenAPI document
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text}
    for code, text in [
        (400, "Bad input"),
        (404, "Unknown image"),
        (413, "Over a limit"),
        (415, "Unsupported content type"),
        (422, "Invalid body"),
        (429, "Queue full"),
        (503, "Not ready"),
        (504, "Deadline exceeded"),
    ]
}


def body_schema(model: type) -> dict[str, Any]:
    """OpenAPI ``requestBody`` for a route that reads ``model`` as JSON or msgpack itself."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    content = {JSON: {"schema": ref}, MSGPACK: {"schema": ref}}
    return {"requestBody": {"required": True, "content": content}}


def engine_of(request: Request) -> EngineAPI:
    engine: EngineAPI | None = getattr(request.app.state, "engine", None)
    if engine is None:
        raise NotReady("the model is loading")
    return engine


def namespace_of(request: Request) -> str:
    """The caller's key namespace: set by auth when enabled, else the header or the default."""
    ns = getattr(request.state, "namespace", None)
    if ns is not None:
        return str(ns)
    ns = request.headers.get("x-visenc-namespace")
    if ns is None:  # present but empty is malformed, not the default
        ns = request.app.state.settings.namespace
    if not is_valid_namespace(ns):
        raise BadRequest(f"X-Visenc-Namespace must be {NAMESPACE_RULE}")
    return ns


def lease_mode(request: Request) -> LeaseMode:
    """How the caller's ready answers are kept for it (``X-Visenc-Lease``: ``id`` or ``none``; absent: pins that
    name no lease, for callers from before leases)."""
    mode = request.headers.get(LEASE_HEADER)
    if mode is None:
        return "anonymous"
    if mode not in ("id", "none"):
        raise BadRequest(f"{LEASE_HEADER} must be 'id' or 'none'")
    return "id" if mode == "id" else "none"


def priority_of(request: Request, asked: Priority | None) -> Priority:
    """An encode's class: the body's ``priority``, else the ``X-Visenc-Priority`` header, else interactive."""
    if asked is not None:
        return asked
    header = request.headers.get(PRIORITY_HEADER, DEFAULT_PRIORITY)
    if header not in PRIORITIES:
        raise BadRequest(f"{PRIORITY_HEADER} must be one of {', '.join(PRIORITIES)}, got {header!r}")
    return "batch" if header == "batch" else "interactive"


def read_lease(request: Request, lease: str | None) -> str | None:
    """The lease a read names: its own; ``""`` where it names none but its caller hands leases back
    (``X-Visenc-Lease`` sent: it unpins no pin that names none, another caller's); ``None`` from a caller before
    leases."""
    if lease is None and request.headers.get(LEASE_HEADER) is not None:
        return ""
    return lease


def check_range(entry: Entry, start: int | None, end: int | None) -> tuple[int, int]:
    s = 0 if start is None else start
    e = entry.rows if end is None else end
    if not 0 <= s <= e <= entry.rows:
        raise BadRequest(f"range [{s}, {e}) is outside the image's {entry.rows} token rows")
    return s, e
