"""``Proxy``: the proxy's parts, built once from its settings and started and stopped together."""

from __future__ import annotations

import asyncio
import contextlib

import httpx

from visenc.proxy.affinity import Memo, Upstreams
from visenc.proxy.handover import Handover
from visenc.proxy.images import Images
from visenc.proxy.settings import ProxySettings
from visenc.proxy.upstream import Forwarder
from visenc_client import AsyncClient


class Proxy:
    def __init__(
        self,
        settings: ProxySettings,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        visenc_transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.settings = settings
        self.memo = Memo(settings.memo_chars, settings.affinity_size)
        self.upstreams = Upstreams(list(settings.upstream), settings.affinity_size)
        self.http = httpx.AsyncClient(timeout=settings.upstream_timeout_s, transport=transport)
        key = settings.visenc_api_key.get_secret_value() if settings.visenc_api_key else None
        self.visenc = AsyncClient(settings.visenc, api_key=key, transport=visenc_transport)
        self.images = Images(settings, self.memo, self.http)
        self.handover = Handover(settings, self.memo, self.visenc, self.images)
        self.forwarder = Forwarder(settings, self.upstreams)
        self._health: asyncio.Task[None] | None = None

    @property
    def encode_failures(self) -> int:
        return self.handover.encode_failures

    @property
    def encodes_skipped(self) -> int:
        return self.handover.encodes_skipped

    async def drain(self) -> None:
        await self.handover.drain()

    async def start(self) -> None:
        self._health = asyncio.get_running_loop().create_task(self.forwarder.watch_health(), name="proxy-health")

    async def close(self) -> None:
        if self._health is not None:
            self._health.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health
        await self.drain()
        await self.forwarder.close()
        await self.http.aclose()
        await self.visenc.aclose()
