"""``Client`` and ``AsyncClient``: the same operations, blocking or awaited.

Example::

    from visenc_client import Client

    with Client("http://127.0.0.1:8000") as vc:
        handles = vc.encode([open("a.png", "rb").read()])   # hash-first
        rows = vc.fetch(handles[0], start=0, end=64)         # numpy [64, hidden]

Both are pooled (one httpx client, keep-alive) and safe to share across
threads (``Client``) or tasks (``AsyncClient``).

``fetch_chunk(placements, start, end)`` fetches exactly the rows prefill chunk
``[start, end)`` needs (see ``visenc_client.chunks``) in one round trip, into
one buffer. With ``shared_memory=True`` (client and service on one host, the
service started with ``--shm-enabled true``) rows come from shared-memory
segments instead of HTTP bodies: ``fetch`` / ``fetch_many`` return read-only
views of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar, overload

import httpx
import numpy as np

from visenc_client import _protocol as p
from visenc_client._exceptions import TransportError
from visenc_client._rows import fetch_chunk_flow, shm_fetch_flow
from visenc_client._shm import SegmentHandles
from visenc_client._types import Handle, RowRange, Video
from visenc_client.chunks import ImagePlacement, plan_chunk

T = TypeVar("T")
#: a caller's preallocated buffer (numpy array or CPU torch tensor), handed back filled
Out = TypeVar("Out")
DEFAULT_TIMEOUT = httpx.Timeout(connect=5.0, read=300.0, write=60.0, pool=60.0)


class _Base:
    def __init__(self, namespace: str | None, api_key: str | None, shared_memory: bool) -> None:
        self.shared_memory = shared_memory
        #: where images' rows sit in the service's segments (reads them again with no request)
        self._segments = SegmentHandles() if shared_memory else None
        self.headers: dict[str, str] = {}
        if namespace is not None:
            self.headers["x-visenc-namespace"] = namespace
        if api_key is not None:
            self.headers["authorization"] = f"Bearer {api_key}"


class Client(_Base):
    """Blocking client.

    ``encode(images, wait=True, hash_first=True)`` → handles;
    ``fetch(handle, start, end)`` → ``[rows, hidden]`` numpy view;
    ``fetch_many(ranges)`` → one array per range, one round trip;
    ``fetch_chunk(placements, start, end, out=None)`` → the chunk's rows in one buffer."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        *,
        namespace: str | None = None,
        api_key: str | None = None,
        timeout: httpx.Timeout | float = DEFAULT_TIMEOUT,
        transport: httpx.BaseTransport | None = None,
        shared_memory: bool = False,
    ) -> None:
        super().__init__(namespace, api_key, shared_memory)
        self._http = httpx.Client(base_url=base_url, timeout=timeout, transport=transport)

    def _drive(self, flow: p.AnyFlow[T]) -> T:
        streamed: httpx.Response | None = None
        chunks: Any = None
        try:
            step = next(flow)
            while True:
                try:
                    if step is p.READ:
                        reply: Any = next(chunks, b"")
                    elif isinstance(step, p.Stream):
                        if streamed is not None:
                            streamed.close()
                        reply = streamed = self._http.send(step.request, stream=True)
                        chunks = streamed.iter_bytes()
                    else:
                        reply = self._http.send(step)
                except httpx.TransportError as e:
                    raise TransportError(str(e) or type(e).__name__) from e
                step = flow.send(reply)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        finally:
            flow.close()
            if streamed is not None:
                streamed.close()

    def encode(
        self,
        images: Sequence[p.ImageInput | Video],
        *,
        wait: bool = True,
        hash_first: bool = True,
        include_rows: bool = False,
    ) -> list[Handle]:
        return self._drive(
            p.encode_flow(
                self._http, images, wait=wait, hash_first=hash_first, headers=self.headers, include_rows=include_rows
            )
        )

    def lookup(self, hashes: Sequence[str], *, wait: bool = False, include_rows: bool = False) -> list[Handle]:
        """Where each image stands, by hash only (nothing is uploaded, nothing is encoded).
        ``wait``: pending images are waited for; ``include_rows``: ready ones carry their rows."""
        return self._drive(p.lookup_flow(self._http, hashes, self.headers, wait=wait, include_rows=include_rows))

    def fetch(self, image: str | Handle, start: int | None = None, end: int | None = None) -> np.ndarray:
        if self.shared_memory:
            return self.fetch_many([RowRange(image.hash if isinstance(image, Handle) else image, start, end)])[0]
        return self._drive(p.fetch_flow(self._http, image, start, end, self.headers))

    def fetch_many(self, ranges: Sequence[RowRange], *, wait: bool = True) -> list[np.ndarray]:
        if self._segments is not None:
            flow = shm_fetch_flow(self._http, ranges, wait=wait, headers=self.headers, known=self._segments)
            return self._drive(flow)
        return self._drive(p.fetch_many_flow(self._http, ranges, wait=wait, headers=self.headers))

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
        """The rows prefill chunk ``[start, end)`` needs, in one round trip, into one buffer.

        ``out``: a preallocated ``[rows, hidden]`` numpy array or CPU torch tensor
        (``rows`` from ``plan_chunk``), filled and returned; ``None`` allocates one.
        Images wholly outside the chunk are not fetched; pending ones are waited
        for (and moved to the front of the service's queue)."""
        plan = plan_chunk(placements, start, end, dense=dense)
        return self._drive(fetch_chunk_flow(self._http, plan, out, wait=wait, shm=self._segments, headers=self.headers))

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

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        *,
        namespace: str | None = None,
        api_key: str | None = None,
        timeout: httpx.Timeout | float = DEFAULT_TIMEOUT,
        transport: httpx.AsyncBaseTransport | None = None,
        shared_memory: bool = False,
    ) -> None:
        super().__init__(namespace, api_key, shared_memory)
        self._http = httpx.AsyncClient(base_url=base_url, timeout=timeout, transport=transport)

    async def _drive(self, flow: p.AnyFlow[T]) -> T:
        streamed: httpx.Response | None = None
        chunks: Any = None
        try:
            step = next(flow)
            while True:
                try:
                    if step is p.READ:
                        try:
                            reply: Any = await chunks.__anext__()
                        except StopAsyncIteration:
                            reply = b""
                    elif isinstance(step, p.Stream):
                        if streamed is not None:
                            await streamed.aclose()
                        reply = streamed = await self._http.send(step.request, stream=True)
                        chunks = streamed.aiter_bytes()
                    else:
                        reply = await self._http.send(step)
                except httpx.TransportError as e:
                    raise TransportError(str(e) or type(e).__name__) from e
                step = flow.send(reply)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        finally:
            flow.close()
            if streamed is not None:
                await streamed.aclose()

    async def encode(
        self,
        images: Sequence[p.ImageInput | Video],
        *,
        wait: bool = True,
        hash_first: bool = True,
        include_rows: bool = False,
    ) -> list[Handle]:
        return await self._drive(
            p.encode_flow(
                self._http, images, wait=wait, hash_first=hash_first, headers=self.headers, include_rows=include_rows
            )
        )

    async def lookup(self, hashes: Sequence[str], *, wait: bool = False, include_rows: bool = False) -> list[Handle]:
        """Where each image stands, by hash only (nothing is uploaded, nothing is encoded).
        ``wait``: pending images are waited for; ``include_rows``: ready ones carry their rows."""
        return await self._drive(p.lookup_flow(self._http, hashes, self.headers, wait=wait, include_rows=include_rows))

    async def fetch(self, image: str | Handle, start: int | None = None, end: int | None = None) -> np.ndarray:
        if self.shared_memory:
            h = image.hash if isinstance(image, Handle) else image
            return (await self.fetch_many([RowRange(h, start, end)]))[0]
        return await self._drive(p.fetch_flow(self._http, image, start, end, self.headers))

    async def fetch_many(self, ranges: Sequence[RowRange], *, wait: bool = True) -> list[np.ndarray]:
        if self._segments is not None:
            flow = shm_fetch_flow(self._http, ranges, wait=wait, headers=self.headers, known=self._segments)
            return await self._drive(flow)
        return await self._drive(p.fetch_many_flow(self._http, ranges, wait=wait, headers=self.headers))

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
        """The awaitable twin of ``Client.fetch_chunk``."""
        plan = plan_chunk(placements, start, end, dense=dense)
        return await self._drive(
            fetch_chunk_flow(self._http, plan, out, wait=wait, shm=self._segments, headers=self.headers)
        )

    async def model(self) -> dict[str, Any]:
        return await self._drive(p.simple_flow(self._http, "GET", "/v1/model", self.headers))  # type: ignore[no-any-return]

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
