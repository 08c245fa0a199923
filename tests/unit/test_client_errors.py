"""The client reads every error answer into its exceptions: ``Retry-After`` kept on 429 and 503,
and ``ProtocolError`` (never a raw ``KeyError`` or ``IndexError``) for a malformed rows body."""

from __future__ import annotations

import struct

import httpx
import msgpack
import pytest

from visenc_client import Client, OverloadedError, ProtocolError, UnavailableError
from visenc_client._protocol import parse_rows

H = "a" * 64


def answering(status: int, headers: dict[str, str]) -> Client:
    def handler(request: httpx.Request) -> httpx.Response:
        body = {"error": {"kind": "not_ready", "message": "the model is loading"}}
        return httpx.Response(status, json=body, headers=headers)

    return Client("http://visenc", transport=httpx.MockTransport(handler))


@pytest.mark.parametrize(("status", "error"), [(503, UnavailableError), (429, OverloadedError)])
@pytest.mark.parametrize(("header", "seconds"), [("7", 7.0), ("Wed, 21 Oct 2026 07:28:00 GMT", 1.0), (None, 1.0)])
def test_retry_after_is_kept(status, error, header, seconds):
    with answering(status, {} if header is None else {"Retry-After": header}) as client:
        with pytest.raises(error) as raised:
            client.lookup([H])
    assert raised.value.retry_after_s == seconds and raised.value.status_code == status


def frame(header: object, rows: bytes = b"") -> bytes:
    packed = msgpack.packb(header)
    return struct.pack("<I", len(packed)) + packed + rows


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\x05\x00",
        struct.pack("<I", 9999) + b"short",
        frame(["not", "a", "map"]),
        frame({"no": "items"}),
        frame({"items": [{"hash": H, "offset": 0}]}),  # no nbytes
        frame({"items": [{"hash": H, "offset": 0, "nbytes": 64}]}, b"\x00" * 16),  # past the body
        frame({"items": [{"hash": H, "offset": -8, "nbytes": 4}]}, b"\x00" * 16),
    ],
    ids=["empty", "short-length", "short-header", "list", "no-items", "no-nbytes", "past-the-end", "negative"],
)
def test_a_malformed_rows_body_is_a_protocol_error(body):
    with pytest.raises(ProtocolError):
        parse_rows(body)


def test_a_well_formed_rows_body_parses():
    ((item, rows),) = parse_rows(frame({"items": [{"hash": H, "offset": 4, "nbytes": 8}]}, bytes(range(16))))
    assert item["hash"] == H and bytes(rows) == bytes(range(4, 12))
