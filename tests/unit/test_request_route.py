"""``RequestRoute``: an endpoint that takes the request alone is called with it, no dependencies solved per
request; one with parameters keeps FastAPI's handler (and its validation); both stay documented."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.testclient import TestClient

from visenc.api import embeddings, encode, ops, sglang, shm
from visenc.api.deps import RequestRoute


def test_request_only_endpoints_are_called_directly_and_the_rest_through_fastapi():
    routes = [r for m in (encode, embeddings, ops, shm, sglang) for r in m.router.routes]
    assert routes and all(isinstance(r, RequestRoute) for r in routes)
    direct = {r.path for r in routes if r.get_route_handler() is r.endpoint}
    assert {"/v1/encode", "/v1/embeddings/fetch"} <= direct
    assert "/v1/embeddings/{image_hash}" not in direct  # start, end, lease: FastAPI parses them


def test_a_route_with_parameters_still_validates_them_and_both_kinds_are_documented():
    app = FastAPI()
    app.include_router(embeddings.router)
    app.include_router(encode.router)
    with TestClient(app) as client:
        assert client.get(f"/v1/embeddings/{'ab' * 32}", params={"start": -1}).status_code == 422
        paths = client.get("/openapi.json").json()["paths"]
    assert {"/v1/encode", "/v1/embeddings/fetch", "/v1/embeddings/{image_hash}"} <= set(paths)
