"""The client reads every error answer into its exceptions: ``Retry-After`` kept on 429 and 503,
and ``ProtocolError`` (never a raw ``KeyError`` or ``IndexError``) for a malformed rows body."""

from __future__ import annotations

import struct

import httpx
import msgpack
import pytest

from visenc_client import Client, OverloadedError, ProtocolError, RowRange, UnavailableError

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


def rows_item(offset: int = 0, nbytes: int = 8, shape: tuple[int, int] = (1, 2)) -> dict[str, object]:
    return {"hash": H, "offset": offset, "nbytes": nbytes, "shape": list(shape), "dtype": "float32"}


def fetched(body: bytes) -> list:
    """What ``fetch_many`` makes of a rows answer ``body`` (read as a stream, as every rows answer is)."""

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body, headers={"content-type": "application/x-visenc-rows"})

    with Client("http://visenc", transport=httpx.MockTransport(handler)) as client:
        return client.fetch_many([RowRange(H)])


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\x05\x00",
        struct.pack("<I", 9999) + b"short",
        frame(["not", "a", "map"]),
        frame({"no": "items"}),
        frame({"items": [{"hash": H, "offset": 0, "shape": [1, 2], "dtype": "float32"}]}),  # no nbytes
        frame({"items": [rows_item(nbytes=64)]}, b"\x00" * 16),  # past the body, and not [1, 2] float32
        frame({"items": [rows_item(nbytes=12)]}, b"\x00" * 12),  # nbytes is not rows x row bytes
        frame({"items": [rows_item(offset=-8)]}, b"\x00" * 16),
        frame({"items": [rows_item(offset=4)]}, b"\x00" * 12),  # rows not where the previous ones end
        frame({"items": [rows_item()]}, b"\x00" * 16),  # longer than its header says
        frame({"items": [rows_item()]}, b"\x00" * 4),  # shorter
        frame({"items": [{**rows_item(), "dtype": "int8"}]}, b"\x00" * 8),
    ],
    ids=[
        "empty",
        "short-length",
        "short-header",
        "list",
        "no-items",
        "no-nbytes",
        "past-the-end",
        "nbytes-not-rows",
        "negative",
        "gap",
        "too-long",
        "too-short",
        "dtype",
    ],
)
def test_a_malformed_rows_body_is_a_protocol_error(body):
    with pytest.raises(ProtocolError):
        fetched(body)


def test_a_well_formed_rows_body_parses():
    values = struct.pack("<2f", 1.5, -2.0)
    (rows,) = fetched(frame({"items": [rows_item()]}, values))
    assert rows.tolist() == [[1.5, -2.0]] and rows.flags.writeable and rows.flags.owndata
