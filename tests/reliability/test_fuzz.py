"""Fuzzing a real ``visenc serve``: schemathesis against the OpenAPI document, hypothesis-made msgpack.

Both hold the service to: no 5xx, every answer as documented (status, media
type, headers, body schema), and the service still ready afterwards.
Examples are bounded so the module stays within about a minute.
"""

from __future__ import annotations

from typing import Any

import httpx
import msgpack
import pytest
import schemathesis
from harness.images import png_bytes
from harness.processes import serve_process
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from tests.support.api import b64

MSGPACK_TYPES = ("application/msgpack",)


def _wire_ints(value: Any) -> Any:
    """msgpack integers are at most 64-bit: clamp larger generated ones (still out of the schema)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return min(max(value, -(2**63)), 2**64 - 1)
    if isinstance(value, list):
        return [_wire_ints(v) for v in value]
    if isinstance(value, dict):
        return {k: _wire_ints(v) for k, v in value.items()}
    return value


@schemathesis.serializer(*MSGPACK_TYPES)
def _to_msgpack(ctx: Any, value: Any) -> bytes:
    return msgpack.packb(_wire_ints(value))


def _bytes_as_base64(value: Any) -> Any:
    """msgpack ``bin`` is the JSON body's base64 string: compare both against the one schema."""
    if isinstance(value, bytes):
        return b64(value)
    if isinstance(value, list):
        return [_bytes_as_base64(v) for v in value]
    if isinstance(value, dict):
        return {k: _bytes_as_base64(v) for k, v in value.items()}
    return value


@schemathesis.deserializer(*MSGPACK_TYPES)
def _from_msgpack(ctx: Any, response: Any) -> Any:
    return _bytes_as_base64(msgpack.unpackb(response.content, raw=False))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("fuzz") / "serve.log"
    # small limits, so that the fuzzer reaches them; a short deadline, so no example waits long
    with serve_process(
        "--max-wait-ms",
        "1",
        "--max-items",
        "8",
        "--max-body-bytes",
        "65536",
        "--request-timeout-s",
        "5",
        "--fetch-timeout-s",
        "2",
        "--preprocess-workers",
        "1",
        log=log,
    ) as url:
        # one stored image: the server has state to answer from (not only misses)
        r = httpx.post(f"{url}/v1/encode", json={"items": [{"data": b64(png_bytes(7, 64, 64))}]}, timeout=30)
        assert r.status_code == 200, r.text
        yield url
        # after the module's fuzz tests, whichever of them ran and in whatever order
        assert httpx.get(f"{url}/readyz", timeout=10).status_code == 200, "fuzzing left the service unready"
    assert "Traceback" not in log.read_text(), "the server logged an unhandled error"


@pytest.fixture(scope="module")
def api_schema(server):
    schema = schemathesis.openapi.from_url(f"{server}/openapi.json")
    # 413 is a rejection too (a limit named in the body), besides schemathesis' defaults
    schema.config.checks.negative_data_rejection.expected_statuses = ["400", "401", "404", "413", "415", "422"]
    return schema


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
OPERATIONS = [
    "POST /v1/encode",
    "GET /v1/embeddings/{image_hash}",
    "POST /v1/embeddings/fetch",
    "POST /v1/embeddings/shm",
    "GET /v1/model/layout",
    "GET /v1/model",
    "GET /healthz",
    "GET /readyz",
    "GET /metrics",
]


# schemathesis' own pytest plugin (``from_fixture``/``parametrize``) does not run on this pytest
# version, so each operation's strategy is driven by hypothesis directly: the same generation and checks
WITH_INPUT = OPERATIONS[:5]  # the others take no parameters or body: nothing to make invalid


@pytest.mark.parametrize(
    ("label", "mode"),
    [(op, GenerationMode.POSITIVE) for op in OPERATIONS] + [(op, GenerationMode.NEGATIVE) for op in WITH_INPUT],
)
def test_openapi_conformance(api_schema, label, mode):
    operations = {op.ok().label: op.ok() for op in api_schema.get_all_operations()}
    assert set(operations) == set(OPERATIONS), "an endpoint is missing from the OpenAPI document"
    checks = [*CHECKS, negative_data_rejection] if mode is GenerationMode.NEGATIVE else CHECKS

    @given(case=operations[label].as_strategy(generation_mode=mode))
    @settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
    def run(case):
        case.call_and_validate(checks=checks)

    run()


def _msgpack_values() -> st.SearchStrategy[Any]:
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**64 - 1),
        st.floats(),
        st.text(max_size=80),
        st.binary(max_size=300),
        st.sampled_from(["items", "data", "hash", "wait", "ranges", "start", "end", "0" * 64]),
    )
    return st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=6),
            st.dictionaries(
                st.one_of(st.text(max_size=10), st.sampled_from(["items", "data", "hash", "ranges"])), inner, max_size=5
            ),
        ),
        max_leaves=30,
    )


@given(
    value=_msgpack_values(),
    raw=st.binary(max_size=64),
    use_raw=st.booleans(),
    path=st.sampled_from(["/v1/encode", "/v1/embeddings/fetch"]),
)
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
def test_arbitrary_msgpack_never_5xx(server, value, raw, use_raw, path):
    body = raw if use_raw else msgpack.packb(value)
    r = httpx.post(
        f"{server}{path}",
        content=body,
        timeout=30,
        headers={"content-type": "application/msgpack", "accept": "application/msgpack"},
    )
    assert r.status_code < 500, (r.status_code, r.text)
    if r.status_code >= 400:
        assert r.json()["error"]["message"]
