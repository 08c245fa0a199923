"""Rows bodies read straight into the caller's buffers: ``http.client`` keep-alive connections in a small,
thread-safe pool (why not httpx: docs/internals.md, "The client library"). Every network failure is a
``TransportError`` naming the URL."""

from __future__ import annotations

import contextlib
import http.client
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import Any

import anyio.to_thread
import httpcore
import httpx

from visenc_client._exceptions import ProtocolError, TransportError, describe
from visenc_client._sockets import TimedSocket, create_connection, resolve
from visenc_client._steps import Ask, Head

ERRORS = (OSError, http.client.HTTPException)
#: an idle connection older than this is not reused (uvicorn closes kept-alive connections after 5 s)
KEEP_IDLE_S = 4.0
#: a failed request is sent again only on a fresh connection, and only when a kept-alive one failed so
STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)
_CHECKIN = threading.Lock()
#: a view at least this large is read in one system call (``MSG_WAITALL``) on a ``TimedSocket``
WHOLE_READ_BYTES = 1 << 20


class Body:
    """One response's body, read in order; ``close`` checks the connection in once, from any thread."""

    def __init__(
        self, pool: Connections, conn: http.client.HTTPConnection, response: http.client.HTTPResponse, url: str
    ) -> None:
        self._pool, self._response, self.url = pool, response, url
        self._conn: http.client.HTTPConnection | None = conn

    def close(self) -> None:
        with _CHECKIN:
            conn, self._conn = self._conn, None
        if conn is not None:
            self._pool._checkin(conn, self._response)

    def _ended(self) -> None:
        if self._response.length:  # cut short by the connection, else shorter than it says it holds
            raise TransportError(f"the connection closed {self._response.length} bytes before the body's end", self.url)
        raise ProtocolError("the response body ended early")

    def readinto(self, view: memoryview) -> None:
        try:
            filled = self._whole(view) if len(view) >= WHOLE_READ_BYTES else 0
            while filled < len(view):
                n = self._response.readinto(view[filled:])
                if not n:
                    self._ended()
                filled += n
        except ERRORS as e:
            raise TransportError(describe(e), self.url) from e

    def _whole(self, view: memoryview) -> int:
        """``view`` filled in one system call past what ``http.client`` holds already, where the connection is
        a ``TimedSocket`` and the body holds it all; the bytes read (0: none, read it as usual)."""
        response, conn = self._response, self._conn
        sock, fp, length = (conn.sock if conn is not None else None), response.fp, response.length
        if not isinstance(sock, TimedSocket) or sock.gettimeout() is not None or fp is None or response.chunked:
            return 0  # (a socket with Python's timeout does not block: the kernel would not wait for it all)
        if length is None or length < len(view):
            return 0
        held = fp.peek(1)  # what is buffered (one read only where nothing is)
        filled = fp.readinto(view[: len(held)]) if held else 0
        try:
            while filled < len(view):
                n = sock.recv_into(view[filled:], 0, socket.MSG_WAITALL)  # short only at a timeout or the end
                if not n:
                    break
                filled += n
        finally:
            response.length = length - filled  # read past http.client: its count kept true
        if filled < len(view):
            self._ended()
        if not response.length:
            response.read(0)  # http.client ends the response as its own read would (no system call)
        return filled

    def read(self, n: int = 1 << 16) -> bytes:
        try:
            chunk = self._response.read(n)
        except ERRORS as e:
            raise TransportError(describe(e), self.url) from e
        if not chunk and n and self._response.length:
            self._ended()
        return chunk


class ResolvingBackend(httpcore.SyncBackend):
    """httpcore's blocking network, its name look-ups within the connect timeout."""

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        deadline = None if timeout is None else time.monotonic() + timeout
        with _as_connect_errors():
            infos = resolve(host, port, timeout)
        error: Exception = httpcore.ConnectError(f"no address for {host}")
        for info in infos:
            left = None if deadline is None else max(1e-3, deadline - time.monotonic())
            try:
                return super().connect_tcp(str(info[4][0]), port, left, local_address, socket_options)
            except httpcore.ConnectError as e:
                error = e
        raise error


class AsyncResolvingBackend(httpcore.AnyIOBackend):
    """httpcore's asyncio network, its name look-ups within the connect timeout (in a worker thread)."""

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's signature)
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        deadline = None if timeout is None else time.monotonic() + timeout
        with _as_connect_errors():
            infos = await anyio.to_thread.run_sync(resolve, host, port, timeout)
        error: Exception = httpcore.ConnectError(f"no address for {host}")
        for info in infos:
            left = None if deadline is None else max(1e-3, deadline - time.monotonic())
            try:
                return await super().connect_tcp(str(info[4][0]), port, left, local_address, socket_options)
            except httpcore.ConnectError as e:  # anyio's "All connection attempts failed": say which, as sync does
                error = httpcore.ConnectError(_system_reason(e))
        raise error


def _system_reason(e: BaseException) -> str:
    cause: BaseException | None = e
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno:
            return f"[Errno {cause.errno}] {os.strerror(cause.errno)}"
        cause = cause.__cause__
    return str(e)


def _on_backend(transport: Any, backend: Any) -> Any:
    pool = getattr(transport, "_pool", None)
    if hasattr(pool, "_network_backend"):
        pool._network_backend = backend  # type: ignore[union-attr]
    return transport


def resolving_transport() -> httpx.HTTPTransport:
    """httpx's own transport on ``ResolvingBackend`` (httpx has no resolver option)."""
    return _on_backend(httpx.HTTPTransport(), ResolvingBackend())  # type: ignore[no-any-return]


def async_resolving_transport() -> httpx.AsyncHTTPTransport:
    """httpx's own async transport on ``AsyncResolvingBackend``."""
    return _on_backend(httpx.AsyncHTTPTransport(), AsyncResolvingBackend())  # type: ignore[no-any-return]


class Connections:
    """Keep-alive connections to one server; ``read_s`` bounds each wait for its next bytes (``None``: none)."""

    def __init__(self, base_url: str, *, connect_s: float | None, read_s: float | None, max_idle: int = 32) -> None:
        url = httpx.URL(base_url)
        if url.scheme not in ("http", "https"):
            raise ValueError(f"not an http(s) URL: {base_url}")
        self._https, self._origin = url.scheme == "https", f"{url.scheme}://{url.netloc.decode('ascii')}"
        self._prefix = url.raw_path.decode("ascii").partition("?")[0].rstrip("/")  # a base URL's path, as httpx's
        self._host, self._port = url.host, url.port or (443 if self._https else 80)
        self._connect_s, self._read_s = connect_s, read_s
        self._idle: list[tuple[http.client.HTTPConnection, float]] = []
        self._max_idle = max_idle
        self._lock = threading.Lock()

    def _idle_connection(self) -> http.client.HTTPConnection | None:
        with self._lock:
            while self._idle:
                conn, since = self._idle.pop()
                if time.monotonic() - since < KEEP_IDLE_S:
                    return conn
                conn.close()
        return None

    def _connect(self) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = kind(self._host, self._port, timeout=self._connect_s)
        conn._create_connection = create_connection  # type: ignore[attr-defined]
        try:
            conn.connect()
            assert conn.sock is not None
            if isinstance(conn.sock, TimedSocket):
                conn.sock.bound(self._read_s)
            else:
                conn.sock.settimeout(self._read_s)  # TLS: a wrapped socket keeps Python's timeouts
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except BaseException:
            conn.close()
            raise
        conn.auto_open = 0  # never reconnected behind our back (nor past the connect timeout)
        return conn

    def _checkin(self, conn: http.client.HTTPConnection, response: http.client.HTTPResponse) -> None:
        if response.will_close or not response.isclosed() or response.length or conn.sock is None:  # cut short
            _hang_up(conn)
            return
        with self._lock:
            if len(self._idle) < self._max_idle:
                self._idle.append((conn, time.monotonic()))
                return
        conn.close()

    def open(self, request: Ask) -> tuple[Head, Body]:
        """Send ``request``: its answer's head and its unread body (``close`` it once done)."""
        target = self._prefix + request.path
        url = self._origin + target
        while True:
            conn = self._idle_connection()
            kept = conn is not None
            if conn is None:
                try:
                    conn = self._connect()
                except ERRORS as e:
                    raise TransportError(f"connect: {describe(e)}", url, connecting=True) from e
            try:
                conn.request(request.method, target, body=request.content or None, headers=request.headers)
                response = conn.getresponse()
                break
            except ERRORS as e:
                conn.close()
                if not (kept and isinstance(e, STALE)):
                    raise TransportError(describe(e), url) from e
        head = Head(response.status, response.reason, httpx.Headers(response.getheaders()))
        return head, Body(self, conn, response, url)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn, _ in idle:
            conn.close()


def _hang_up(conn: http.client.HTTPConnection) -> None:
    """Close ``conn`` now, even mid-read: ``close`` alone waits for a reading thread, up to the read timeout."""
    if conn.sock is not None:
        with contextlib.suppress(OSError):
            conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()


class _Pending:
    def __init__(self) -> None:
        self._pending = memoryview(b"")

    def _take(self, chunk: bytes | None = None) -> bytes:
        if self._pending:
            out, self._pending = bytes(self._pending), memoryview(b"")
            return out
        return chunk or b""

    def _fill(self, view: memoryview, filled: int, chunk: bytes | None) -> int:
        if not self._pending:
            if not chunk:
                raise ProtocolError("the response body ended early")
            self._pending = memoryview(chunk)
        n = min(len(self._pending), len(view) - filled)
        view[filled : filled + n] = self._pending[:n]
        self._pending = self._pending[n:]
        return filled + n


class ChunkBody(_Pending):
    """A body that comes as chunks (an httpx stream: a custom transport)."""

    def __init__(self, chunks: Iterator[bytes], close: Callable[[], None]) -> None:
        super().__init__()
        self._chunks = chunks
        self.close = close

    def read(self, n: int = 1 << 16) -> bytes:
        return self._take(None if self._pending else next(self._chunks, b""))

    def readinto(self, view: memoryview) -> None:
        filled = 0
        while filled < len(view):
            filled = self._fill(view, filled, None if self._pending else next(self._chunks, b""))


class AsyncChunkBody(_Pending):
    def __init__(self, chunks: AsyncIterator[bytes], close: Callable[[], Awaitable[None]]) -> None:
        super().__init__()
        self._chunks = chunks
        self.aclose = close

    async def _next(self) -> bytes | None:
        if self._pending:
            return None
        try:
            return await self._chunks.__anext__()
        except StopAsyncIteration:
            return b""

    async def read(self, n: int = 1 << 16) -> bytes:
        return self._take(await self._next())

    async def readinto(self, view: memoryview) -> None:
        filled = 0
        while filled < len(view):
            filled = self._fill(view, filled, await self._next())


@contextlib.contextmanager
def _as_connect_errors() -> Iterator[None]:
    try:
        yield
    except TimeoutError as e:
        raise httpcore.ConnectTimeout(str(e)) from e
    except OSError as e:
        raise httpcore.ConnectError(describe(e)) from e
