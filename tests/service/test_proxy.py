"""``visenc proxy``: image parts get their visenc hash as uuid and are encoded hash-first, requests are
forwarded (streams as streams) to the upstream that saw their images, bad requests get OpenAI-style errors.

Upstreams are httpx mock transports that record what reaches them; visenc is the real app in-process."""

from __future__ import annotations

import asyncio
import base64
import time

import httpx
import msgpack
import pytest
from harness.images import jpeg_bytes, png_bytes
from tests.support.api import running_app
from tests.support.upstream import Upstream

from visenc.proxy import Proxy, ProxySettings, create_proxy_app
from visenc_client.format import image_hash, video_hash


@pytest.fixture
async def upstream():
    async with Upstream() as up:
        yield up


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def chat(*images: bytes, stream: bool = False) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": data_url(d)}} for d in images]
    return {
        "model": "m",
        "stream": stream,
        "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "hi"}]}],
    }


@pytest.fixture
async def proxied(tiny_tower, upstream):
    async with running_app(tiny_tower) as visenc:
        settings = ProxySettings(upstream=upstream.urls, visenc="http://visenc", health_interval_s=3600)
        proxy = Proxy(settings, visenc_transport=httpx.ASGITransport(app=visenc.app))  # type: ignore[attr-defined]
        app = create_proxy_app(proxy)
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
                client.proxy = proxy  # type: ignore[attr-defined]
                yield client, upstream, visenc


async def test_image_parts_get_their_hash_as_uuid_and_are_encoded(proxied, upstream):
    client, upstream, visenc = proxied
    a, b = png_bytes(900, 64, 64), png_bytes(901, 96, 64)
    r = await client.post("/v1/chat/completions", json=chat(a, b))
    assert r.status_code == 200 and r.json()["ok"]
    ((_, body),) = upstream.seen
    parts = [p for p in body["messages"][0]["content"] if p["type"] == "image_url"]
    assert [p["uuid"] for p in parts] == [image_hash(a), image_hash(b)]
    assert parts[0]["image_url"]["url"] == data_url(a)  # the request is otherwise unchanged
    await client.proxy.drain()  # visenc gets the images once the answer is through
    r = await visenc.post("/v1/encode", json={"items": [{"hash": image_hash(a)}, {"hash": image_hash(b)}]})
    assert [it["status"] for it in r.json()["items"]] == ["ready", "ready"]  # encoded by the proxy's request


async def test_streams_pass_through(proxied):
    client, _, _ = proxied
    async with client.stream("POST", "/v1/chat/completions", json=chat(png_bytes(902, 64, 64), stream=True)) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        body = b"".join([c async for c in r.aiter_raw()])
    assert body.count(b"data: ") == 3 and body.endswith(b"[DONE]\n\n")


async def test_requests_go_to_the_upstream_that_saw_their_images(proxied, upstream):
    client, upstream, _ = proxied
    a, b = png_bytes(903, 64, 64), png_bytes(904, 64, 64)
    first = (await client.post("/v1/chat/completions", json=chat(a))).json()["upstream"]
    other = (await client.post("/v1/chat/completions", json=chat(b))).json()["upstream"]
    assert first != other  # round robin for images nobody saw
    for _ in range(3):  # the earlier screenshot comes back with a new one: same replica
        assert (await client.post("/v1/chat/completions", json=chat(a, png_bytes(905, 64, 64)))).json()[
            "upstream"
        ] == first
    await upstream.take_down(first)  # that replica fails: marked down, the next request goes elsewhere
    r = await client.post("/v1/chat/completions", json=chat(a))
    assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_error"
    assert (await client.post("/v1/chat/completions", json=chat(a))).json()["upstream"] == other


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("data:image/png;base64,%%%not-base64", "not valid base64"),
        ("https://example.invalid/cat.png", "not allowed"),
        ("file:///etc/passwd", "must be a data: URL"),
    ],
)
async def test_bad_image_parts_get_openai_style_errors(proxied, url, words, upstream):
    client, upstream, _ = proxied
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and words in error["message"]
    assert upstream.seen == []  # nothing was forwarded


async def test_malformed_bodies_get_openai_style_errors(proxied):
    client, _, _ = proxied
    assert (await client.post("/v1/chat/completions", content=b"{not json")).json()["error"]["type"] == (
        "invalid_request_error"
    )
    r = await client.post("/v1/chat/completions", json={"model": "m", "messages": "nope"})
    assert r.status_code == 400 and "'messages' must be a list" in r.json()["error"]["message"]


async def test_visenc_down_still_forwards_at_once(tiny_tower, upstream):
    """The request never waits for visenc: with visenc down it is forwarded with its uuids (the
    connector then finds no rows and vLLM encodes the images itself); the failure is counted."""

    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("visenc is down", request=request)

    settings = ProxySettings(upstream=upstream.urls[:1], visenc="http://visenc", health_interval_s=3600)
    proxy = Proxy(settings, visenc_transport=httpx.MockTransport(down))
    app = create_proxy_app(proxy)
    data = png_bytes(906, 64, 64)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
            r = await client.post("/v1/chat/completions", json=chat(data))
    assert r.status_code == 200
    ((_, body),) = upstream.seen
    assert body["messages"][0]["content"][0]["uuid"] == image_hash(data)
    assert body["ec_transfer_params"] == {"visenc_absent": [image_hash(data)]}  # vLLM encodes it at once
    assert proxy.encode_failures == 1  # the lifespan's end waited for the background encode


async def test_background_encodes_are_bounded_never_queued(tiny_tower, upstream):
    """Past ``max_background_encodes`` a request's images are not handed to visenc (counted), and the
    request is answered as any other."""
    calls: list[httpx.Request] = []

    def visenc(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return httpx.Response(503, json={"error": {"type": "not_ready", "message": "busy"}})

    settings = ProxySettings(
        upstream=upstream.urls[:1],
        visenc="http://visenc",
        health_interval_s=3600,
        max_background_encodes=0,
        absent_timeout_s=0,  # nor asked which images it lacks
    )
    proxy = Proxy(settings, visenc_transport=httpx.MockTransport(visenc))
    app = create_proxy_app(proxy)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
            r = await client.post("/v1/chat/completions", json=chat(png_bytes(907, 64, 64)))
    assert r.status_code == 200 and proxy.encodes_skipped == 1 and not calls


async def test_a_resent_image_is_handed_over_once_and_again_after_a_failure(tiny_tower, upstream):
    """An agent resends its screenshots every turn: the proxy tags them by the hash it remembers for
    their data: URL, and hands an image to visenc again only while visenc has not accepted it."""
    asked: list[tuple[int, set[str]]] = []  # (turn, hashes) of each hand-over request that reached visenc
    failing, turn_now = [True], [0]

    class Visenc(httpx.AsyncBaseTransport):  # the real app, refusing while ``failing``
        def __init__(self, app) -> None:
            self.inner = httpx.ASGITransport(app=app)

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            if failing[0]:
                return httpx.Response(503, json={"error": {"type": "not_ready", "message": "restarting"}})
            if request.url.path == "/v1/encode":
                asked.append(
                    (turn_now[0], {h for h in (image_hash(a), image_hash(b)) if h.encode() in request.content})
                )
            return await self.inner.handle_async_request(request)

    a, b = png_bytes(908, 64, 64), png_bytes(909, 64, 64)
    async with running_app(tiny_tower) as visenc:
        settings = ProxySettings(upstream=upstream.urls[:1], visenc="http://visenc", health_interval_s=3600)
        proxy = Proxy(settings, visenc_transport=Visenc(visenc.app))
        app = create_proxy_app(proxy)
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
                for turn, images in enumerate([(a,), (a, b), (a, b), (a, b)]):
                    failing[0], turn_now[0] = turn == 0, turn  # visenc refuses the first hand-over
                    assert (await client.post("/v1/chat/completions", json=chat(*images))).status_code == 200
                    await proxy.drain()
        r = await visenc.post("/v1/encode", json={"items": [{"hash": image_hash(a)}, {"hash": image_hash(b)}]})
        assert [it["status"] for it in r.json()["items"]] == ["ready", "ready"]
    uuids = [
        [p["uuid"] for p in body["messages"][0]["content"] if p["type"] == "image_url"] for _, body in upstream.seen
    ]
    assert uuids == [[image_hash(a)], *[[image_hash(a), image_hash(b)]] * 3]
    assert proxy.encode_failures == 1
    # the second turn hands over a (refused before) and b; the third and fourth nothing
    assert {t for t, _ in asked} == {1} and set().union(*(h for _, h in asked)) == {image_hash(a), image_hash(b)}


async def test_the_body_ends_with_the_images_visenc_lacks(tiny_tower, upstream):
    """The connector is told which images visenc lacks (it then does not look them up): visenc is
    asked, while the body goes out, about the images it did not accept from this proxy; the
    client's own ``ec_transfer_params`` are kept."""
    asked: list[list[str]] = []

    class Visenc(httpx.AsyncBaseTransport):  # the real app, recording the hash-only requests
        def __init__(self, app) -> None:
            self.inner = httpx.ASGITransport(app=app)

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            body = msgpack.unpackb(await request.aread())
            if all("data" not in it for it in body["items"]) and not body.get("wait", True):
                asked.append([it["hash"] for it in body["items"]])
            return await self.inner.handle_async_request(request)

    held, new, newer = png_bytes(910, 64, 64), png_bytes(911, 64, 64), png_bytes(912, 64, 64)
    async with running_app(tiny_tower) as visenc:
        await visenc.post("/v1/encode", json={"items": [{"data": base64.b64encode(held).decode()}]})
        settings = ProxySettings(upstream=upstream.urls[:1], visenc="http://visenc", health_interval_s=3600)
        proxy = Proxy(settings, visenc_transport=Visenc(visenc.app))
        app = create_proxy_app(proxy)
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
                first = {**chat(held, new, new), "ec_transfer_params": {"mine": 1, "visenc_absent": ["x"]}}
                assert (await client.post("/v1/chat/completions", json=first)).status_code == 200
                await proxy.drain()  # both handed over: visenc holds them
                assert (await client.post("/v1/chat/completions", json=chat(held, new, newer))).status_code == 200
                await proxy.drain()
    told = [body["ec_transfer_params"] for _, body in upstream.seen]
    assert told == [{"mine": 1, "visenc_absent": [image_hash(new)]}, {"visenc_absent": [image_hash(newer)]}]
    both = {image_hash(held), image_hash(new)}
    # each request: the look-up, then the hand-over's hash-first step; the second asks of its new image only
    assert [set(a) for a in asked] == [both, both, {image_hash(newer)}, {image_hash(newer)}]


async def test_a_slow_visenc_is_not_waited_for_which_images_it_lacks(tiny_tower, upstream):
    """visenc that does not answer within ``absent_timeout_s``: the new images count as lacking
    (vLLM encodes them at once), and visenc is not asked again for a while."""
    asked = []

    async def hang(request: httpx.Request) -> httpx.Response:
        asked.append(request)
        await asyncio.sleep(30)
        return httpx.Response(503)

    settings = ProxySettings(
        upstream=upstream.urls[:1], visenc="http://visenc", health_interval_s=3600, max_background_encodes=0
    )
    proxy = Proxy(settings, visenc_transport=httpx.MockTransport(hang))
    app = create_proxy_app(proxy)
    a, b = png_bytes(913, 64, 64), png_bytes(914, 64, 64)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
            t0 = time.monotonic()
            for images in [(a,), (a, b)]:
                assert (await client.post("/v1/chat/completions", json=chat(*images))).status_code == 200
            elapsed = time.monotonic() - t0
    told = [body["ec_transfer_params"]["visenc_absent"] for _, body in upstream.seen]
    assert told == [[image_hash(a)], [image_hash(a), image_hash(b)]]
    assert len(asked) == 1 and elapsed < 5  # the second request was not held up asking again


def test_the_url_memo_is_bounded_in_characters():
    memo = Proxy(ProxySettings(upstream=["http://vllm"], visenc="http://visenc", memo_chars=110)).memo
    urls = ["data:image/png;base64," + c * 30 for c in "ABCD"]  # 52 characters each
    for i, url in enumerate(urls):
        memo.remember(url, f"h{i}")
    assert memo.chars <= 110
    assert [memo.hash_of(u) for u in urls] == [None, None, "h2", "h3"]
    assert memo.hash_of("data:image/png;base64," + "C" * 29 + "c") is None  # exact strings only


def jpeg_frames_url(frames: list[bytes]) -> str:
    return "data:video/jpeg;base64," + ",".join(base64.b64encode(f).decode() for f in frames)


async def test_jpeg_frame_videos_get_their_video_hash_and_are_encoded(tiny_tower, upstream):
    """A ``data:video/jpeg`` part (frames already sampled) gets its video hash as uuid, of the
    frames vLLM takes (the first ``video_num_frames``); visenc then holds the video. A video file
    part passes through untagged, and images beside videos keep their own hashes."""
    frames = [jpeg_bytes(950 + i, 96, 64) for i in range(6)]
    image = png_bytes(960, 64, 64)
    async with running_app(tiny_tower) as visenc:
        settings = ProxySettings(
            upstream=upstream.urls[:1], visenc="http://visenc", health_interval_s=3600, video_num_frames=4
        )
        proxy = Proxy(settings, visenc_transport=httpx.ASGITransport(app=visenc.app))
        app = create_proxy_app(proxy)
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
                body = chat(image)
                body["messages"][0]["content"] += [
                    {"type": "video_url", "video_url": {"url": jpeg_frames_url(frames)}},
                    {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
                ]
                r = await client.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                await proxy.drain()
        ((_, sent),) = upstream.seen
        parts = sent["messages"][0]["content"]
        expected = video_hash([image_hash(f) for f in frames[:4]])
        assert [p.get("uuid") for p in parts if p["type"] != "text"] == [image_hash(image), expected, None]
        r = await visenc.post("/v1/encode", json={"items": [{"hash": expected}], "wait": False})
        (item,) = r.json()["items"]
        assert item["status"] in ("pending", "ready") and item["grid_thw"][0] == 2
        r = await visenc.get(f"/v1/embeddings/{expected}")  # waits while pending
        assert r.status_code == 200 and int(r.headers["x-visenc-total-rows"]) == item["num_tokens"]
