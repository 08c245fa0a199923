"""``unpin`` reads no rows at the end of each ready image it names (one request); ``hand_back``, its old name,
still does the same for one release, with a ``DeprecationWarning``."""

from __future__ import annotations

import httpx
import msgpack
import pytest

from visenc_client import AsyncClient, Client, Handle

H = "a" * 64
READY = Handle(H, "ready", num_tokens=16, hidden_size=8, dtype="float32", lease="L1")


def recorder() -> tuple[list[dict], httpx.MockTransport]:
    seen: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append({"path": request.url.path, **msgpack.unpackb(request.content)})
        return httpx.Response(200, content=b"")

    return seen, httpx.MockTransport(handler)


def unpinned_at_the_end(seen: list[dict]) -> bool:
    return seen == [
        {
            "path": "/v1/embeddings/fetch",
            "ranges": [{"hash": H, "start": 16, "end": 16, "lease": "L1"}],
            "wait": False,
        }
    ]


def test_unpin_reads_no_rows_at_the_end_of_the_image():
    seen, transport = recorder()
    with Client("http://visenc", transport=transport) as client:
        client.unpin([READY, Handle("b" * 64, "pending", lease="L2")])
    assert unpinned_at_the_end(seen)


def test_hand_back_is_a_deprecated_unpin():
    seen, transport = recorder()
    with Client("http://visenc", transport=transport) as client, pytest.warns(DeprecationWarning, match="unpin"):
        client.hand_back([READY])
    assert unpinned_at_the_end(seen)


async def test_the_async_twin_unpins_and_warns_the_same():
    seen, transport = recorder()
    async with AsyncClient("http://visenc", transport=transport) as client:
        await client.unpin([READY])
        with pytest.warns(DeprecationWarning, match="unpin"):
            await client.hand_back([READY])
    assert seen[:1] == seen[1:] and unpinned_at_the_end(seen[:1])
