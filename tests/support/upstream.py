"""vLLM stand-ins for ``visenc proxy`` tests: loopback servers that record what reaches them."""

from __future__ import annotations

import json

from aiohttp import web
from aiohttp.test_utils import TestServer


class Upstream:
    """vLLM stand-ins on loopback ports (``urls``): each records the requests it gets and answers
    JSON, or SSE chunks when asked to stream; ``take_down`` stops one."""

    def __init__(self, n: int = 2) -> None:
        self.seen: list[tuple[str, dict]] = []
        self.servers: dict[str, TestServer] = {}
        self.n = n

    @property
    def urls(self) -> list[str]:
        return list(self.servers)

    async def __aenter__(self) -> Upstream:
        for _ in range(self.n):
            app = web.Application(client_max_size=1 << 30)
            app.router.add_route("*", "/{path:.*}", self.handle)
            server = TestServer(app, host="127.0.0.1")
            await server.start_server()
            self.servers[str(server.make_url("")).rstrip("/")] = server
        return self

    async def __aexit__(self, *exc: object) -> None:
        for server in self.servers.values():
            await server.close()

    async def take_down(self, url: str) -> None:
        await self.servers[url].close()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        base = f"http://{request.host}"
        if request.path == "/health":
            return web.Response(text="ok")
        raw = await request.read()
        body = json.loads(raw) if raw else {}
        self.seen.append((base, body))
        if not body.get("stream"):
            return web.json_response({"upstream": base, "ok": True})
        answer = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await answer.prepare(request)
        for chunk in [b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b"data: [DONE]\n\n"]:
            await answer.write(chunk)
        await answer.write_eof()
        return answer
