"""An HTTP proxy that injects faults between a client (vLLM's connector) and a visenc service."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from collections import Counter

import aiohttp
import msgpack
from aiohttp import web
from harness.waits import free_port

MODES = ("pass", "503", "reset", "hang", "slow")


class FaultProxy:
    def __init__(self, upstream: str, *, delay_s: float = 5.0) -> None:
        self.upstream = upstream.rstrip("/")
        self.mode = "pass"
        self.delay_s = delay_s
        self.counts: Counter[str] = Counter()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="fault-proxy", daemon=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the fault proxy did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app, handle_signals=False)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as self._session:
            self._ready.set()
            await self._stop.wait()
        await runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        mode = self.mode if _asks_rows(request.path, body) else "pass"
        self.counts[mode] += 1
        if mode == "503":
            return web.json_response(
                {"error": {"type": "not_ready", "message": "injected fault"}}, status=503, headers={"Retry-After": "1"}
            )
        if mode == "reset":
            transport = request.transport
            if transport is not None:
                sock = transport.get_extra_info("socket")
                if sock is not None:  # SO_LINGER 0: close sends RST, as a crashed peer's kernel does
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                transport.abort()
            raise web.HTTPInternalServerError()  # never written: the connection is gone
        if mode == "hang":
            assert self._stop is not None
            await self._stop.wait()
            raise web.HTTPServiceUnavailable()
        if mode == "slow":
            await asyncio.sleep(self.delay_s)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        async with self._session.request(
            request.method, self.upstream + request.path_qs, data=body, headers=headers
        ) as upstream:
            payload = await upstream.read()
            keep = {k: v for k, v in upstream.headers.items() if k.lower() in ("content-type", "retry-after")}
            return web.Response(body=payload, status=upstream.status, headers=keep)


def _asks_rows(path: str, body: bytes) -> bool:
    if path.startswith("/v1/embeddings"):
        return True
    if path != "/v1/encode" or not body:
        return False
    try:
        payload = msgpack.unpackb(body)
    except (ValueError, msgpack.UnpackException):
        return False
    return isinstance(payload, dict) and bool(payload.get("include_rows"))
