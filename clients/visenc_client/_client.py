"""``Client`` and ``AsyncClient``: the same operations, blocking or awaited.

Example::

    from visenc_client import Client

    with Client("http://127.0.0.1:8000") as vc:
        handles = vc.encode([open("a.png", "rb").read()])   # hash-first
        rows = vc.fetch(handles[0], start=0, end=64)         # numpy [64, hidden]

``shared_memory=True`` reads rows from the service's segments (same host); ``"auto"`` asks the service.
"""

from __future__ import annotations

import asyncio
import contextlib
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, overload

import httpx
import numpy as np

from visenc_client._base import DEFAULT_TIMEOUT, ClientBase, SharedMemory, connecting, timeouts
from visenc_client._exceptions import TransportError, VisencClientError, describe
from visenc_client._http import AsyncChunkBody, Body, ChunkBody, async_resolving_transport, resolving_transport
from visenc_client._steps import READ, AnyFlow, Ask, Head, Read, ReadInto, Stream
from visenc_client._types import Handle, ImageInput, RowRange, Video
from visenc_client.chunks import ImagePlacement
from visenc_client.format import Priority

T = TypeVar("T")
#: a caller's preallocated buffer (numpy array or CPU torch tensor), returned filled
Out = TypeVar("Out")


class Client(ClientBase):
    """Blocking client. ``timeout``: seconds a read or write may take (or an ``httpx.Timeout``);
    ``connect_timeout``: seconds to connect (5 by default); ``priority``: the class of its encodes
    (``interactive``, the service's default, or ``batch``)."""

    _http: httpx.Client

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        *,
        namespace: str | None = None,
        api_key: str | None = None,
        timeout: httpx.Timeout | float = DEFAULT_TIMEOUT,
        connect_timeout: float | None = None,
        transport: httpx.BaseTransport | None = None,
        shared_memory: SharedMemory = False,
        priority: Priority | None = None,
    ) -> None:
        t = timeouts(timeout, connect_timeout)
        super().__init__(base_url, namespace, api_key, shared_memory, t, transport is not None, priority)
        self._http = httpx.Client(base_url=self.base_url, timeout=t, transport=transport or resolving_transport())

    def _open(self, request: Ask) -> tuple[Head, Body | ChunkBody]:
        if self._conns is not None:
            return self._conns.open(request)
        resp = self._http.send(self._request(request), stream=True)
        return Head(resp.status_code, resp.reason_phrase, resp.headers), ChunkBody(resp.iter_bytes(), resp.close)

    def _drive(self, flow: AnyFlow[T]) -> T:
        body: Body | ChunkBody | None = None
        url = ""
        try:
            step = next(flow)
            while True:
                try:
                    if isinstance(step, ReadInto):
                        reply: Any = body.readinto(step.view)  # type: ignore[union-attr]
                    elif step is READ:
                        reply = body.read()  # type: ignore[union-attr]
                    elif isinstance(step, Stream):
                        url = step.request.path
                        done, body = body, None
                        if done is not None:
                            done.close()
                        reply, body = self._open(step.request)
                    else:
                        url = step.path
                        reply = self._http.send(self._request(step))
                except httpx.TransportError as e:
                    raise TransportError(describe(e), self.base_url + url, connecting=connecting(e)) from e
                step = flow.send(reply)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        finally:
            flow.close()
            if body is not None:
                body.close()

    def encode(
        self,
        images: Sequence[ImageInput | Video],
        *,
        wait: bool = True,
        hash_first: bool = True,
        include_rows: bool = False,
        pin: bool = True,
    ) -> list[Handle]:
        """``pin``: the service keeps each image until this client reads it (false: it will not read here)."""
        return self._drive(self._encode_flow(images, wait, hash_first, include_rows, pin))

    def lookup(
        self, hashes: Sequence[str], *, wait: bool = False, include_rows: bool = False, pin: bool = True
    ) -> list[Handle]:
        """Where each image stands, by hash only (nothing is uploaded, nothing is encoded)."""
        return self._drive(self._lookup_flow(hashes, wait, include_rows, pin))

    def unpin(self, handles: Sequence[Handle]) -> None:
        """Unpin ready ``handles`` whose rows this client will not read; on failure the leases lapse."""
        with contextlib.suppress(VisencClientError):
            self._drive(self._unpin_flow(handles))

    def hand_back(self, handles: Sequence[Handle]) -> None:
        """Deprecated alias of ``unpin``."""
        warnings.warn("Client.hand_back is deprecated: use Client.unpin", DeprecationWarning, stacklevel=2)
        self.unpin(handles)

    def fetch(self, image: str | Handle, start: int | None = None, end: int | None = None) -> np.ndarray:
        return self._drive(self._fetch_flow(image, start, end))

    def fetch_many(self, ranges: Sequence[RowRange], *, wait: bool = True) -> list[np.ndarray]:
        return self._drive(self._fetch_many_flow(ranges, wait))

    @overload
    def fetch_chunk(
        self,
        placements: Sequence[ImagePlacement],
        start: int,
        end: int,
        *,
        out: None = None,
        dense: bool = False,
        wait: bool = True,
    ) -> np.ndarray: ...
    @overload
    def fetch_chunk(
        self,
        placements: Sequence[ImagePlacement],
        start: int,
        end: int,
        *,
        out: Out,
        dense: bool = False,
        wait: bool = True,
    ) -> Out: ...

    def fetch_chunk(
        self,
        placements: Sequence[ImagePlacement],
        start: int,
        end: int,
        *,
        out: Any = None,
        dense: bool = False,
        wait: bool = True,
    ) -> Any:
        """The rows prefill chunk ``[start, end)`` needs, in one round trip, into ``out`` (``None``: a new array)."""
        return self._drive(self._fetch_chunk_flow(placements, start, end, out, dense, wait))

    def model(self) -> dict[str, Any]:
        return self._drive(self._model_flow())

    def close(self) -> None:
        self._http.close()
        if self._conns is not None:
            self._conns.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(ClientBase):
    """The awaitable twin of ``Client`` (same methods, same options, same results and exceptions)."""

    _http: httpx.AsyncClient

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        *,
        namespace: str | None = None,
        api_key: str | None = None,
        timeout: httpx.Timeout | float = DEFAULT_TIMEOUT,
        connect_timeout: float | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        shared_memory: SharedMemory = False,
        priority: Priority | None = None,
    ) -> None:
        t = timeouts(timeout, connect_timeout)
        super().__init__(base_url, namespace, api_key, shared_memory, t, transport is not None, priority)
        self._http = httpx.AsyncClient(
            base_url=self.base_url, timeout=t, transport=transport or async_resolving_transport()
        )
        self._io: ThreadPoolExecutor | None = None

    async def _blocking(self, fn: Callable[..., T], *args: Any) -> T:
        if self._io is None:
            self._io = ThreadPoolExecutor(32, thread_name_prefix="visenc-client-io")
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    async def _open(self, request: Ask) -> tuple[Head, Body | AsyncChunkBody]:
        if self._conns is not None:
            return await self._blocking(self._conns.open, request)
        resp = await self._http.send(self._request(request), stream=True)
        head = Head(resp.status_code, resp.reason_phrase, resp.headers)
        return head, AsyncChunkBody(resp.aiter_bytes(), resp.aclose)

    async def _read(self, body: Body | AsyncChunkBody, step: ReadInto | Read) -> bytes | None:
        if isinstance(body, AsyncChunkBody):
            return await (body.readinto(step.view) if isinstance(step, ReadInto) else body.read())
        if isinstance(step, ReadInto):
            return await self._blocking(body.readinto, step.view)
        return await self._blocking(body.read)

    async def _drive(self, flow: AnyFlow[T]) -> T:
        body: Body | AsyncChunkBody | None = None
        url = ""
        try:
            step = next(flow)
            while True:
                try:
                    if isinstance(step, ReadInto | Read):
                        assert body is not None, "a flow read a body before it streamed a request"
                        reply: Any = await self._read(body, step)
                    elif isinstance(step, Stream):
                        url = step.request.path
                        done, body = body, None
                        await _close(done)
                        reply, body = await self._open(step.request)
                    else:
                        url = step.path
                        reply = await self._http.send(self._request(step))
                except httpx.TransportError as e:
                    raise TransportError(describe(e), self.base_url + url, connecting=connecting(e)) from e
                step = flow.send(reply)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        finally:
            flow.close()
            await _close(body)

    async def encode(
        self,
        images: Sequence[ImageInput | Video],
        *,
        wait: bool = True,
        hash_first: bool = True,
        include_rows: bool = False,
        pin: bool = True,
    ) -> list[Handle]:
        return await self._drive(self._encode_flow(images, wait, hash_first, include_rows, pin))

    async def lookup(
        self, hashes: Sequence[str], *, wait: bool = False, include_rows: bool = False, pin: bool = True
    ) -> list[Handle]:
        return await self._drive(self._lookup_flow(hashes, wait, include_rows, pin))

    async def unpin(self, handles: Sequence[Handle]) -> None:
        with contextlib.suppress(VisencClientError):
            await self._drive(self._unpin_flow(handles))

    async def hand_back(self, handles: Sequence[Handle]) -> None:
        """Deprecated alias of ``unpin``."""
        warnings.warn("AsyncClient.hand_back is deprecated: use AsyncClient.unpin", DeprecationWarning, stacklevel=2)
        await self.unpin(handles)

    async def fetch(self, image: str | Handle, start: int | None = None, end: int | None = None) -> np.ndarray:
        return await self._drive(self._fetch_flow(image, start, end))

    async def fetch_many(self, ranges: Sequence[RowRange], *, wait: bool = True) -> list[np.ndarray]:
        return await self._drive(self._fetch_many_flow(ranges, wait))

    @overload
    async def fetch_chunk(
        self,
        placements: Sequence[ImagePlacement],
        start: int,
        end: int,
        *,
        out: None = None,
        dense: bool = False,
        wait: bool = True,
    ) -> np.ndarray: ...
    @overload
    async def fetch_chunk(
        self,
        placements: Sequence[ImagePlacement],
        start: int,
        end: int,
        *,
        out: Out,
        dense: bool = False,
        wait: bool = True,
    ) -> Out: ...

    async def fetch_chunk(
        self,
        placements: Sequence[ImagePlacement],
        start: int,
        end: int,
        *,
        out: Any = None,
        dense: bool = False,
        wait: bool = True,
    ) -> Any:
        return await self._drive(self._fetch_chunk_flow(placements, start, end, out, dense, wait))

    async def model(self) -> dict[str, Any]:
        return await self._drive(self._model_flow())

    async def aclose(self) -> None:
        await self._http.aclose()
        if self._conns is not None:
            self._conns.close()
        if self._io is not None:
            self._io.shutdown(wait=False)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def _close(body: Body | AsyncChunkBody | None) -> None:
    if isinstance(body, Body):
        body.close()
    elif body is not None:
        await body.aclose()
