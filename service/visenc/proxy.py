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

import aiohttp
import httpx
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from visenc.media import MediaError, base64_bytes, data_url_bytes, fetch, is_allowed_url
from visenc.proxy_memory import Memo, Upstreams
from visenc.proxy_settings import ProxyError, ProxySettings
from visenc_client import AsyncClient, Video, VisencClientError
from visenc_client.format import ABSENT_KEY, image_hash, video_hash

#: a video vLLM takes as frames already sampled: JPEG frames, base64, joined by commas
JPEG_FRAMES = "data:video/jpeg;base64,"
#: after visenc failed to say in time which images it lacks, new images count as lacking this long
QUIET_S = 1.0
#: what a failed upstream connection, request or answer raises (aiohttp, the socket, its timeout)
UPSTREAM_ERRORS = (aiohttp.ClientError, OSError, asyncio.TimeoutError)

log = logging.getLogger("visenc.proxy")


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
        transport: httpx.AsyncBaseTransport | None = None,  # image URL fetches
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
        self._quiet_until = 0.0  # visenc is not asked which images it lacks before then
        self._upstream_http: aiohttp.ClientSession | None = None

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

    def ask_absent(self, hashes: Sequence[str]) -> asyncio.Future[list[str]] | None:
        """Start asking visenc which of ``hashes`` it lacks, of those it did not accept from this
        proxy (``None``: nothing to ask). The answer is a list, never an error."""
        new = [h for h in dict.fromkeys(hashes) if not self.memo.handed(h)]
        if not new or self.settings.absent_timeout_s <= 0:
            return None
        return asyncio.ensure_future(self._absent(new))

    async def _absent(self, hashes: list[str]) -> list[str]:
        if asyncio.get_running_loop().time() < self._quiet_until:
            return hashes  # visenc failed to answer a moment ago: not asked again yet
        try:
            async with asyncio.timeout(self.settings.absent_timeout_s):
                handles = await self.visenc.lookup(hashes)
        except Exception as e:  # too slow or failed: the images count as lacking (a lost hit at most)
            self._quiet_until = asyncio.get_running_loop().time() + QUIET_S
            log.warning("visenc did not say which images it lacks (%s): they count as lacking", type(e).__name__)
            return hashes
        return [h.hash for h in handles if h.status == "missing"]

    # --- forwarding --------------------------------------------------------------------
    async def forward(
        self,
        request: Request,
        path: str,
        body: dict[str, Any] | None,
        hashes: Sequence[str],
        encode_after: Sequence[_Image] = (),
        absent: asyncio.Future[list[str]] | None = None,
    ) -> Response:
        """Send the request to an upstream and stream its answer back; ``encode_after``: images
        handed to visenc once the answer is through (``encode_later``); ``absent``: the images
        visenc lacks, awaited once the rest of the body is out and written at its end."""
        upstream = self.upstreams.choose(hashes)
        if upstream is None:
            raise ProxyError("no healthy upstream", 503, "service_unavailable")
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "accept")}
        method = request.method
        data: bytes | AsyncIterator[bytes] | None = None
        if body is not None:
            data = orjson.dumps(body) if absent is None else _ending_with_absent(body, absent)
            headers["content-type"] = "application/json"
        try:
            answer = await self.upstream_http().request(method, upstream + path, data=data, headers=headers)
        except UPSTREAM_ERRORS as e:
            self.upstreams.healthy[upstream] = False
            raise _upstream_failed(upstream, e) from e
        self.upstreams.saw(upstream, hashes)
        kind = answer.headers.get("content-type")
        out_headers = {} if kind is None else {"content-type": kind}
        if "text/event-stream" not in (kind or ""):  # one answer: relayed whole
            try:
                content = await answer.read()  # decoded: content-encoding is not relayed
            except UPSTREAM_ERRORS as e:
                raise _upstream_failed(upstream, e) from e
            finally:
                answer.release()
                self.encode_later(encode_after)
            return Response(content, answer.status, out_headers)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in answer.content.iter_any():
                    yield chunk
            finally:
                answer.release()
                self.encode_later(encode_after)

        return StreamingResponse(relay(), answer.status, out_headers)

    def upstream_http(self) -> aiohttp.ClientSession:
        """The session that forwards to the upstreams and checks their health: aiohttp, whose client
        halves the hop of a request with a body of several MB against httpx's (``bench/bench_proxy.py``)."""
        if self._upstream_http is None:
            timeout = aiohttp.ClientTimeout(total=self.settings.upstream_timeout_s)
            self._upstream_http = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))
        return self._upstream_http

    async def _watch_health(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.settings.health_interval_s)
        while True:
            for url in self.upstreams.urls:
                try:
                    async with self.upstream_http().get(url + "/health", timeout=timeout) as r:
                        self.upstreams.healthy[url] = r.status == 200
                except UPSTREAM_ERRORS:
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
        if self._upstream_http is not None:
            await self._upstream_http.close()
        await self.http.aclose()
        await self.visenc.aclose()


def _upstream_failed(upstream: str, e: BaseException) -> ProxyError:
    return ProxyError(f"upstream {upstream} failed: {type(e).__name__}", 502, "upstream_error")


async def _ending_with_absent(body: dict[str, Any], absent: asyncio.Future[list[str]]) -> AsyncIterator[bytes]:
    """A chat body (it has ``messages``) as JSON, its ``ec_transfer_params`` last: the rest goes out
    while visenc is asked which images it lacks, then those join the client's own params (an object
    or none: the caller asks only then)."""
    params = body.pop("ec_transfer_params", None) or {}
    yield orjson.dumps(body)[:-1]  # the object, still open
    yield b',"ec_transfer_params":' + orjson.dumps({**params, ABSENT_KEY: await absent}) + b"}"


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
        params = body.get("ec_transfer_params")  # the client's own, kept; not an object: vLLM refuses it
        absent = proxy.ask_absent(hashes) if params is None or isinstance(params, dict) else None
        return await proxy.forward(request, "/v1/chat/completions", body, hashes, encode_after=images, absent=absent)

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
