"""A real ``visenc serve`` process on a free port, driven by the Python client."""

from __future__ import annotations

import asyncio
import sys

import httpx
import numpy as np
import pytest
from harness.images import jpeg_bytes, png_bytes
from harness.processes import serve_process
from tests.support.api import reference

from visenc_client import AsyncClient, Client, NotFoundError, RowRange, image_hash


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with serve_process("--max-wait-ms", "2", log=log) as url:
        yield url


def test_client_encode_fetch_matches_direct_forward(server, tiny_tower):
    images = [png_bytes(100, 96, 64), jpeg_bytes(101, 200, 120), png_bytes(102, 96, 64)]
    with Client(server) as vc:
        assert vc.model()["fingerprint"] == tiny_tower.fingerprint  # same weights in another process
        handles = vc.encode(images)
        assert [h.status for h in handles] == ["ready"] * 3
        assert [h.hash for h in handles] == [image_hash(d) for d in images]
        for h, data in zip(handles, images):
            rows = vc.fetch(h)
            assert rows.shape == (h.num_tokens, h.hidden_size)
            np.testing.assert_allclose(rows, reference(tiny_tower, data), atol=1e-5, rtol=0)
        # several ranges in one round trip equal slices of the whole
        whole = vc.fetch(handles[1])
        parts = vc.fetch_many(
            [RowRange(handles[1].hash, 0, 3), RowRange(handles[0].hash, 2, 5), RowRange(handles[1].hash, 3, None)]
        )
        np.testing.assert_array_equal(parts[0], whole[:3])
        np.testing.assert_array_equal(parts[2], whole[3:])
        # a second encode of the same images is a pure hash-only hit (no bytes sent), rows inline if asked
        again = vc.encode(images, include_rows=True)
        assert [h.status for h in again] == ["ready"] * 3
        for h in again:
            assert h.rows is not None
            np.testing.assert_array_equal(h.rows, vc.fetch(h))
        with pytest.raises(NotFoundError):
            vc.fetch("0" * 64)
        (bad,) = vc.encode([b"definitely not an image"])
        assert (
            bad.status == "error"
            and bad.reason == "invalid_image"
            and bad.hash == image_hash(b"definitely not an image")
        )
    metrics = httpx.get(f"{server}/metrics").text
    assert "visenc_encoded_images_total 3.0" in metrics


def test_async_client_requests_import_nothing(server):
    """A warm async client's requests make no import attempts: httpcore probes for sniffio at every
    lock it makes, and a failed import scans sys.path every time (the dependency avoids it)."""
    attempts: list[str] = []

    class Recorder:
        def find_spec(self, name, path=None, target=None):
            attempts.append(name)
            return None  # the next finder decides

    async def go(n: int) -> None:
        async with AsyncClient(server) as vc:
            await vc.encode([png_bytes(300, 64, 64)])  # warm: whatever loads lazily loads now
            sys.meta_path.insert(0, recorder)
            try:
                for _ in range(n):
                    handles = await asyncio.gather(*(vc.lookup([image_hash(png_bytes(300, 64, 64))]) for _ in range(4)))
                    assert [h.status for (h,) in handles] == ["ready"] * 4
            finally:
                sys.meta_path.remove(recorder)

    recorder = Recorder()
    asyncio.run(go(5))
    assert attempts == []


def test_async_client_wait_false_then_fetch(server, tiny_tower):
    images = [png_bytes(200 + i, 64 + 28 * i, 64) for i in range(4)]

    async def go():
        async with AsyncClient(server) as vc:
            handles = await vc.encode(images, wait=False)
            assert all(h.num_tokens for h in handles)
            return await asyncio.gather(*(vc.fetch(h) for h in handles))

    for rows, data in zip(asyncio.run(go()), images):
        np.testing.assert_allclose(rows, reference(tiny_tower, data), atol=1e-5, rtol=0)
