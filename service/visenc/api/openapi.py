"""The OpenAPI document, completed so that a fuzzer can hold the service to it."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from visenc.api.schemas import (
    EncodeRequest,
    EncodeResponse,
    ErrorResponse,
    FetchRequest,
    LayoutOut,
    ModelInfo,
    ReadyOut,
)
from visenc_client.format import JSON, MSGPACK, ROWS_MEDIA_TYPE

_REASONS = {
    400: "Bad input: malformed body, bad hash, bad range, corrupt or unsupported image, hash mismatch",
    401: "Missing or unknown API key",
    404: "Unknown image (never encoded, or evicted), or a transport that is switched off",
    413: "Over a limit (body bytes, items, image bytes, image pixels); the message names it",
    415: "Content-Type is not JSON or msgpack",
    422: "Body or parameters do not match the schema",
    429: "Encoder queue (or shared-memory budget) full: retry after Retry-After seconds",
    503: "Not ready: starting, shutting down, or the device worker is stalled",
    504: "Deadline exceeded (request_timeout_s / fetch_timeout_s)",
}
_RETRY_AFTER = {
    "Retry-After": {
        "description": "Seconds to wait before retrying.",
        "schema": {"type": "string", "pattern": "^[0-9]+$"},
    }
}
_ROW_HEADERS = {
    name: {"description": text, "required": True, "schema": {"type": "string"}}
    for name, text in [
        ("X-Visenc-Shape", "rows,hidden of the body"),
        ("X-Visenc-Dtype", "element dtype"),
        ("X-Visenc-Rows", "start-end token rows served"),
        ("X-Visenc-Total-Rows", "token rows of the whole image"),
        ("X-Visenc-Grid-Thw", "t,h,w patch grid"),
    ]
}
_NAMESPACE = {
    "name": "X-Visenc-Namespace",
    "in": "header",
    "required": False,
    "description": "Key namespace (tenant) when API keys are off; ignored when they are on.",
    "schema": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"},
}
_PRIORITY = {
    "name": "X-Visenc-Priority",
    "in": "header",
    "required": False,
    "description": "The encode's class when the body names none: interactive (default) goes before batch.",
    "schema": {"type": "string", "enum": ["interactive", "batch"]},
}
_HASH_PARAM = {"type": "string", "pattern": "^[0-9a-f]{64}$"}

#: path → (request body model, JSON/msgpack response model or None, error statuses)
_V1: dict[str, tuple[type[BaseModel] | None, type[BaseModel] | None, tuple[int, ...]]] = {
    "/v1/encode": (EncodeRequest, EncodeResponse, (400, 413, 415, 422, 429, 503, 504)),
    "/v1/embeddings/{image_hash}": (None, None, (400, 404, 422, 503, 504)),
    "/v1/embeddings/fetch": (FetchRequest, None, (400, 413, 415, 422, 503, 504)),
    "/v1/embeddings/shm": (FetchRequest, None, (400, 404, 413, 415, 422, 429, 503, 504)),
    "/v1/model": (None, ModelInfo, ()),
    "/v1/model/layout": (None, LayoutOut, (400, 422)),
}
_TIMING_HEADERS = {
    name: {"description": text, "required": True, "schema": {"type": "string", "pattern": r"^[0-9]+\.[0-9]+$"}}
    for name, text in [
        ("X-Visenc-Queue-Time", "seconds the images of this response waited in the queue"),
        ("X-Visenc-Encode-Time", "seconds their forwards took"),
    ]
}
_SHM_OUT = {
    "type": "object",
    "required": ["dir", "lease_s", "items"],
    "properties": {
        "dir": {"type": "string"},
        "lease_s": {"type": "number"},
        "items": {"type": "array", "items": {"type": "object", "required": ["hash"]}},
    },
}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _error(status: int) -> dict[str, Any]:
    out: dict[str, Any] = {"description": _REASONS[status], "content": {JSON: {"schema": _ref(ErrorResponse)}}}
    if status in (429, 503):
        out["headers"] = _RETRY_AFTER
    return out


def _both(model: type[BaseModel], description: str) -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": _ref(model)}, MSGPACK: {"schema": _ref(model)}}}


def _add_schemas(doc: dict[str, Any], *models: type[BaseModel]) -> None:
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for model in models:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema


def build_openapi(app: FastAPI, *, auth: bool, max_items: int) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    _add_schemas(doc, EncodeRequest, FetchRequest, EncodeResponse, ErrorResponse, ModelInfo, LayoutOut, ReadyOut)
    schemas = doc["components"]["schemas"]
    schemas["EncodeRequest"]["properties"]["items"]["maxItems"] = max_items  # the served limit
    schemas["FetchRequest"]["properties"]["ranges"]["maxItems"] = max_items
    doc["components"]["schemas"].pop("HTTPValidationError", None)  # our 422 body is ErrorResponse
    doc["components"]["schemas"].pop("ValidationError", None)
    for path, (body, out, errors) in _V1.items():
        for op in doc["paths"][path].values():
            params = [p for p in op.get("parameters", []) if p["name"] != _NAMESPACE["name"]]
            for p in params:
                if p["name"] == "image_hash":
                    p["schema"] = _HASH_PARAM
            op["parameters"] = [*params, _NAMESPACE]
            if body is not None:
                op["requestBody"] = {
                    "required": True,
                    "content": {JSON: {"schema": _ref(body)}, MSGPACK: {"schema": _ref(body)}},
                }
            responses = {"200": op["responses"]["200"]}
            if out is not None:
                responses["200"] = _both(out, responses["200"].get("description") or "OK")
            if path == "/v1/encode":
                responses["200"]["headers"] = _TIMING_HEADERS
                op["parameters"].append(_PRIORITY)
            if path == "/v1/embeddings/shm":
                responses["200"] = {
                    "description": "Shared-memory handles of the ranges",
                    "content": {JSON: {"schema": _SHM_OUT}, MSGPACK: {"schema": _SHM_OUT}},
                }
            if path == "/v1/embeddings/{image_hash}":
                responses["200"]["headers"] = _ROW_HEADERS
                responses["200"]["content"] = {
                    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
                }
            if path == "/v1/embeddings/fetch":
                responses["200"]["content"] = {ROWS_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}}
            for status in (*errors, *((401,) if auth else ())):
                responses[str(status)] = _error(status)
            op["responses"] = responses
            if auth:
                op["security"] = [{"bearer": []}]
    doc["paths"]["/readyz"]["get"]["responses"] = {"200": _both(ReadyOut, "Ready"), "503": _error(503)}
    doc["paths"]["/healthz"]["get"]["responses"]["200"]["content"] = {"text/plain": {"schema": {"type": "string"}}}
    if auth:
        doc["components"]["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer", "description": "An API key from api_keys."}
        }
    return doc


def install_openapi(app: FastAPI, *, auth: bool, max_items: int) -> None:
    """Serve the completed document at ``/openapi.json`` (built once, on first use)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app, auth=auth, max_items=max_items)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
