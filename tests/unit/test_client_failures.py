"""Every way the network fails reaches the caller as a ``TransportError`` naming the URL, on every
transport (the standard library's rows reader, httpx, shared memory's requests, Redis), from the
blocking and the async client; connecting has its own timeout; a connection goes back to the pool
once. Real loopback sockets throughout (``tests.support.dead_ends``)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from tests.support.dead_ends import CUT_HTTP, CUT_RESP, UNRESOLVABLE, Blackhole, Peer, refused

from visenc_client import AsyncClient, AsyncRedisRows, Client, RedisRows, RowRange, TransportError
from visenc_client._http import Body

H = "a" * 64
#: far above every bound a test sets: a call that took this long waited for the wrong timeout
SLOW_S = 30.0


@contextlib.contextmanager
def dead_end(kind: str) -> Iterator[str]:
    """The URL of a peer that fails as ``kind`` says."""
    if kind == "refused":
        yield refused()
    elif kind == "unresolvable":
        yield f"http://{UNRESOLVABLE}:8000"
    elif kind == "connect-hangs":
        with Blackhole() as hole:
            yield hole.url
    else:
        with Peer(kind) as peer:
            yield peer.url


#: each way of calling the service, by the transport it takes
CALLS: dict[str, Callable[[Client], Any]] = {
    "rows-reader": lambda c: c.lookup([H], include_rows=True),  # http.client, straight into buffers
    "rows-fetch": lambda c: c.fetch(H),
    "httpx": lambda c: c.lookup([H]),
    "httpx-get": lambda c: c.model(),
    "shm-request": lambda c: c.fetch_many([RowRange(H)]),  # with shared_memory=True (below)
}
KINDS = ["refused", "unresolvable", "connect-hangs", "silent", "reset", "cut"]


def options(call: str) -> dict[str, Any]:
    return {"connect_timeout": 0.5, "timeout": 1.0, "shared_memory": call == "shm-request"}


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("kind", KINDS)
def test_every_failure_is_a_transport_error_naming_the_url(kind: str, call: str) -> None:
    with dead_end(kind) as url, Client(url, **options(call)) as vc:
        started = time.monotonic()
        with pytest.raises(TransportError) as raised:
            CALLS[call](vc)
        assert time.monotonic() - started < SLOW_S
    assert raised.value.url is not None and raised.value.url.startswith(url)
    assert url in str(raised.value)


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("kind", KINDS)
async def test_the_async_client_raises_the_same(kind: str, call: str) -> None:
    with dead_end(kind) as url:
        async with AsyncClient(url, **options(call)) as vc:
            with pytest.raises(TransportError) as raised:
                await CALLS[call](vc)
    assert raised.value.url is not None and raised.value.url.startswith(url)


async def test_a_cancelled_read_never_holds_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A task cancelled while its rows are read (``asyncio.wait_for``, a caller gone) from a server that
    stalls mid-body: the task ends at once, its connection dropped. Before, closing the body waited on
    the event loop for the abandoned read in its thread to end: up to the read timeout."""
    reading = threading.Event()
    read = Body.readinto

    def readinto(self: Body, view: memoryview) -> None:
        reading.set()
        read(self, view)

    monkeypatch.setattr(Body, "readinto", readinto)
    with Peer("stall", reply=CUT_HTTP) as peer:
        async with AsyncClient(peer.url, timeout=4 * SLOW_S) as vc:
            task = asyncio.create_task(vc.fetch(H))
            assert await asyncio.to_thread(reading.wait, SLOW_S), "the rows were never read"
            started = time.monotonic()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert time.monotonic() - started < SLOW_S


@pytest.mark.parametrize("call", ["rows-reader", "httpx"])
def test_connecting_has_its_own_timeout(call: str) -> None:
    """A connect that hangs costs the connect timeout (5 s unless said), never the read timeout."""
    with Blackhole() as hole, Client(hole.url, timeout=600.0) as vc:
        assert vc.timeout.connect == 5.0 and vc.timeout.read == 600.0
        started = time.monotonic()
        with pytest.raises(TransportError, match=r"connect|Connect"):
            CALLS[call](vc)
        waited = time.monotonic() - started
    assert 4.5 <= waited < SLOW_S


def test_the_timeouts_as_said() -> None:
    cases = [
        ({}, 5.0, 300.0),
        ({"timeout": 20.0}, 5.0, 20.0),
        ({"timeout": 20.0, "connect_timeout": 1.0}, 1.0, 20.0),
        ({"timeout": httpx.Timeout(20.0, connect=2.0)}, 2.0, 20.0),
        ({"timeout": httpx.Timeout(20.0, connect=2.0), "connect_timeout": 0.5}, 0.5, 20.0),
    ]
    for options, connect, read in cases:
        with Client("http://127.0.0.1:9", **options) as vc:
            assert (vc.timeout.connect, vc.timeout.read) == (connect, read), options
            assert vc._conns is not None and (vc._conns._connect_s, vc._conns._read_s) == (connect, read)


REDIS_KINDS = ["refused", "connect-hangs", "silent", "reset", "cut"]


@contextlib.contextmanager
def redis_dead_end(kind: str) -> Iterator[str]:
    if kind == "cut":
        with Peer("cut", reply=CUT_RESP) as peer:
            yield f"redis://127.0.0.1:{peer.port}/0"
    else:
        with dead_end(kind) as url:
            yield url.replace("http://", "redis://") + "/0"


REDIS_OPTIONS = {"socket_connect_timeout": 0.5, "socket_timeout": 1.0, "retry": Retry(NoBackoff(), 0)}


@pytest.mark.parametrize("kind", REDIS_KINDS)
def test_redis_failures_are_transport_errors_naming_the_server(kind: str) -> None:
    with redis_dead_end(kind) as url:
        rows = RedisRows.from_url(url, fingerprint="f", **REDIS_OPTIONS)
        with pytest.raises(TransportError) as raised:
            rows.fetch(H)
        rows.close()
    assert raised.value.url == url and url in str(raised.value)


@pytest.mark.parametrize("kind", REDIS_KINDS)
async def test_async_redis_failures_are_transport_errors(kind: str) -> None:
    with redis_dead_end(kind) as url:
        rows = AsyncRedisRows.from_url(url, fingerprint="f", **REDIS_OPTIONS)
        with pytest.raises(TransportError) as raised:
            await rows.fetch(H)
        await rows.aclose()
    assert raised.value.url == url


async def test_a_redis_cluster_that_does_not_answer_is_a_transport_error() -> None:
    """``from_url`` connects nothing, sync or async: a cluster none of whose nodes answers is a
    ``TransportError`` at the first read, naming the node, never its password."""
    with dead_end("refused") as url:
        secret = url.replace("http://", "redis://:hunter2@")
        public = url.replace("http://", "redis://")
        rows = RedisRows.from_url(secret, fingerprint="f", cluster=True, **REDIS_OPTIONS)
        with pytest.raises(TransportError) as raised:
            rows.fetch(H)
        assert raised.value.url == public and "hunter2" not in str(raised.value)
        rows.close()
        arows = AsyncRedisRows.from_url(secret, fingerprint="f", cluster=True, **REDIS_OPTIONS)
        with pytest.raises(TransportError) as araised:
            await arows.fetch(H)
        assert araised.value.url == public and "hunter2" not in str(araised.value)
        await arows.aclose()


def test_threads_that_read_first_share_one_redis_client(monkeypatch: pytest.MonkeyPatch) -> None:
    """The client ``from_url`` defers is made once, however many threads read first (none left unclosed)."""
    made: list[Any] = []
    entered = threading.Barrier(4)
    make = redis.Redis.from_url

    def from_url(url: str, **options: Any) -> Any:
        time.sleep(0.2)  # the other threads reach the client meanwhile
        made.append(make(url, **options))
        return made[-1]

    monkeypatch.setattr(redis.Redis, "from_url", from_url)
    rows = RedisRows.from_url("redis://127.0.0.1:1/0", fingerprint="f")

    def first_read() -> Any:
        entered.wait()
        return rows.redis

    threads = [threading.Thread(target=first_read) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and rows.redis is made[0]
    rows.close()


def test_a_redis_client_given_as_is_is_named_too() -> None:
    with dead_end("refused") as url:
        port = int(url.rsplit(":", 1)[1])
        rows = RedisRows(redis.Redis(port=port, retry=Retry(NoBackoff(), 0)), fingerprint="f")
        with pytest.raises(TransportError, match=f"redis://localhost:{port}/0"):
            rows.info(H)


def test_a_segment_that_cannot_be_mapped_is_a_transport_error(tmp_path) -> None:
    import numpy as np

    from visenc_client._shm import SegmentMaps

    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(TransportError) as raised:
        SegmentMaps(str(tmp_path)).view("empty", 0, 16, np.dtype("float32"), 1, 4)
    assert raised.value.url == str(tmp_path / "empty")


def test_failures_keep_their_cause() -> None:
    with dead_end("refused") as url, Client(url) as vc:
        with pytest.raises(TransportError) as raised:
            vc.fetch(H)
    assert isinstance(raised.value.__cause__, ConnectionRefusedError)
    assert "ConnectionRefusedError" in str(raised.value)
