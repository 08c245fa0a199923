"""The client's rows connections (``visenc_client._http``) survive a server that drops kept-alive
connections: the request goes again on a fresh connection, never failing the caller. A connection
goes back to the pool once, so no two callers ever share one."""

from __future__ import annotations

import contextlib
import http.client
import http.server
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import msgpack
import numpy as np
import pytest

from visenc_client import AsyncClient, Client, NotFoundError, TransportError
from visenc_client._sockets import KERNEL_TIMEOUTS, TimedSocket
from visenc_client._steps import Ask

ROWS = np.arange(12, dtype=np.float32).reshape(3, 4)


class OneRequestPerConnection(http.server.BaseHTTPRequestHandler):
    """Answers one GET of rows, then closes the connection without saying so (a keep-alive timeout)."""

    protocol_version = "HTTP/1.1"
    served: list[int] = []

    def do_GET(self) -> None:
        body = ROWS.tobytes()
        self.send_response(200)
        self.send_header("content-type", "application/octet-stream")
        self.send_header("content-length", str(len(body)))
        self.send_header("x-visenc-shape", "3,4")
        self.send_header("x-visenc-dtype", "float32")
        self.end_headers()
        self.served.append(1)  # before the body: the client may assert as soon as it has read it
        self.wfile.write(body)
        self.close_connection = True

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def serving(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """A threaded ``http.server`` on a free loopback port: its URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def dropping_server() -> Iterator[str]:
    with serving(OneRequestPerConnection) as url:
        yield url


def test_a_dropped_keep_alive_connection_is_replaced(dropping_server: str) -> None:
    OneRequestPerConnection.served.clear()
    with Client(dropping_server) as vc:
        for _ in range(4):  # each fetch after the first meets a connection the server closed
            np.testing.assert_array_equal(vc.fetch("a" * 64), ROWS)
    assert len(OneRequestPerConnection.served) == 4


class UploadsReset(http.server.BaseHTTPRequestHandler):
    """A visenc-like server whose look-ups answer ``missing`` and whose uploads meet a reset
    connection, so an ``encode`` fails after one body was read and closed; its rows are a function of
    the hash asked, so a connection two callers share shows as rows of another image."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        payload = msgpack.unpackb(self.rfile.read(int(self.headers["content-length"])))
        if any("data" in item for item in payload["items"]):
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            return
        body = msgpack.packb({"items": [{"hash": i["hash"], "status": "missing"} for i in payload["items"]]})
        self._answer(body, "application/msgpack")

    def do_GET(self) -> None:
        self._answer(rows_of(self.path.rsplit("/", 1)[1]).tobytes(), "application/octet-stream")

    def _answer(self, body: bytes, content_type: str) -> None:
        self.send_response(200)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.send_header("x-visenc-shape", "3,4")
        self.send_header("x-visenc-dtype", "float32")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def rows_of(image_hash: str) -> np.ndarray:
    return np.full((3, 4), int(image_hash[:6], 16), dtype=np.float32)


@pytest.fixture
def resetting_uploads() -> Iterator[str]:
    with serving(UploadsReset) as url:
        yield url


def pooled(vc: Client) -> list[http.client.HTTPConnection]:
    assert vc._conns is not None
    return [conn for conn, _ in vc._conns._idle]


def test_a_body_gives_its_connection_back_once(resetting_uploads: str) -> None:
    """``close`` acts once, however often and from however many threads it is called."""
    with Client(resetting_uploads) as vc:
        assert vc._conns is not None
        for closers in (1, 2, 16):
            _, body = vc._conns.open(Ask("GET", f"/v1/embeddings/{'ab' * 32}", {}))
            while body.read():
                pass
            start = threading.Barrier(closers)

            def close(body: Any = body, start: threading.Barrier = start) -> None:
                start.wait(10)
                body.close()

            threads = [threading.Thread(target=close) for _ in range(closers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(10)
            assert len(pooled(vc)) == 1
            vc._conns.close()


def test_a_failed_request_after_a_read_body_pools_nothing_twice(resetting_uploads: str) -> None:
    """An encode whose look-up was read and whose upload then failed: the look-up's connection went
    back to the pool once (it was closed, then the next request failed, then the flow ended)."""
    with Client(resetting_uploads) as vc:
        with pytest.raises(TransportError):
            vc.encode([b"not an image"], include_rows=True)
        conns = pooled(vc)
        assert len({id(c) for c in conns}) == len(conns) and all(c.sock is not None for c in conns)


def test_threads_never_share_a_connection(resetting_uploads: str) -> None:
    """Threads that each fail an encode (as above) and fetch rows, at once, on one client: every
    fetch gets its own image's rows (a connection pooled twice would hand two threads one socket)."""
    errors: list[BaseException] = []

    def work(vc: Client, n: int) -> None:
        try:
            for i in range(20):
                with contextlib.suppress(TransportError):
                    vc.encode([f"{n}-{i}".encode()], include_rows=True)
                image = f"{n:02x}{i:04x}" + "0" * 58
                np.testing.assert_array_equal(vc.fetch(image), rows_of(image))
        except BaseException as e:
            errors.append(e)

    with Client(resetting_uploads) as vc:
        threads = [threading.Thread(target=work, args=(vc, n)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert errors == []


async def test_the_async_client_pools_nothing_twice(resetting_uploads: str) -> None:
    import asyncio

    async with AsyncClient(resetting_uploads) as vc:

        async def work(n: int) -> None:
            for i in range(10):
                with contextlib.suppress(TransportError):
                    await vc.encode([f"{n}-{i}".encode()], include_rows=True)
                image = f"{n:02x}{i:04x}" + "0" * 58
                np.testing.assert_array_equal(await vc.fetch(image), rows_of(image))

        await asyncio.gather(*(work(n) for n in range(8)))
        assert vc._conns is not None
        conns = [conn for conn, _ in vc._conns._idle]
        assert len({id(c) for c in conns}) == len(conns) and all(c.sock is not None for c in conns)


class Recorder(http.server.BaseHTTPRequestHandler):
    """Answers every request 404, keeping its target and the headers the client sent."""

    protocol_version = "HTTP/1.1"
    seen: list[tuple[str, dict[str, str]]] = []

    def do_GET(self) -> None:
        self.seen.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
        body = b'{"error": {"kind": "not_found", "message": "no such image"}}'
        self.send_response(404)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("transport", [None, "httpx"], ids=["own connections", "httpx transport"])
async def test_a_streamed_read_goes_under_the_base_urls_path_with_the_callers_headers(transport: str | None) -> None:
    """A service behind a path (a proxy's prefix): every request goes under it, its image quoted as httpx would."""
    Recorder.seen = []
    with serving(Recorder) as url:
        options: dict[str, Any] = {"namespace": "tenant-a", "api_key": "k" * 20}
        with Client(f"{url}/pre/fix", transport=transport and httpx.HTTPTransport(), **options) as vc:
            for image in ("ab" * 32, "a b/é"):
                with pytest.raises(NotFoundError):
                    vc.fetch(image)
        async with AsyncClient(f"{url}/pre/fix", transport=transport and httpx.AsyncHTTPTransport(), **options) as ac:
            with pytest.raises(NotFoundError):
                await ac.fetch("ab" * 32)
    paths = [path for path, _ in Recorder.seen]
    first = f"/pre/fix/v1/embeddings/{'ab' * 32}"
    assert paths == [first, "/pre/fix/v1/embeddings/a%20b/%C3%A9", first]
    assert all(
        h["x-visenc-namespace"] == "tenant-a" and h["authorization"] == f"Bearer {'k' * 20}" for _, h in Recorder.seen
    )


# --- a large view: one system call, the kernel bounding its waits ---------------------------------------
#: 4 MiB of rows, past ``WHOLE_READ_BYTES``
LARGE = np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024)


class Dribbles(http.server.BaseHTTPRequestHandler):
    """Answers each GET (kept alive) with ``LARGE`` in 64 KiB pieces, ``pause_s`` apart; ``stop_at`` bytes into
    the body it stalls (``stall``) or closes the connection (``cut``)."""

    protocol_version = "HTTP/1.1"
    pause_s = 0.0
    stop_at: int | None = None
    stop = "cut"
    connections: set[int] = set()

    def do_GET(self) -> None:
        body = memoryview(LARGE.tobytes())
        self.connections.add(id(self.connection))
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.send_header("x-visenc-shape", "1024,1024")
        self.send_header("x-visenc-dtype", "float32")
        self.end_headers()
        end = len(body) if self.stop_at is None else self.stop_at
        for start in range(0, end, 1 << 16):
            self.wfile.write(body[start : min(start + (1 << 16), end)])
            time.sleep(self.pause_s)
        if self.stop_at is None:
            return
        if self.stop == "stall":
            time.sleep(5.0)
        self.close_connection = True

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def dribbling(**kinds: Any) -> Iterator[tuple[str, type[Dribbles]]]:
    handler = type("Dribbling", (Dribbles,), {"connections": set(), **kinds})
    with serving(handler) as url:
        yield url, handler


def count_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    reads: list[int] = []
    recv_into = TimedSocket.recv_into

    def counted(self: TimedSocket, *args: Any) -> int:
        reads.append(1)
        return recv_into(self, *args)

    monkeypatch.setattr(TimedSocket, "recv_into", counted)
    return reads


@pytest.mark.skipif(not KERNEL_TIMEOUTS, reason="the kernel bounds socket waits on Linux and macOS only")
def test_a_large_view_is_read_in_one_system_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """A body that comes in 64 pieces is read with a handful of reads (its head, what came with it, the rest
    in one): one GIL round trip for the view however its bytes arrive. Read segment by segment, it took one
    read, and one wait for the GIL, per piece."""
    reads = count_reads(monkeypatch)
    with dribbling(pause_s=0.002) as (url, handler), Client(url) as vc:
        for _ in range(2):
            reads.clear()
            assert np.array_equal(vc.fetch("a" * 64), LARGE)
            assert len(reads) <= 3, len(reads)
        assert len(pooled(vc)) == 1  # the response ended as http.client ends one: its connection kept alive
    assert len(handler.connections) == 1


@pytest.mark.skipif(not KERNEL_TIMEOUTS, reason="the kernel bounds socket waits on Linux and macOS only")
async def test_a_slow_but_steady_large_body_is_read_whole() -> None:
    """The read timeout bounds each wait for the next bytes, as before, not the whole read: a body that
    takes 1.5 s, a piece every 25 ms, reads whole under a 0.5 s timeout."""
    with dribbling(pause_s=0.025) as (url, _):
        with Client(url, timeout=0.5) as vc:
            assert np.array_equal(vc.fetch("a" * 64), LARGE)
        async with AsyncClient(url, timeout=0.5) as avc:
            assert np.array_equal(await avc.fetch("a" * 64), LARGE)


@pytest.mark.parametrize("stop", ["stall", "cut"])
def test_a_large_body_that_stops_is_a_transport_error(stop: str) -> None:
    """Stalled mid-view: a timeout (``timed_out``). Cut: the bytes missing, said. Either way the connection is
    not pooled."""
    with dribbling(stop_at=1 << 20, stop=stop) as (url, _), Client(url, timeout=0.5) as vc:
        started = time.monotonic()
        with pytest.raises(TransportError) as raised:
            vc.fetch("a" * 64)
        assert time.monotonic() - started < 30.0
        assert pooled(vc) == []
    if stop == "stall":
        assert raised.value.timed_out, raised.value
    else:
        assert f"closed {LARGE.nbytes - (1 << 20)} bytes before the body's end" in str(raised.value)


@pytest.mark.skipif(not KERNEL_TIMEOUTS, reason="the kernel bounds socket waits on Linux and macOS only")
@pytest.mark.parametrize("timeout", [2.9999999, 0.9999996])
def test_a_timeout_a_hair_under_a_whole_second_reads(timeout: float) -> None:
    """Its microseconds round up to a whole second: carried into the seconds, not sent as 10**6 (EDOM)."""
    with dribbling() as (url, _), Client(url, timeout=timeout) as vc:
        assert np.array_equal(vc.fetch("a" * 64), LARGE)
        (conn,) = pooled(vc)
        assert conn.sock is not None
        timeval = conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16)
        seconds, micros = struct.unpack("@qq" if len(timeval) == 16 else "@ll", timeval)
        assert conn.sock.gettimeout() is None and seconds + micros / 1e6 == pytest.approx(timeout, abs=1e-5)


@pytest.mark.skipif(not KERNEL_TIMEOUTS, reason="the kernel bounds socket waits on Linux and macOS only")
@pytest.mark.parametrize("call", ["setsockopt", "getsockopt"])
def test_where_the_kernel_refuses_its_bound_pythons_timeout_stays(monkeypatch: pytest.MonkeyPatch, call: str) -> None:
    """A kernel that refuses the timeval (another layout of it), or to say its size: the connection keeps
    Python's timeout and reads segment by segment, as a socket that does not block must."""

    def refuse(self: TimedSocket, level: int, option: int, *value: Any) -> Any:
        if option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
            raise OSError(22, "Invalid argument")
        return getattr(socket.socket, call)(self, level, option, *value)

    monkeypatch.setattr(TimedSocket, call, refuse)
    reads = count_reads(monkeypatch)
    with dribbling(pause_s=0.002) as (url, _), Client(url, timeout=5.0) as vc:
        assert np.array_equal(vc.fetch("a" * 64), LARGE)
        (conn,) = pooled(vc)
        assert conn.sock is not None and conn.sock.gettimeout() == 5.0
    assert len(reads) > 3
