"""``Client`` and ``AsyncClient``: the same operations, blocking or awaited.

Example::

    from visenc_client import Client

    with Client("http://127.0.0.1:8000") as vc:
        handles = vc.encode([open("a.png", "rb").read()])   # hash-first
        rows = vc.fetch(handles[0], start=0, end=64)         # numpy [64, hidden]

Both are pooled (one httpx client, keep-alive) and safe to share across
threads (``Client``) or tasks (``AsyncClient``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import httpx
import numpy as np

from visenc_client import _protocol as p
from visenc_client._exceptions import TransportError
from visenc_client._types import Handle, RowRange

T = TypeVar("T")
DEFAULT_TIMEOUT = httpx.Timeout(connect=5.0, read=300.0, write=60.0, pool=60.0)


class _Base:
    def __init__(self, namespace: str | None, api_key: str | None) -> None:
        self.headers: dict[str, str] = {}
        if namespace is not None:
            self.headers["x-visenc-namespace"] = namespace
        if api_key is not None:
            self.headers["authorization"] = f"Bearer {api_key}"


class Client(_Base):
    """Blocking client.

    ``encode(images, wait=True, hash_first=True)`` → handles;
    ``fetch(handle, start, end)`` → ``[rows, hidden]`` numpy view;
    ``fetch_many(ranges)`` → one array per range, one round trip."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, namespace: str | None = None,
                 api_key: str | None = None, timeout: httpx.Timeout | float = DEFAULT_TIMEOUT,
                 transport: httpx.BaseTransport | None = None) -> None:
        super().__init__(namespace, api_key)
        self._http = httpx.Client(base_url=base_url, timeout=timeout, transport=transport)

    def _drive(self, flow: p.Flow[T]) -> T:
        try:
            request = next(flow)
            while True:
                try:
                    response = self._http.send(request)
                except httpx.TransportError as e:
                    raise TransportError(str(e) or type(e).__name__) from e
                request = flow.send(response)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]

    def encode(self, images: Sequence[p.ImageInput], *, wait: bool = True, hash_first: bool = True) -> list[Handle]:
        return self._drive(p.encode_flow(self._http, images, wait=wait, hash_first=hash_first, headers=self.headers))

    def fetch(self, image: str | Handle, start: int | None = None, end: int | None = None) -> np.ndarray:
        return self._drive(p.fetch_flow(self._http, image, start, end, self.headers))

    def fetch_many(self, ranges: Sequence[RowRange], *, wait: bool = True) -> list[np.ndarray]:
        return self._drive(p.fetch_many_flow(self._http, ranges, wait=wait, headers=self.headers))

    def model(self) -> dict[str, Any]:
        return self._drive(p.simple_flow(self._http, "GET", "/v1/model", self.headers))  # type: ignore[no-any-return]

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_Base):
    """The awaitable twin of ``Client`` (same methods, same results)."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, namespace: str | None = None,
                 api_key: str | None = None, timeout: httpx.Timeout | float = DEFAULT_TIMEOUT,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        super().__init__(namespace, api_key)
        self._http = httpx.AsyncClient(base_url=base_url, timeout=timeout, transport=transport)

    async def _drive(self, flow: p.Flow[T]) -> T:
        try:
            request = next(flow)
            while True:
                try:
                    response = await self._http.send(request)
                except httpx.TransportError as e:
                    raise TransportError(str(e) or type(e).__name__) from e
                request = flow.send(response)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]

    async def encode(self, images: Sequence[p.ImageInput], *, wait: bool = True,
                     hash_first: bool = True) -> list[Handle]:
        return await self._drive(p.encode_flow(self._http, images, wait=wait, hash_first=hash_first,
                                               headers=self.headers))

    async def fetch(self, image: str | Handle, start: int | None = None, end: int | None = None) -> np.ndarray:
        return await self._drive(p.fetch_flow(self._http, image, start, end, self.headers))

    async def fetch_many(self, ranges: Sequence[RowRange], *, wait: bool = True) -> list[np.ndarray]:
        return await self._drive(p.fetch_many_flow(self._http, ranges, wait=wait, headers=self.headers))

    async def model(self) -> dict[str, Any]:
        return await self._drive(p.simple_flow(self._http, "GET", "/v1/model", self.headers))  # type: ignore[no-any-return]

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
