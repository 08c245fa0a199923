"""Every limit answers a 4xx that names the limit and its value; bad input never a 5xx."""

from __future__ import annotations

import io
import struct
import zlib

import msgpack
import pytest
from harness.images import jpeg_bytes, png_bytes
from PIL import Image
from tests.support.api import MSGPACK, encode_json, running_app, sha

JSON = {"content-type": "application/json"}


@pytest.fixture
async def limited(tiny_tower):
    async with running_app(
        tiny_tower, max_body_bytes=16384, max_items=4, max_image_bytes=6000, max_image_pixels=100 * 100
    ) as client:
        yield client


async def assert_error(response, status: int, *words: str) -> None:
    assert response.status_code == status, response.text
    message = response.json()["error"]["message"]
    for w in words:
        assert w in message, (w, message)


async def assert_item_error(response, reason: str, *words: str, index: int = 0) -> None:
    """The request was answered (200) and item ``index`` carries the error: its reason code and words."""
    assert response.status_code == 200, response.text
    item = response.json()["items"][index]
    assert item["status"] == "error" and item["reason"] == reason, item
    for w in words:
        assert w in item["error"], (w, item["error"])


async def assert_healthy(client) -> None:
    assert (await client.get("/readyz")).status_code == 200
    ok = await encode_json(client, [{"data": png_bytes(99, 28, 28)}])
    assert ok.status_code == 200 and ok.json()["items"][0]["status"] == "ready"


def bomb_png(width: int, height: int) -> bytes:
    """A valid PNG header claiming ``width x height`` (its pixel data is a few bytes)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


async def test_body_limit_declared_length(limited):
    r = await limited.post("/v1/encode", content=b"x" * 20000, headers=JSON)
    await assert_error(r, 413, "max_body_bytes=16384")
    await assert_healthy(limited)


async def test_body_limit_chunked_body(limited):
    async def chunks():
        for _ in range(20):
            yield b"x" * 1000

    r = await limited.post("/v1/encode", content=chunks(), headers=JSON)
    assert "content-length" not in r.request.headers  # really sent without a declared length
    await assert_error(r, 413, "max_body_bytes=16384")
    await assert_healthy(limited)


@pytest.mark.parametrize("wire", ["json", "msgpack"])
async def test_items_limit(limited, wire):
    items = [{"hash": "0" * 64}] * 5
    if wire == "json":
        r = await encode_json(limited, items)
    else:
        r = await limited.post("/v1/encode", content=msgpack.packb({"items": items}), headers=MSGPACK)
    await assert_error(r, 413, "max_items=4")
    r = await limited.post("/v1/embeddings/fetch", json={"ranges": [{"hash": "0" * 64}] * 5})
    await assert_error(r, 413, "max_items=4")


async def test_value_flood_refused_before_it_is_built(limited):
    """Tiny bodies of many empty values are refused by count, not parsed into millions of objects."""
    r = await limited.post("/v1/encode", content=b'{"items":[' + b",".join([b"{}"] * 1000) + b"]}", headers=JSON)
    await assert_error(r, 413, "max_items=4")
    nested = msgpack.packb({"items": [[{}] * 4] * 4, "x": [[[]] * 4] * 4})
    r = await limited.post("/v1/encode", content=nested, headers=MSGPACK)
    await assert_error(r, 413, "max_items=4")


async def test_image_bytes_limit(limited):
    data = jpeg_bytes(1, 70, 70, quality=100)
    assert len(data) > 6000
    r = await encode_json(limited, [{"data": data}])
    await assert_item_error(r, "image_too_large", "max_image_bytes=6000")
    assert r.json()["items"][0]["hash"] == sha(data)


async def test_decoded_pixels_limit_from_header_alone(limited):
    bomb = bomb_png(20000, 20000)  # 400 Mpx claimed in 70 bytes
    assert len(bomb) < 200
    r = await encode_json(limited, [{"data": bomb}])
    await assert_item_error(r, "image_too_large", "max_image_pixels=10000")
    r = await encode_json(limited, [{"data": bomb_png(101, 100)}])  # just over
    await assert_item_error(r, "image_too_large", "101x100", "max_image_pixels=10000")
    await assert_healthy(limited)


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b"", "empty"),
        (b"GIF89a\x00\x00", "image"),
        (b"\x89PNG\r\n\x1a\n" + b"\0" * 40, "image"),
        (b"%PDF-1.4 not an image", "unsupported"),
    ],
)
async def test_unsupported_or_corrupt_images_are_item_errors(limited, data, words):
    r = await encode_json(limited, [{"data": data}])
    await assert_item_error(r, "invalid_image", words)
    await assert_healthy(limited)


async def test_truncated_image_body_is_an_item_error_not_a_5xx(limited):
    """A header that parses over pixel data that does not: found at decode, after admission, so it
    is that item's ``error`` (the request and the other items succeed); nothing is cached for it."""
    buf = io.BytesIO()
    Image.new("RGB", (56, 56), (10, 200, 30)).save(buf, format="PNG")
    truncated = buf.getvalue()[:-30]
    r = await encode_json(limited, [{"data": truncated}, {"data": png_bytes(3, 28, 28)}])
    assert r.status_code == 200
    bad, good = r.json()["items"]
    assert bad["status"] == "error" and bad["reason"] == "invalid_image" and "corrupt or truncated" in bad["error"]
    assert good["status"] == "ready"
    r = await encode_json(limited, [{"hash": sha(truncated)}])
    assert r.json()["items"][0]["status"] == "missing"
    await assert_healthy(limited)


@pytest.mark.parametrize(
    ("body", "headers", "status"),
    [
        (b"\xc1", MSGPACK, 400),  # never-used msgpack byte
        (b"\x92\x01", MSGPACK, 400),  # truncated array
        (msgpack.packb([1, 2]), MSGPACK, 422),  # not a map
        (msgpack.packb({"items": [{"data": "text, not bin"}]}), MSGPACK, 422),
        (msgpack.packb({"items": [{"hash": "0" * 64}], "wait": "yes"}), MSGPACK, 422),
        (msgpack.packb({"items": [{"hash": "0" * 64, "x": 1}]}), MSGPACK, 422),  # unknown field
        (msgpack.packb({1: 2}), MSGPACK, 400),  # non-string key
        (b'\xff\xfe{"items"', JSON, 422),  # not UTF-8
        (b'{"items": [{"hash": "' + b"0" * 64 + b'"}], "wait": 1}', JSON, 422),
        (b"[" * 5000 + b"]" * 5000, JSON, 422),  # deep nesting
        (b"<xml/>", {"content-type": "application/xml"}, 415),
        (b"{}", {"content-type": "multipart/form-data; boundary=x"}, 415),
    ],
)
async def test_malformed_bodies_4xx(limited, body, headers, status):
    r = await limited.post("/v1/encode", content=body, headers=headers)
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"]
    await assert_healthy(limited)


async def test_bad_namespace_header_400(limited):
    for ns in ["", "a" * 65, "a/b", "a b"]:
        r = await encode_json(limited, [{"hash": "0" * 64}], headers={"x-visenc-namespace": ns})
        assert r.status_code == 400, (ns, r.text)


async def test_range_bounds(limited):
    data = png_bytes(4, 56, 28)
    h = (await encode_json(limited, [{"data": data}])).json()["items"][0]["hash"]
    rows = int((await limited.get(f"/v1/embeddings/{h}")).headers["x-visenc-total-rows"])
    await assert_error(
        await limited.get(f"/v1/embeddings/{h}", params={"start": 0, "end": rows + 1}), 400, f"{rows} token rows"
    )
    await assert_error(await limited.get(f"/v1/embeddings/{h}", params={"start": 2, "end": 1}), 400, "[2, 1)")
    assert (await limited.get(f"/v1/embeddings/{h}", params={"end": 2**31})).status_code == 422
    assert (await limited.get(f"/v1/embeddings/{h}", params={"start": "x"})).status_code == 422
    r = await limited.post("/v1/embeddings/fetch", json={"ranges": [{"hash": h, "start": 0, "end": rows + 5}]})
    assert r.status_code == 200  # a bad range fails that range (status 400 in its header), not the others
    (hlen,) = struct.unpack_from("<I", r.content)
    (meta,) = msgpack.unpackb(r.content[4 : 4 + hlen])["items"]
    assert meta["status"] == 400 and f"{rows} token rows" in meta["error"]
    r = await limited.post("/v1/embeddings/fetch", json={"ranges": [{"hash": "not-a-hash"}]})
    assert r.status_code == 422
