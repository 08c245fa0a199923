"""``Client`` and ``AsyncClient``: the same operations, blocking or awaited.

Example::

    from visenc_client import Client

    with Client("http://127.0.0.1:8000") as vc:
        handles = vc.encode([open("a.png", "rb").read()])   # hash-first
        rows = vc.fetch(handles[0], start=0, end=64)         # numpy [64, hidden]

Both are pooled (keep-alive) and safe to share across threads (``Client``) or
tasks (``AsyncClient``). Rows are read from the socket straight into the arrays
handed back (``visenc_client._http``); every other request goes through httpx.

``fetch_chunk(placements, start, end)`` fetches exactly the rows prefill chunk
``[start, end)`` needs (see ``visenc_client.chunks``) in one round trip, into
one buffer. With ``shared_memory=True`` (client and service on one host) rows
come from shared-memory segments instead of HTTP bodies: ``fetch`` /
``fetch_many`` return read-only views of them; ranges the service's budget cannot
hold are read over HTTP (``shm_http_fallbacks``). ``shared_memory="auto"`` asks
the service at the first fetch whether it is on this host.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, TypeVar, overload

import httpx
import numpy as np

from visenc_client import _protocol as p
from visenc_client._exceptions import TransportError, VisencClientError, describe
from visenc_client._http import AsyncChunkBody, Body, ChunkBody, Connections, Head, resolving_transport
from visenc_client._rows import fetch_chunk_flow, shm_fetch_flow
from visenc_client._shm import SegmentHandles, same_host
from visenc_client._types import Handle, RowRange, Video
from visenc_client.chunks import ImagePlacement, plan_chunk
from visenc_client.format import LEASE_HEADER

log = logging.getLogger("visenc_client")

T = TypeVar("T")
#: a caller's preallocated buffer (numpy array or CPU torch tensor), handed back filled
Out = TypeVar("Out")
#: seconds to connect (TCP and TLS) to the service, unless said otherwise: a replica that does not
#: accept costs this, not the read timeout
DEFAULT_CONNECT_TIMEOUT_S = 5.0
DEFAULT_TIMEOUT = httpx.Timeout(connect=DEFAULT_CONNECT_TIMEOUT_S, read=300.0, write=60.0, pool=60.0)


def timeouts(timeout: httpx.Timeout | float | None, connect_timeout: float | None) -> httpx.Timeout:
    """The client's timeouts: ``timeout`` as an ``httpx.Timeout`` keeps its own connect bound; as a number
    it bounds each read, write and wait for a pooled connection, and connecting stays at
    ``DEFAULT_CONNECT_TIMEOUT_S``. ``connect_timeout``, when given, bounds connecting in either case."""
    if isinstance(timeout, httpx.Timeout):
        connect = timeout.connect if connect_timeout is None else connect_timeout
        return httpx.Timeout(connect=connect, read=timeout.read, write=timeout.write, pool=timeout.pool)
    return httpx.Timeout(timeout, connect=DEFAULT_CONNECT_TIMEOUT_S if connect_timeout is None else connect_timeout)


#: ``shared_memory``: ``True``, ``False``, or ``"auto"`` (shared memory when the service is on this host)
SharedMemory = bool | Literal["auto"]


def lookup_flow(
    http: httpx.Client | httpx.AsyncClient,
    hashes: Sequence[str],
    headers: dict[str, str],
    known: SegmentHandles | None,
    wait: bool,
    include_rows: bool,
    pin: bool,
) -> p.AnyFlow[list[Handle]]:
    """The look-up of ``hashes``: with ``pin``, images whose rows this client reads from a ``known``
    segment with no request (so no read of theirs would reach the service to release a pin) are
    looked up in a request of their own that pins nothing."""
    parts: list[tuple[list[int], bool]] = [(list(range(len(hashes))), pin)]
    if pin and known is not None and not include_rows:
        free = {i for i, h in enumerate(hashes) if known.knows(h)}
        owed = [i for i in range(len(hashes)) if i not in free]
        parts = [(part, pinned) for part, pinned in ((sorted(free), False), (owed, True)) if part]
    handles: dict[int, Handle] = {}
    for part, pinned in parts:
        asked = [hashes[i] for i in part]
        got = yield from p.lookup_flow(http, asked, p.pinning(headers, pinned), wait=wait, include_rows=include_rows)
        handles.update(zip(part, got))
    return [handles[i] for i in range(len(hashes))]


class _Base:
    def __init__(
        self,
        base_url: str,
        namespace: str | None,
        api_key: str | None,
        shared_memory: SharedMemory,
        timeout: httpx.Timeout,
        custom_transport: bool,
    ) -> None:
        self.shared_memory = shared_memory is True
        #: ``"auto"`` until the first rows are fetched: then asked of the service (``_choose``)
        self._auto = shared_memory == "auto"
        #: where images' rows sit in the service's segments (reads them again with no request)
        self._segments = SegmentHandles() if self.shared_memory else None
        #: this client hands leases back: its encodes ask for lease ids, and its reads that name none
        #: (by hash alone) release no other caller's pin (a service before leases ignores the header)
        self.headers: dict[str, str] = {LEASE_HEADER: "id"}
        if namespace is not None:
            self.headers["x-visenc-namespace"] = namespace
        if api_key is not None:
            self.headers["authorization"] = f"Bearer {api_key}"
        #: rows stream through the standard library's connections, straight into their buffers; httpx
        #: streams them where a custom transport stands in for the network (``visenc_client._http``)
        self.base_url = base_url
        self.timeout = timeout
        self._conns = (
            None if custom_transport else Connections(base_url, connect_s=timeout.connect, read_s=timeout.read)
        )

    def _choose(self, model_info: dict[str, Any]) -> None:
        """Settle ``shared_memory="auto"`` from the service's ``/v1/model``: shared memory when its
        probe segment is readable here (the same host), HTTP otherwise; said once in the log."""
        self._auto = False
        self.shared_memory = same_host(model_info)
        self._segments = SegmentHandles() if self.shared_memory else None
        log.info("visenc at %s: rows over %s", self.base_url, "shared memory" if self.shared_memory else "HTTP")

    @property
    def shm_http_fallbacks(self) -> int:
        """Ranges read over HTTP because the service's shared-memory budget was full."""
        return self._segments.http_fallbacks if self._segments is not None else 0


class Client(_Base):
    """Blocking client.

    ``encode(images, wait=True, hash_first=True)`` → handles;
    ``fetch(handle, start, end)`` → ``[rows, hidden]`` numpy view;
    ``fetch_many(ranges)`` → one array per range, one round trip;
    ``fetch_chunk(placements, start, end, out=None)`` → the chunk's rows in one buffer.

    ``timeout``: seconds each read (a long-poll's wait included) or write may take, or an
    ``httpx.Timeout``; ``connect_timeout``: seconds to connect (5 by default), so a replica that
    does not accept fails fast. Any failure of the network is a ``TransportError`` naming the URL."""

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
    ) -> None:
        t = timeouts(timeout, connect_timeout)
        super().__init__(base_url, namespace, api_key, shared_memory, t, transport is not None)
        self._http = httpx.Client(base_url=base_url, timeout=t, transport=transport or resolving_transport())

    def _open(self, request: httpx.Request) -> tuple[Head, Body | ChunkBody]:
        if self._conns is not None:
            return self._conns.open(request)
        resp = self._http.send(request, stream=True)
        return Head(resp.status_code, resp.reason_phrase, resp.headers), ChunkBody(resp.iter_bytes(), resp.close)

    def _drive(self, flow: p.AnyFlow[T]) -> T:
        body: Body | ChunkBody | None = None
        url: object = self.base_url  # of the request being answered
        try:
            step = next(flow)
            while True:
                try:
                    if isinstance(step, p.ReadInto):
                        reply: Any = body.readinto(step.view)  # type: ignore[union-attr]
                    elif step is p.READ:
                        reply = body.read()  # type: ignore[union-attr]
                    elif isinstance(step, p.Stream):
                        url = step.request.url
                        done, body = body, None
                        if done is not None:
                            done.close()
                        reply, body = self._open(step.request)
                    else:
                        url = step.url
                        reply = self._http.send(step)
                except httpx.TransportError as e:
                    raise TransportError(describe(e), str(url), connecting=_connecting(e)) from e
                step = flow.send(reply)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        finally:
            flow.close()
            if body is not None:
                body.close()

    def encode(
        self,
        images: Sequence[p.ImageInput | Video],
        *,
        wait: bool = True,
        hash_first: bool = True,
        include_rows: bool = False,
        pin: bool = True,
    ) -> list[Handle]:
        """``pin``: the service keeps each ready (or pending) image in its memory until this client reads
        it (``fetch`` with the handle; ``Handle.lease``); false for a caller that will not read the rows
        from this service (a hand-over): nothing is kept for it."""
        headers = p.pinning(self.headers, pin)
        return self._drive(
            p.encode_flow(
                self._http, images, wait=wait, hash_first=hash_first, headers=headers, include_rows=include_rows
            )
        )

    def lookup(
        self, hashes: Sequence[str], *, wait: bool = False, include_rows: bool = False, pin: bool = True
    ) -> list[Handle]:
        """Where each image stands, by hash only (nothing is uploaded, nothing is encoded).
        ``wait``: pending images are waited for; ``include_rows``: ready ones carry their rows;
        ``pin``: as ``encode``'s (an image this client reads from shared memory with no request is
        not pinned)."""
        return self._drive(lookup_flow(self._http, hashes, self.headers, self._segments, wait, include_rows, pin))

    def hand_back(self, handles: Sequence[Handle]) -> None:
        """Release what the service keeps for ready ``handles`` whose rows this client will not read
        (their leases; one request). Best effort: a failure is ignored, and the leases lapse."""
        with contextlib.suppress(VisencClientError):
            self._drive(p.hand_back_flow(self._http, handles, self.headers))

    def fetch(self, image: str | Handle, start: int | None = None, end: int | None = None) -> np.ndarray:
        if self._auto:
            self._choose(self.model())
        if self.shared_memory:
            return self.fetch_many([RowRange.of(image, start, end)])[0]
        return self._drive(p.fetch_flow(self._http, image, start, end, self.headers))

    def fetch_many(self, ranges: Sequence[RowRange], *, wait: bool = True) -> list[np.ndarray]:
        if self._auto:
            self._choose(self.model())
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
        if self._auto:
            self._choose(self.model())
        plan = plan_chunk(placements, start, end, dense=dense)
        return self._drive(fetch_chunk_flow(self._http, plan, out, wait=wait, shm=self._segments, headers=self.headers))

    def model(self) -> dict[str, Any]:
        return self._drive(p.simple_flow(self._http, "GET", "/v1/model", self.headers))  # type: ignore[no-any-return]

    def close(self) -> None:
        self._http.close()
        if self._conns is not None:
            self._conns.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_Base):
    """The awaitable twin of ``Client`` (same methods, same options, same results and exceptions)."""

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
    ) -> None:
        t = timeouts(timeout, connect_timeout)
        super().__init__(base_url, namespace, api_key, shared_memory, t, transport is not None)
        self._http = httpx.AsyncClient(base_url=base_url, timeout=t, transport=transport)
        #: threads that read streamed rows (the socket reads release the GIL); made on first use
        self._io: ThreadPoolExecutor | None = None

    async def _blocking(self, fn: Callable[..., T], *args: Any) -> T:
        if self._io is None:
            self._io = ThreadPoolExecutor(32, thread_name_prefix="visenc-client-io")
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    async def _open(self, request: httpx.Request) -> tuple[Head, Body | AsyncChunkBody]:
        if self._conns is not None:
            return await self._blocking(self._conns.open, request)
        resp = await self._http.send(request, stream=True)
        head = Head(resp.status_code, resp.reason_phrase, resp.headers)
        return head, AsyncChunkBody(resp.aiter_bytes(), resp.aclose)

    async def _read(self, body: Body | AsyncChunkBody, step: p.ReadInto | p.Read) -> bytes | None:
        if isinstance(body, AsyncChunkBody):
            return await (body.readinto(step.view) if isinstance(step, p.ReadInto) else body.read())
        if isinstance(step, p.ReadInto):
            return await self._blocking(body.readinto, step.view)
        return await self._blocking(body.read)

    async def _drive(self, flow: p.AnyFlow[T]) -> T:
        body: Body | AsyncChunkBody | None = None
        url: object = self.base_url  # of the request being answered
        try:
            step = next(flow)
            while True:
                try:
                    if isinstance(step, p.ReadInto | p.Read):
                        assert body is not None, "a flow read a body before it streamed a request"
                        reply: Any = await self._read(body, step)
                    elif isinstance(step, p.Stream):
                        url = step.request.url
                        done, body = body, None
                        await _close(done)
                        reply, body = await self._open(step.request)
                    else:
                        url = step.url
                        reply = await self._http.send(step)
                except httpx.TransportError as e:
                    raise TransportError(describe(e), str(url), connecting=_connecting(e)) from e
                step = flow.send(reply)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        finally:
            flow.close()
            await _close(body)

    async def encode(
        self,
        images: Sequence[p.ImageInput | Video],
        *,
        wait: bool = True,
        hash_first: bool = True,
        include_rows: bool = False,
        pin: bool = True,
    ) -> list[Handle]:
        """As ``Client.encode``."""
        headers = p.pinning(self.headers, pin)
        return await self._drive(
            p.encode_flow(
                self._http, images, wait=wait, hash_first=hash_first, headers=headers, include_rows=include_rows
            )
        )

    async def lookup(
        self, hashes: Sequence[str], *, wait: bool = False, include_rows: bool = False, pin: bool = True
    ) -> list[Handle]:
        """As ``Client.lookup``."""
        return await self._drive(lookup_flow(self._http, hashes, self.headers, self._segments, wait, include_rows, pin))

    async def hand_back(self, handles: Sequence[Handle]) -> None:
        """As ``Client.hand_back``."""
        with contextlib.suppress(VisencClientError):
            await self._drive(p.hand_back_flow(self._http, handles, self.headers))

    async def fetch(self, image: str | Handle, start: int | None = None, end: int | None = None) -> np.ndarray:
        if self._auto:
            self._choose(await self.model())
        if self.shared_memory:
            return (await self.fetch_many([RowRange.of(image, start, end)]))[0]
        return await self._drive(p.fetch_flow(self._http, image, start, end, self.headers))

    async def fetch_many(self, ranges: Sequence[RowRange], *, wait: bool = True) -> list[np.ndarray]:
        if self._auto:
            self._choose(await self.model())
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
        if self._auto:
            self._choose(await self.model())
        plan = plan_chunk(placements, start, end, dense=dense)
        return await self._drive(
            fetch_chunk_flow(self._http, plan, out, wait=wait, shm=self._segments, headers=self.headers)
        )

    async def model(self) -> dict[str, Any]:
        return await self._drive(p.simple_flow(self._http, "GET", "/v1/model", self.headers))  # type: ignore[no-any-return]

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


def _connecting(e: httpx.TransportError) -> bool:
    return isinstance(e, httpx.ConnectError | httpx.ConnectTimeout)


async def _close(body: Body | AsyncChunkBody | None) -> None:
    if isinstance(body, Body):
        body.close()
    elif body is not None:
        await body.aclose()
