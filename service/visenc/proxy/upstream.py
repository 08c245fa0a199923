"""Forwarding to the vLLM upstreams with cache affinity, else round robin; streamed answers; health checks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import aiohttp
import orjson
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from visenc.proxy.affinity import Upstreams
from visenc.proxy.errors import ProxyError, upstream_failed
from visenc.proxy.settings import ProxySettings
from visenc_client.format import ABSENT_KEY

#: what a failed upstream connection, request or answer raises (aiohttp, the socket, its timeout)
UPSTREAM_ERRORS = (aiohttp.ClientError, OSError, asyncio.TimeoutError)


class Forwarder:
    def __init__(self, settings: ProxySettings, upstreams: Upstreams) -> None:
        self.settings, self.upstreams = settings, upstreams
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        """aiohttp's client (half httpx's hop for a body of several MB: ``bench/bench_proxy.py``)."""
        if self._session is None:
            timeout = aiohttp.ClientTimeout(total=self.settings.upstream_timeout_s)
            self._session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))
        return self._session

    async def forward(
        self,
        request: Request,
        path: str,
        body: dict[str, Any] | None,
        hashes: Sequence[str],
        *,
        then: Callable[[], None] = lambda: None,
        absent: asyncio.Future[list[str]] | None = None,
    ) -> Response:
        """Send the request to an upstream and stream its answer back; ``then`` runs once the answer is through."""
        upstream = self.upstreams.choose(hashes)
        if upstream is None:
            raise ProxyError("no healthy upstream", 503, "service_unavailable")
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "accept")}
        data: bytes | AsyncIterator[bytes] | None = None
        if body is not None:
            data = orjson.dumps(body) if absent is None else ending_with_absent(body, absent)
            headers["content-type"] = "application/json"
        try:
            answer = await self.session().request(request.method, upstream + path, data=data, headers=headers)
        except UPSTREAM_ERRORS as e:
            self.upstreams.healthy[upstream] = False
            raise upstream_failed(upstream, e) from e
        self.upstreams.saw(upstream, hashes)
        kind = answer.headers.get("content-type")
        out_headers = {} if kind is None else {"content-type": kind}
        if "text/event-stream" not in (kind or ""):  # one answer: relayed whole
            try:
                content = await answer.read()  # decoded: content-encoding is not relayed
            except UPSTREAM_ERRORS as e:
                raise upstream_failed(upstream, e) from e
            finally:
                answer.release()
                then()
            return Response(content, answer.status, out_headers)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in answer.content.iter_any():
                    yield chunk
            finally:
                answer.release()
                then()

        return StreamingResponse(relay(), answer.status, out_headers)

    async def watch_health(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.settings.health_interval_s)
        while True:
            for url in self.upstreams.urls:
                try:
                    async with self.session().get(url + "/health", timeout=timeout) as r:
                        self.upstreams.healthy[url] = r.status == 200
                except UPSTREAM_ERRORS:
                    self.upstreams.healthy[url] = False
            await asyncio.sleep(self.settings.health_interval_s)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


async def ending_with_absent(body: dict[str, Any], absent: asyncio.Future[list[str]]) -> AsyncIterator[bytes]:
    """A chat body as JSON, its ``ec_transfer_params`` last: they are written once visenc said which images it lacks."""
    params = body.pop("ec_transfer_params", None) or {}
    yield orjson.dumps(body)[:-1]  # the object, still open
    yield b',"ec_transfer_params":' + orjson.dumps({**params, ABSENT_KEY: await absent}) + b"}"
