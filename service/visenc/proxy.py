"""``visenc proxy``: an OpenAI-compatible front for vLLM replicas that use visenc as their encoder.

For ``POST /v1/chat/completions`` it finds the image parts of the messages
(``data:`` URLs always; ``http(s)`` URLs only under an ``--allow-url-prefix``, with
size and time limits), hashes each image, adds the visenc hash as the part's
``uuid`` and forwards the request at once. vLLM's ``VisencConnector`` loads the
rows of every image visenc holds instead of running its vision tower, and vLLM
encodes the others itself (the uuid, a SHA-256 of the image bytes, is a sound
content identifier either way). Once the answer is through, the proxy sends visenc
a hash-first encode with ``wait=false`` (bytes only for images visenc lacks), in the
background: the request never waits for visenc, and visenc's encode of an image new
to it does not compete with the request that brought it; the next request with the
image, on any replica, finds its rows. ``--encode-first`` (``encode_first``) hands
the images to visenc before forwarding instead (with ``wait_for_encoding`` on the
connector, every image then comes from visenc).
A ``video_url`` part whose URL is a ``data:video/jpeg;base64,`` list of frames (vLLM's pre-sampled
video: the frames it takes are the first ``video_num_frames``, as vLLM's ``VideoMediaIO`` takes
them) gets its visenc video hash as ``uuid`` and is handed to visenc as a video the same way;
other video parts pass through untouched (vLLM encodes them itself).
``POST /v1/completions`` and ``GET /v1/models`` pass through.
Streaming responses are streamed through as they come.

**Upstream choice.** A request goes to the healthy upstream that last saw most of
its images (cache affinity: that replica's encoder cache may still hold them),
else round robin. Upstreams are health-checked (``GET /health``) in the
background and marked down on a connection error.

**Failures.** A malformed request gets an OpenAI-style error (``{"error": {"message",
"type", "param", "code"}}``, 400). visenc unreachable: the encodes fail (logged,
counted in ``encode_failures``) and vLLM encodes the images itself. At most
``max_background_encodes`` run at once; past that a request's images are not sent to
visenc (counted in ``encodes_skipped``), never waited for. No healthy upstream: 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from visenc.media import MediaError, base64_bytes, data_url_bytes, fetch, is_allowed_url
from visenc.proxy_memory import Memo, Upstreams
from visenc_client import AsyncClient, Video, VisencClientError
from visenc_client.format import image_hash, video_hash

#: a video vLLM takes as frames already sampled: JPEG frames, base64, joined by commas
JPEG_FRAMES = "data:video/jpeg;base64,"

log = logging.getLogger("visenc.proxy")


@dataclass
class ProxySettings:
    upstreams: Sequence[str]
    visenc_url: str
    visenc_api_key: str | None = None
    #: http(s) image URLs are fetched only under one of these prefixes (none: only data: URLs)
    allow_url_prefixes: Sequence[str] = ()
    max_image_bytes: int = 32 << 20
    fetch_timeout_s: float = 10.0
    upstream_timeout_s: float = 600.0
    health_interval_s: float = 2.0
    #: images remembered for cache affinity (hash -> the upstream that saw it last)
    affinity_size: int = 100_000
    #: background encodes (one per request) in flight at once; more are skipped, never queued
    max_background_encodes: int = 64
    #: data: URLs remembered with their image's hash, in characters (an image resent turn after turn
    #: is neither decoded nor hashed again; its hand-over to visenc, once accepted, is not repeated)
    memo_chars: int = 128 << 20
    #: hand a request's images to visenc before forwarding it (default: after its answer is through;
    #: with ``wait_for_encoding`` on the connector, every image of it then comes from visenc)
    encode_first: bool = False
    #: frames vLLM takes of a ``data:video/jpeg`` URL (its ``num_frames`` video media option; -1: all)
    video_num_frames: int = 32

    def __post_init__(self) -> None:
        if self.video_num_frames == 0 or self.video_num_frames < -1:
            raise ValueError("video_num_frames must be positive, or -1 (all frames)")


class ProxyError(Exception):
    """An OpenAI-style error answer."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.status, self.kind = message, status, kind

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": None, "code": self.status}}
        return JSONResponse(body, self.status)


@dataclass(slots=True)
class _Image:
    """One image part of a request: its visenc hash, and its bytes or, where the proxy knew the
    data: URL already and did not decode it again, the URL (decoded only if it is handed over)."""

    hash: str
    source: bytes | str | Video


class Proxy:
    def __init__(
        self,
        settings: ProxySettings,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        visenc_transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.settings = settings
        self.upstreams = Upstreams(list(settings.upstreams), settings.affinity_size)
        self.http = httpx.AsyncClient(timeout=settings.upstream_timeout_s, transport=transport)
        self.visenc = AsyncClient(settings.visenc_url, api_key=settings.visenc_api_key, transport=visenc_transport)
        self.encode_failures = 0
        self.encodes_skipped = 0
        self.memo = Memo(settings.memo_chars, settings.affinity_size)
        self._encodes: set[asyncio.Task[None]] = set()
        self._health: asyncio.Task[None] | None = None

    # --- images ----------------------------------------------------------------------
    def _data_url_bytes(self, url: str) -> bytes | None:
        """The image bytes of a ``data:`` URL (``None``: not a data: URL)."""
        try:
            return data_url_bytes(url, self.settings.max_image_bytes)
        except MediaError as e:
            raise ProxyError(str(e)) from e

    async def _image(self, url: str) -> _Image:
        """The part's image: a data: URL seen before by its remembered hash alone, others read
        (decoded, or fetched under an allowed prefix) and hashed."""
        known = self.memo.hash_of(url)
        if known is not None:
            return _Image(known, url)
        data = self._data_url_bytes(url)
        if data is not None:
            image = _Image(image_hash(data), data)
            self.memo.remember(url, image.hash)
            return image
        if url.startswith(("http://", "https://")):
            if not is_allowed_url(url, self.settings.allow_url_prefixes):
                raise ProxyError("image URLs are not allowed here (only data: URLs, or URLs under an allowed prefix)")
            try:  # never remembered: what a URL serves may change
                data = await fetch(
                    self.http, url, max_bytes=self.settings.max_image_bytes, timeout_s=self.settings.fetch_timeout_s
                )
            except MediaError as e:
                raise ProxyError(str(e)) from e
            return _Image(image_hash(data), data)
        raise ProxyError("an image_url must be a data: URL or an allowed http(s) URL")

    async def _media(self, kind: str, url: str) -> _Image:
        return self._video(url) if kind == "video_url" else await self._image(url)

    def _video(self, url: str) -> _Image:
        """A ``data:video/jpeg`` part: the frames vLLM takes of it (the first ``video_num_frames``)."""
        n = self.settings.video_num_frames
        texts = url[len(JPEG_FRAMES) :].split(",", n)[:n] if n > 0 else url[len(JPEG_FRAMES) :].split(",")
        try:
            frames = [
                base64_bytes(t, self.settings.max_image_bytes, "a video frame is not valid base64") for t in texts
            ]
        except MediaError as e:
            raise ProxyError(str(e)) from e
        return _Image(video_hash([image_hash(f) for f in frames]), Video(frames))

    def _image_parts(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise ProxyError("'messages' must be a list")
        parts = []
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):
                parts += [p for p in content if isinstance(p, dict) and p.get("type") in ("image_url", "video_url")]
        tagged = []
        for part in parts:
            kind = part["type"]
            media = part.get(kind)
            url = media.get("url") if isinstance(media, dict) else media
            if not isinstance(url, str):
                raise ProxyError(f"an {kind} part has no url")
            if kind == "video_url" and not url.startswith(JPEG_FRAMES):
                continue  # a video file: vLLM decodes and encodes it itself
            part["_url"] = url
            tagged.append(part)
        return tagged

    async def tag_images(self, body: dict[str, Any]) -> list[_Image]:
        """Give every image part its visenc hash as ``uuid``; the images, in order."""
        parts = self._image_parts(body)
        if not parts:
            return []
        images = await asyncio.gather(*(self._media(p["type"], p.pop("_url")) for p in parts))
        for part, image in zip(parts, images):
            part["uuid"] = image.hash  # the connector finds the rows under it
        return list(images)

    def encode_later(self, images: Sequence[_Image]) -> None:
        """Hand ``images`` to visenc in the background, but those it accepted from this proxy
        before (at most ``max_background_encodes`` hand-overs at once; past that they are skipped,
        never queued)."""
        images = [i for i in images if not self.memo.handed(i.hash)]
        if not images:
            return
        if len(self._encodes) >= self.settings.max_background_encodes:
            self.encodes_skipped += 1
            return
        task = asyncio.create_task(self.encode(images))
        self._encodes.add(task)
        task.add_done_callback(self._encodes.discard)

    async def drain(self) -> None:
        """Wait for the background encodes started so far (each is bounded by the visenc client's timeout)."""
        if self._encodes:
            await asyncio.wait(set(self._encodes))

    async def encode(self, images: Sequence[_Image]) -> None:
        """A hash-first encode of ``images`` (``wait=false``); a failure is logged and counted."""
        try:
            datas = [
                i.source if isinstance(i.source, bytes | Video) else self._data_url_bytes(i.source) for i in images
            ]
            await self.visenc.encode([d for d in datas if d is not None], wait=False)
        except VisencClientError as e:  # vLLM encodes the images itself
            self.encode_failures += 1
            log.warning("visenc encode of %d images failed (%s): vLLM encodes them", len(images), e)
        except Exception:
            self.encode_failures += 1
            log.exception("visenc encode of %d images failed", len(images))
        else:
            self.memo.hand([i.hash for i in images])

    # --- forwarding --------------------------------------------------------------------
    async def forward(
        self,
        request: Request,
        path: str,
        body: dict[str, Any] | None,
        hashes: Sequence[str],
        encode_after: Sequence[_Image] = (),
    ) -> Response:
        """Send the request to an upstream and stream its answer back; ``encode_after``: images
        handed to visenc once the answer is through (``encode_later``)."""
        upstream = self.upstreams.choose(hashes)
        if upstream is None:
            raise ProxyError("no healthy upstream", 503, "service_unavailable")
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "accept")}
        method = request.method
        try:
            content = None if body is None else orjson.dumps(body)
            if content is not None:
                headers["content-type"] = "application/json"
            outgoing = self.http.build_request(method, upstream + path, content=content, headers=headers)
            upstream_response = await self.http.send(outgoing, stream=True)
        except httpx.TransportError as e:
            self.upstreams.healthy[upstream] = False
            raise ProxyError(f"upstream {upstream} failed: {type(e).__name__}", 502, "upstream_error") from e
        self.upstreams.saw(upstream, hashes)
        out_headers = {k: v for k, v in upstream_response.headers.items() if k.lower() in ("content-type",)}

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream_response.aiter_bytes():  # decoded: content-encoding is not relayed
                    yield chunk
            finally:
                await upstream_response.aclose()
                self.encode_later(encode_after)

        return StreamingResponse(relay(), upstream_response.status_code, out_headers)

    async def _watch_health(self) -> None:
        while True:
            for url in self.upstreams.urls:
                try:
                    r = await self.http.get(url + "/health", timeout=self.settings.health_interval_s)
                    self.upstreams.healthy[url] = r.status_code == 200
                except httpx.HTTPError:
                    self.upstreams.healthy[url] = False
            await asyncio.sleep(self.settings.health_interval_s)

    async def start(self) -> None:
        self._health = asyncio.get_running_loop().create_task(self._watch_health(), name="visenc-proxy-health")

    async def close(self) -> None:
        if self._health is not None:
            self._health.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health
        await self.drain()
        await self.http.aclose()
        await self.visenc.aclose()


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError as e:
        raise ProxyError("the body is not valid JSON") from e
    if not isinstance(body, dict):
        raise ProxyError("the body must be a JSON object")
    return body


def create_proxy_app(proxy: Proxy) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await proxy.start()
        try:
            yield
        finally:
            await proxy.close()

    app = FastAPI(title="visenc proxy", lifespan=lifespan)
    app.state.proxy = proxy

    @app.exception_handler(ProxyError)
    async def _error(request: Request, exc: ProxyError) -> JSONResponse:
        return exc.response()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await _json_body(request)
        images = await proxy.tag_images(body)
        hashes = [i.hash for i in images]
        if proxy.settings.encode_first:
            await proxy.encode(images)
            images = []
        return await proxy.forward(request, "/v1/chat/completions", body, hashes, encode_after=images)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.forward(request, "/v1/completions", await _json_body(request), ())

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await proxy.forward(request, "/v1/models", None, ())

    @app.get("/health")
    async def health() -> JSONResponse:
        up = [u for u, ok in proxy.upstreams.healthy.items() if ok]
        return JSONResponse({"upstreams": proxy.upstreams.healthy}, 200 if up else 503)

    return app
