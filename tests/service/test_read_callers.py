"""Every read releases, and only readers pin, through the callers that exist: the client library (GET,
POST, chunks, shared memory with its re-reads and its fall-back over HTTP), 16 callers of one image at
once, two replicas, and look-ups that read nothing of a pending image (the connector's ``include_rows``,
a look-up by hash that does not wait). The real app in-process; ``tests/service/test_read_paths.py``
has one test per read path of the API itself.

After every read the image's pin count is 0 and its entry keeps its rank (new entries go in at the
evicted-first end: a read that moved one would show); the controls are a pin that stays until its
own caller reads, and a look-up by hash, which does move the entry."""

from __future__ import annotations

import asyncio
import base64
import threading
from collections.abc import AsyncIterator, Sequence

import httpx
import msgpack
import numpy as np
import pytest
from harness.images import png_bytes
from harness.waits import until
from tests.support.api import MSGPACK, running_app
from tests.support.faults import FaultyTower
from tests.support.l1 import L1
from tests.support.upstream import Upstream

from visenc.models.base import Prepared
from visenc.proxy import Proxy, ProxySettings, create_proxy_app
from visenc_client import AsyncClient, ImagePlacement, RowRange, VisencClientError
from visenc_client.format import LEASE_HEADER, image_hash

NONE = {LEASE_HEADER: "none"}


class Counted(httpx.AsyncBaseTransport):
    """The app behind an ASGI transport, counting the requests that reach it by path."""

    def __init__(self, app: object) -> None:
        self.inner = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
        self.paths: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        return await self.inner.handle_async_request(request)


@pytest.fixture
async def app(tiny_tower, tmp_path) -> AsyncIterator[tuple[httpx.AsyncClient, L1, Counted]]:
    async with running_app(tiny_tower, shm_dir=str(tmp_path)) as client:
        l1 = L1(client)
        transport = Counted(client.app)  # type: ignore[attr-defined]
        async with AsyncClient("http://visenc", transport=transport, shared_memory=False) as visenc:
            await visenc.encode([png_bytes(1, 64, 48), png_bytes(2, 64, 48)], pin=False)  # neighbours
        yield client, l1, transport


async def test_the_client_reads_by_get_post_and_chunks_and_hands_each_lease_back(app):
    _, l1, transport = app
    async with AsyncClient("http://visenc", transport=transport) as visenc:
        handles = await visenc.encode([png_bytes(10 + i, 80, 60) for i in range(3)])
        assert all(h.lease for h in handles) and [l1.pins(h.hash) for h in handles] == [1, 1, 1]
        ranks = [l1.rank(h.hash) for h in handles]
        by_get, by_post, by_chunks = handles
        await visenc.fetch(by_get)
        (rows,) = await visenc.fetch_many([RowRange.of(by_post)])
        assert rows.shape[0] == by_post.num_tokens
        half = by_chunks.num_tokens // 2
        await visenc.fetch_chunk([ImagePlacement.of(by_chunks, 0)], 0, half)
        assert l1.pins(by_chunks.hash) == 1  # a partial read renews
        await visenc.fetch_chunk([ImagePlacement.of(by_chunks, 0)], half, by_chunks.num_tokens)
    assert [l1.pins(h.hash) for h in handles] == [0, 0, 0]
    assert [l1.rank(h.hash) for h in handles] == ranks


async def test_shared_memory_releases_on_export_and_rereads_of_a_known_segment_pin_nothing(app):
    _, l1, transport = app
    async with AsyncClient("http://visenc", transport=transport, shared_memory=True) as visenc:
        (h,) = await visenc.encode([png_bytes(20, 80, 60)])
        rank = l1.rank(h.hash)
        first = np.array(await visenc.fetch(h))
        assert l1.pins(h.hash) == 0 and l1.rank(h.hash) == rank
        asked = len(transport.paths)
        for _ in range(3):  # the segment is known: read again with no request at all
            assert np.array_equal(await visenc.fetch(h), first)
        assert len(transport.paths) == asked
        assert l1.pins(h.hash) == 0 and l1.rank(h.hash) == rank
        # asked again by hash: the client reads it from the segment it knows, so nothing is pinned for it
        (looked,) = await visenc.lookup([h.hash])
        assert looked.status == "ready" and looked.lease is None and l1.pins(h.hash) == 0
        rank = l1.rank(h.hash)  # the look-up moved it
        asked = len(transport.paths)
        assert np.array_equal(await visenc.fetch(looked), first)
        assert len(transport.paths) == asked
        # encoded again (a new lease): its read reaches the service, which releases it
        (again,) = await visenc.encode([png_bytes(20, 80, 60)])
        assert again.lease and l1.pins(h.hash) == 1
        assert np.array_equal(await visenc.fetch(again), first)
        assert transport.paths[-1] == "/v1/embeddings/shm" and l1.pins(h.hash) == 0 and l1.rank(h.hash) == rank


async def test_a_full_shared_memory_budget_reads_over_http_and_releases_its_own_pin_once(app):
    client, l1, transport = app
    pool = client.app.state.shm  # type: ignore[attr-defined]
    pool.max_bytes = 1  # every range is answered 429: the client reads it over HTTP
    data = png_bytes(30, 80, 60)
    async with AsyncClient("http://visenc", transport=transport, shared_memory=True) as visenc:
        (h,) = await visenc.encode([data])
        other = await client.post("/v1/encode", json={"items": [{"hash": h.hash}]}, headers={LEASE_HEADER: "id"})
        (theirs,) = other.json()["items"]
        assert l1.pins(h.hash) == 2  # two callers, two leases
        rank = l1.rank(h.hash)  # the other caller's look-up moved it
        await visenc.fetch(h)
        assert visenc._segments is not None and visenc._segments.http_fallbacks == 1
        assert l1.pins(h.hash) == 1  # the 429 released nothing; the read over HTTP its own pin only
        await visenc.fetch(h)  # again over HTTP, naming a spent lease: the other caller's pin stays
        assert l1.pins(h.hash) == 1
    await client.get(f"/v1/embeddings/{h.hash}", params={"lease": theirs["lease"]})
    assert l1.pins(h.hash) == 0 and l1.rank(h.hash) == rank


async def test_16_callers_of_one_image_at_once_leave_no_pin(app):
    """Half hand leases back (the client library), half name none (callers from before leases): 16 at
    once for a new image (they join one encode), then 16 look-ups of it and, after another image
    was looked up, their 16 reads."""
    client, l1, transport = app
    data, other = png_bytes(40, 80, 60), png_bytes(41, 80, 60)
    async with AsyncClient("http://visenc", transport=transport) as visenc:

        async def encode(leased: bool) -> str | None:
            if leased:
                (h,) = await visenc.encode([data])
                return h.lease
            body = msgpack.packb({"items": [{"hash": image_hash(data), "data": data}]})
            r = await client.post("/v1/encode", content=body, headers=MSGPACK)
            assert msgpack.unpackb(r.content)["items"][0]["status"] == "ready"
            return None

        async def read(lease: str | None) -> None:
            params = {"lease": lease} if lease else {}
            assert (await client.get(f"/v1/embeddings/{image_hash(data)}", params=params)).status_code == 200

        async def callers() -> list[str | None]:
            return list(await asyncio.gather(*(encode(i % 2 == 1) for i in range(16))))

        await visenc.encode([other], pin=False)
        await asyncio.gather(*(read(lease) for lease in await callers()))
        assert l1.pins(image_hash(data)) == 0
        leases = await callers()  # held now: 16 look-ups, 16 pins
        assert l1.pins(image_hash(data)) == 16
        await visenc.lookup([image_hash(other)], pin=False)
        rank = l1.rank(image_hash(data))
        assert rank == l1.top - 1  # the other image's look-up came last
        await asyncio.gather(*(read(lease) for lease in leases))
    assert l1.pins(image_hash(data)) == 0 and l1.rank(image_hash(data)) == rank


async def test_the_proxy_pins_nothing(tiny_tower):
    """Its look-up of what visenc lacks and its hand-over read no rows: nothing is kept for them,
    whether visenc held an image (looked up) or not (handed over, encoded)."""
    held, new = png_bytes(70, 64, 64), png_bytes(71, 64, 64)
    parts = [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{base64.b64encode(d).decode()}"}}
        for d in (held, new)
    ]
    chat = {"model": "m", "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "hi"}]}]}
    async with Upstream(1) as upstream, running_app(tiny_tower) as visenc:
        l1 = L1(visenc)
        await visenc.post("/v1/encode", json={"items": [{"data": base64.b64encode(held).decode()}]}, headers=NONE)
        settings = ProxySettings(upstream=upstream.urls, visenc="http://visenc", health_interval_s=3600)
        proxy = Proxy(settings, visenc_transport=httpx.ASGITransport(app=visenc.app))  # type: ignore[attr-defined]
        app = create_proxy_app(proxy)
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
                for _ in range(2):
                    assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
                    await proxy.drain()
        await until(lambda: l1.rank(image_hash(new)) is not None, 30, "the handed-over image stored")
        assert l1.pins(image_hash(held)) == 0 and l1.pins(image_hash(new)) == 0
        assert len(upstream.seen) == 2


async def test_a_lease_from_one_replica_never_releases_a_pin_on_another(tiny_tower, tmp_path):
    data = png_bytes(50, 80, 60)
    async with running_app(tiny_tower) as a, running_app(tiny_tower) as b:
        async with (
            AsyncClient("http://a", transport=httpx.ASGITransport(app=a.app)) as at_a,  # type: ignore[attr-defined]
            AsyncClient("http://b", transport=httpx.ASGITransport(app=b.app)) as at_b,  # type: ignore[attr-defined]
        ):
            (from_a,) = await at_a.encode([data])
            (from_b,) = await at_b.encode([data])
            assert from_a.lease != from_b.lease
            on_b = L1(b, bimodal=False)
            await at_b.fetch(from_a)  # replica A's lease, read at B (a caller failing over): ignored there
            assert on_b.pins(from_b.hash) == 1
            await at_b.fetch(from_b)
            assert on_b.pins(from_b.hash) == 0
            assert L1(a, bimodal=False).pins(from_a.hash) == 1  # A's pin waits for A's read or its lease


class Gated(FaultyTower):
    """The tiny tower, whose forwards wait until ``gate`` opens: an image stays pending meanwhile."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.gate = threading.Event()

    def forward(self, batch: Sequence[Prepared]):
        assert self.gate.wait(60), "the gate never opened"
        return super().forward(batch)


async def test_look_ups_that_read_nothing_of_a_pending_image_pin_nothing(tiny_tower):
    """The proxy hands an image over (``wait=false``, no pin); while it is pending, the connector's
    look-up with rows inline and a look-up by hash that does not wait are told so. Once it is stored
    nobody holds a pin on it. The control: an upload that does not wait is pinned for its caller."""
    tower = Gated(tiny_tower)
    handed, uploaded = png_bytes(60, 80, 60), png_bytes(61, 80, 60)
    try:
        async with running_app(tower) as client:
            l1 = L1(client)
            async with AsyncClient("http://visenc", transport=httpx.ASGITransport(app=client.app)) as visenc:  # type: ignore[attr-defined]
                (h,) = await visenc.encode([handed], wait=False, pin=False)
                (inline,) = await visenc.lookup([h.hash], include_rows=True)
                (looked,) = await visenc.lookup([h.hash])
                (control,) = await visenc.encode([uploaded], wait=False)
                assert [x.status for x in (h, inline, looked, control)] == ["pending"] * 4
                assert inline.lease is None and looked.lease is None and control.lease
                tower.gate.set()
                await until(lambda: l1.rank(h.hash) is not None and l1.rank(control.hash) is not None, 30, "stored")
                assert l1.pins(h.hash) == 0
                assert l1.pins(control.hash) == 1
                await visenc.fetch(control)
                assert l1.pins(control.hash) == 0
    finally:
        tower.gate.set()


class Holding(FaultyTower):
    """The tiny tower, whose forwards of an image of ``tokens`` rows wait until ``gate`` opens."""

    def __init__(self, inner, tokens: int) -> None:
        super().__init__(inner)
        self.tokens = tokens
        self.gate = threading.Event()

    def forward(self, batch: Sequence[Prepared]):
        if any(p.layout.num_tokens == self.tokens for p in batch):
            assert self.gate.wait(60), "the gate never opened"
        return super().forward(batch)


@pytest.mark.parametrize("hash_first", [False, True])
async def test_a_request_that_fails_after_some_images_were_ready_leaves_no_pin(tiny_tower, hash_first):
    """A request answered ready for two images, one held already and one encoded meanwhile, whose
    third image is not encoded within its deadline (504): its caller reads none of them, so nothing
    is kept for it. Hash-first, the held image was answered ready by the look-up before the upload
    failed: the client hands that lease back. The control: while the request waits, both are pinned."""
    held, fresh, slow = png_bytes(80, 80, 60), png_bytes(81, 80, 60), png_bytes(82, 448, 448)
    tower = Holding(tiny_tower, tiny_tower.layout(448, 448).num_tokens)
    try:
        async with running_app(tower, request_timeout_s=3.0, max_batch_images=1) as client:
            l1 = L1(client)
            async with AsyncClient("http://visenc", transport=httpx.ASGITransport(app=client.app)) as visenc:  # type: ignore[attr-defined]
                await visenc.encode([held], pin=False)
                asked = asyncio.create_task(visenc.encode([held, fresh, slow], hash_first=hash_first))
                await until(lambda: l1.pins(image_hash(fresh)) == 1, 30, "the fresh image stored, pinned")
                assert l1.pins(image_hash(held)) == 1  # the control
                with pytest.raises(VisencClientError, match="not encoded within"):
                    await asked
                tower.gate.set()
            assert l1.pins(image_hash(held)) == 0 and l1.pins(image_hash(fresh)) == 0
    finally:
        tower.gate.set()


async def test_a_read_by_hash_from_the_client_library_leaves_an_older_callers_pin(app):
    """A caller from before leases is answered ready (a pin that names no lease); the client library,
    reading the same image by its hash alone, releases nothing of it: that pin goes with the older
    caller's own read."""
    client, l1, transport = app
    data = png_bytes(90, 80, 60)
    body = msgpack.packb({"items": [{"hash": image_hash(data), "data": data}]})
    assert (await client.post("/v1/encode", content=body, headers=MSGPACK)).status_code == 200
    assert l1.pins(image_hash(data)) == 1
    for shared_memory in (False, True):
        async with AsyncClient("http://visenc", transport=transport, shared_memory=shared_memory) as visenc:
            await visenc.fetch(image_hash(data))
            (rows,) = await visenc.fetch_many([RowRange(image_hash(data))])
            assert rows.shape[0] > 0
        assert l1.pins(image_hash(data)) == 1
    assert (await client.get(f"/v1/embeddings/{image_hash(data)}")).status_code == 200
    assert l1.pins(image_hash(data)) == 0
