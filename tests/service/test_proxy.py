"""``visenc proxy``: image parts get their visenc hash as uuid and are encoded hash-first, requests are
forwarded (streams as streams) to the upstream that saw their images, bad requests get OpenAI-style errors.

Upstreams are httpx mock transports that record what reaches them; visenc is the real app in-process."""

from __future__ import annotations

import base64
import json

import httpx
import pytest
from tests.conftest import running_app
from tests.images import jpeg_bytes, png_bytes

from visenc.proxy import Proxy, ProxySettings, create_proxy_app
from visenc_client.format import image_hash, video_hash

UPSTREAMS = ["http://vllm-a", "http://vllm-b"]


class Upstream:
    """Records each request per upstream; answers JSON, or SSE chunks when asked to stream."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict]] = []
        self.down: set[str] = set()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}"
        if base in self.down:
            raise httpx.ConnectError("down", request=request)
        if request.url.path == "/health":
            return httpx.Response(200)
        body = json.loads(request.content) if request.content else {}
        self.seen.append((base, body))
        if body.get("stream"):

            async def chunks():  # an upstream that streams its answer
                for chunk in [b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b"data: [DONE]\n\n"]:
                    yield chunk

            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=chunks())
        return httpx.Response(200, json={"upstream": base, "ok": True})


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
async def proxied(tiny_tower):
    upstream = Upstream()
    async with running_app(tiny_tower) as visenc:
        settings = ProxySettings(upstreams=UPSTREAMS, visenc_url="http://visenc", health_interval_s=3600)
        proxy = Proxy(
            settings, transport=httpx.MockTransport(upstream), visenc_transport=httpx.ASGITransport(app=visenc.app)
        )  # type: ignore[attr-defined]
        app = create_proxy_app(proxy)
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
                client.proxy = proxy  # type: ignore[attr-defined]
                yield client, upstream, visenc


async def test_image_parts_get_their_hash_as_uuid_and_are_encoded(proxied):
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


async def test_requests_go_to_the_upstream_that_saw_their_images(proxied):
    client, upstream, _ = proxied
    a, b = png_bytes(903, 64, 64), png_bytes(904, 64, 64)
    first = (await client.post("/v1/chat/completions", json=chat(a))).json()["upstream"]
    other = (await client.post("/v1/chat/completions", json=chat(b))).json()["upstream"]
    assert first != other  # round robin for images nobody saw
    for _ in range(3):  # the earlier screenshot comes back with a new one: same replica
        assert (await client.post("/v1/chat/completions", json=chat(a, png_bytes(905, 64, 64)))).json()[
            "upstream"
        ] == first
    upstream.down.add(first)  # that replica fails: marked down, the next request goes elsewhere
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
async def test_bad_image_parts_get_openai_style_errors(proxied, url, words):
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


async def test_visenc_down_still_forwards_at_once(tiny_tower):
    """The request never waits for visenc: with visenc down it is forwarded with its uuids (the
    connector then finds no rows and vLLM encodes the images itself); the failure is counted."""
    upstream = Upstream()

    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("visenc is down", request=request)

    settings = ProxySettings(upstreams=UPSTREAMS[:1], visenc_url="http://visenc", health_interval_s=3600)
    proxy = Proxy(settings, transport=httpx.MockTransport(upstream), visenc_transport=httpx.MockTransport(down))
    app = create_proxy_app(proxy)
    data = png_bytes(906, 64, 64)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
            r = await client.post("/v1/chat/completions", json=chat(data))
    assert r.status_code == 200
    ((_, body),) = upstream.seen
    assert body["messages"][0]["content"][0]["uuid"] == image_hash(data)
    assert proxy.encode_failures == 1  # the lifespan's end waited for the background encode


async def test_background_encodes_are_bounded_never_queued(tiny_tower):
    """Past ``max_background_encodes`` a request's images are not handed to visenc (counted), and the
    request is answered as any other."""
    upstream = Upstream()
    calls: list[httpx.Request] = []

    def visenc(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return httpx.Response(503, json={"error": {"type": "not_ready", "message": "busy"}})

    settings = ProxySettings(
        upstreams=UPSTREAMS[:1], visenc_url="http://visenc", health_interval_s=3600, max_background_encodes=0
    )
    proxy = Proxy(settings, transport=httpx.MockTransport(upstream), visenc_transport=httpx.MockTransport(visenc))
    app = create_proxy_app(proxy)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
            r = await client.post("/v1/chat/completions", json=chat(png_bytes(907, 64, 64)))
    assert r.status_code == 200 and proxy.encodes_skipped == 1 and not calls


async def test_a_resent_image_is_handed_over_once_and_again_after_a_failure(tiny_tower):
    """An agent resends its screenshots every turn: the proxy tags them by the hash it remembers for
    their data: URL, and hands an image to visenc again only while visenc has not accepted it."""
    upstream = Upstream()
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
        settings = ProxySettings(upstreams=UPSTREAMS[:1], visenc_url="http://visenc", health_interval_s=3600)
        proxy = Proxy(settings, transport=httpx.MockTransport(upstream), visenc_transport=Visenc(visenc.app))
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


def test_the_url_memo_is_bounded_in_characters():
    memo = Proxy(ProxySettings(upstreams=UPSTREAMS[:1], visenc_url="http://visenc", memo_chars=110)).memo
    urls = ["data:image/png;base64," + c * 30 for c in "ABCD"]  # 52 characters each
    for i, url in enumerate(urls):
        memo.remember(url, f"h{i}")
    assert memo.chars <= 110
    assert [memo.hash_of(u) for u in urls] == [None, None, "h2", "h3"]
    assert memo.hash_of("data:image/png;base64," + "C" * 29 + "c") is None  # exact strings only


def jpeg_frames_url(frames: list[bytes]) -> str:
    return "data:video/jpeg;base64," + ",".join(base64.b64encode(f).decode() for f in frames)


async def test_jpeg_frame_videos_get_their_video_hash_and_are_encoded(tiny_tower):
    """A ``data:video/jpeg`` part (frames already sampled) gets its video hash as uuid, of the
    frames vLLM takes (the first ``video_num_frames``); visenc then holds the video. A video file
    part passes through untagged, and images beside videos keep their own hashes."""
    upstream = Upstream()
    frames = [jpeg_bytes(950 + i, 96, 64) for i in range(6)]
    image = png_bytes(960, 64, 64)
    async with running_app(tiny_tower) as visenc:
        settings = ProxySettings(
            upstreams=UPSTREAMS[:1], visenc_url="http://visenc", health_interval_s=3600, video_num_frames=4
        )
        proxy = Proxy(
            settings, transport=httpx.MockTransport(upstream), visenc_transport=httpx.ASGITransport(app=visenc.app)
        )
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
