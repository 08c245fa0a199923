"""``Client`` and ``AsyncClient`` are twins: every operation, its successes and its errors, run through
both against one served visenc (each in a namespace of its own, so both start from the same index) gives
the same outcome, over HTTP, over shared memory and with ``"auto"``; the Redis readers too."""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import re
import socket
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import redis
from harness.images import png_bytes
from harness.processes import serve_process
from harness.waits import wait_until
from redis.backoff import NoBackoff
from redis.retry import Retry

from visenc_client import AsyncClient, AsyncRedisRows, Client, Handle, ImagePlacement, RedisRows, RowRange
from visenc_client.format import entry_key

pytestmark = pytest.mark.slow

HELD = "visenc.parity.held"
MISSING = "f" * 64
PATIENCE_S = 20.0
PNGS = [png_bytes(400 + i, 140 + 28 * i, 112) for i in range(4)]  # 20 to 32 rows each
REDIS_OPTIONS = {"socket_connect_timeout": 0.5, "socket_timeout": 1.0, "retry": Retry(NoBackoff(), 0)}


def placed(c: dict[str, Any], *keys: str) -> list[ImagePlacement]:
    out, at = [], 3
    for k in keys:
        out.append(ImagePlacement.of(c[k][0], at))
        at += c[k][0].num_tokens + 2
    return out


#: (name, operation on a client and the run's context, context key its result is kept under)
OPS: list[tuple[str, Callable[[Any, dict[str, Any]], Any], str | None]] = [
    ("model", lambda vc, c: vc.model(), None),
    ("encode", lambda vc, c: vc.encode([PNGS[0]]), "a"),
    ("encode-no-wait", lambda vc, c: vc.encode([PNGS[1]], wait=False), "b"),
    ("encode-bytes-first", lambda vc, c: vc.encode([PNGS[2]], hash_first=False), "c"),
    ("encode-with-rows", lambda vc, c: vc.encode([PNGS[3]], include_rows=True, pin=False), "d"),
    ("encode-again", lambda vc, c: vc.encode([PNGS[0], PNGS[2]]), None),
    ("encode-not-an-image", lambda vc, c: vc.encode([b"not an image"]), "bad"),
    ("encode-a-hash", lambda vc, c: vc.encode([c["a"][0].hash]), None),
    ("encode-a-missing-file", lambda vc, c: vc.encode(["/nonexistent/visenc.png"]), None),
    ("lookup", lambda vc, c: vc.lookup([c["a"][0].hash, MISSING, c["b"][0].hash], wait=True), None),
    ("lookup-with-rows", lambda vc, c: vc.lookup([c["c"][0].hash], include_rows=True, pin=False), None),
    ("lookup-a-bad-hash", lambda vc, c: vc.lookup(["not-a-hash"]), None),
    ("fetch", lambda vc, c: vc.fetch(c["a"][0]), None),
    ("fetch-range", lambda vc, c: vc.fetch(c["b"][0], 2, 5), None),
    ("fetch-by-hash", lambda vc, c: vc.fetch(c["c"][0].hash, 0, 4), None),
    ("fetch-unknown", lambda vc, c: vc.fetch(MISSING), None),
    ("fetch-outside", lambda vc, c: vc.fetch(c["a"][0].hash, 0, 10_000), None),
    ("fetch-an-error-handle", lambda vc, c: vc.fetch(c["bad"][0]), None),
    ("fetch-many", lambda vc, c: vc.fetch_many([RowRange.of(c["a"][0].hash, 1, 3), RowRange(c["d"][0].hash)]), None),
    ("fetch-many-unknown", lambda vc, c: vc.fetch_many([RowRange(MISSING, 0, 1)]), None),
    ("fetch-chunk", lambda vc, c: vc.fetch_chunk(placed(c, "a", "c"), 0, 64), None),
    ("fetch-chunk-dense", lambda vc, c: vc.fetch_chunk(placed(c, "c"), 2, 40, dense=True), None),
    ("fetch-chunk-into", lambda vc, c: vc.fetch_chunk(placed(c, "a"), 3, 11, out=np.full((8, 256), 7.0, "f4")), None),
    ("fetch-chunk-wrong-out", lambda vc, c: vc.fetch_chunk(placed(c, "a"), 0, 8, out=np.empty((8, 256), "f4")), None),
    (
        "fetch-chunk-past-images",
        lambda vc, c: vc.fetch_chunk(placed(c, "a"), 90, 94, out=np.ones((4, 256), "f4"), dense=True),
        None,
    ),
    ("fetch-chunk-nothing-known", lambda vc, c: vc.fetch_chunk([], 0, 4), None),
    ("fetch-chunk-an-error-handle", lambda vc, c: vc.fetch_chunk([ImagePlacement(c["bad"][0], 0, 4)], 0, 4), None),
    ("unpin", lambda vc, c: vc.unpin(vc_encoded(c)), None),
    ("hand-back", lambda vc, c: vc.hand_back(vc_encoded(c)), None),
]


def vc_encoded(c: dict[str, Any]) -> list[Handle]:
    return [c[k][0] for k in "abcd"]


def normal(value: Any, text: bool = True) -> Any:
    """What two runs must agree on: no lease ids, ports or namespaces (``text``: and an error's words)."""
    if isinstance(value, BaseException):
        fields = ("status_code", "kind", "reason", "connecting", "timed_out", "hash", "url")
        attrs = {f: getattr(value, f) for f in fields if hasattr(value, f) and (text or f != "reason")}
        said = re.sub(r":\d{4,5}\b", ":PORT", str(value)) if text else None
        return ("raised", type(value).__name__, said, attrs)
    if isinstance(value, Handle):
        wire = {**value.to_wire(), "lease": value.lease is not None}
        return ("handle", wire, None if value.rows is None else normal(value.rows))
    if isinstance(value, np.ndarray):
        return (
            "rows",
            value.shape,
            str(value.dtype),
            hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest(),
        )
    if isinstance(value, list | tuple):
        return [normal(v) for v in value]
    return value


async def attempt(fn: Callable[[], Any]) -> tuple[Any, list[str]]:
    """``fn()``'s result (awaited if it is a coroutine) or exception, and the warnings it gave."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            got = fn()
            if inspect.isawaitable(got):
                got = await asyncio.wait_for(got, PATIENCE_S)
        except (Exception, asyncio.TimeoutError) as e:
            got = e
    return got, [str(w.message).replace("AsyncClient", "Client") for w in seen]


async def outcome(fn: Callable[[], Any], text: bool = True) -> Any:
    got, said = await attempt(fn)
    return normal(got, text), said


async def run_ops(vc: Any) -> dict[str, Any]:
    context: dict[str, Any] = {}
    results = {}
    for name, op, key in OPS:
        got, said = await attempt(lambda: op(vc, context))  # noqa: B023 (awaited at once)
        results[name] = (normal(got), said)
        if key is not None:
            assert not isinstance(got, BaseException), (name, got)
            context[key] = got
    return results


@pytest.fixture(scope="module")
def served(redis_url: str) -> Iterator[str]:
    with serve_process("--max-wait-ms", "1", "--redis-url", redis_url) as url:
        yield url


@pytest.mark.parametrize("shared_memory", [False, True, "auto"], ids=["http", "shm", "auto"])
async def test_every_operation_answers_alike_in_both_twins(served: str, shared_memory: Any) -> None:
    tag = {False: "http", True: "shm", "auto": "auto"}[shared_memory]
    with Client(served, namespace=f"sync-{tag}", shared_memory=shared_memory) as sync:
        by_sync = await run_ops(sync)
        settled = sync.shared_memory
    async with AsyncClient(f"{served}/v1", namespace=f"async-{tag}", shared_memory=shared_memory) as twin:
        by_async = await run_ops(twin)
        assert twin.shared_memory == settled == (shared_memory is not False)
    for name, _, _ in OPS:
        assert by_sync[name] == by_async[name], name
    kinds = {
        name: got[0][1] if isinstance(got[0], tuple) and got[0][0] == "raised" else "ok"
        for name, got in by_sync.items()
    }
    assert kinds["fetch-unknown"] == "NotFoundError" and kinds["fetch-outside"] == "BadRequestError"
    assert kinds["fetch-an-error-handle"] == kinds["fetch-chunk-an-error-handle"] == "ImageEncodeError"
    assert "lookup" in by_sync["encode-a-hash"][0][2]
    assert [k for k, v in kinds.items() if v != "ok"] == [
        "encode-a-hash",
        "encode-a-missing-file",
        "fetch-unknown",
        "fetch-outside",
        "fetch-an-error-handle",
        "fetch-many-unknown",
        "fetch-chunk-wrong-out",
        "fetch-chunk-nothing-known",
        "fetch-chunk-an-error-handle",
    ]


def test_the_twins_have_the_same_operations_and_the_script_runs_each() -> None:
    def public(cls: type) -> dict[str, inspect.Signature]:
        return {n: inspect.signature(f) for n, f in vars(cls).items() if not n.startswith("_") and callable(f)}

    sync, twin = public(Client), public(AsyncClient)
    sync.pop("close"), twin.pop("aclose")
    assert sync == twin
    script = inspect.getsource(inspect.getmodule(run_ops))  # type: ignore[arg-type]
    assert not [n for n in sync if f"vc.{n}(" not in script]


class Held:
    """``socket.getaddrinfo`` held on one name (a name server that never answers) until the test ends."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.answer = threading.Event()
        resolve = socket.getaddrinfo

        def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
            if host == HELD:
                self.answer.wait()
                raise socket.gaierror(socket.EAI_AGAIN, "the name server did not answer")
            return resolve(host, *args, **kwargs)

        monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


async def test_unreachable_servers_fail_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused port and a name server that never answers cost each twin its connect timeout, the same way."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        refused = f"http://127.0.0.1:{s.getsockname()[1]}"
    held = Held(monkeypatch)
    try:
        for url in (refused, f"http://{HELD}:8000"):
            with Client(url, connect_timeout=0.3, timeout=60) as sync:
                by_sync = [await outcome(sync.model), await outcome(lambda: sync.fetch(MISSING))]
            async with AsyncClient(url, connect_timeout=0.3, timeout=60) as twin:
                by_async = [await outcome(twin.model), await outcome(lambda: twin.fetch(MISSING))]
            assert by_sync == by_async, url
            assert all(got[0][1] == "TransportError" and got[0][3]["connecting"] for got in by_sync)
    finally:
        held.answer.set()


async def test_the_redis_readers_answer_alike(served: str, redis_url: str) -> None:
    with Client(served, namespace="redis") as vc:
        (h,) = vc.encode([PNGS[1]])
        fingerprint = vc.model()["fingerprint"]
    raw = redis.Redis.from_url(redis_url)
    wait_until(lambda: raw.exists(entry_key("redis", fingerprint, h.hash)), what="the write-through")
    raw.close()
    reads: list[Callable[[Any], Any]] = [
        lambda r: r.fetch(h),
        lambda r: r.fetch(h.hash, 2, 6),
        lambda r: r.fetch_bytes(h, 0, 1),
        lambda r: r.info(h.hash),
        lambda r: r.fetch(MISSING),
        lambda r: r.fetch(h, 0, 10_000),
    ]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"redis://:secret@127.0.0.1:{s.getsockname()[1]}/0"
    for url, cluster in ((redis_url, False), (dead, False), (dead, True)):
        options = {"fingerprint": fingerprint, "namespace": "redis", "cluster": cluster, **REDIS_OPTIONS}
        sync = await outcome(lambda: type(RedisRows.from_url(url, **options)).__name__)  # noqa: B023
        twin = await outcome(lambda: type(AsyncRedisRows.from_url(url, **options)).__name__.removeprefix("Async"))  # noqa: B023
        assert sync == twin, (url, cluster)
        rows = RedisRows.from_url(url, **options)
        arows = AsyncRedisRows.from_url(url, **options)
        for read in reads:  # redis-py words a refusal its own way in each (not compared)
            by_sync = await outcome(lambda: read(rows), text=False)  # noqa: B023
            assert by_sync == await outcome(lambda: read(arows), text=False), (url, cluster)  # noqa: B023
        rows.close()
        await arows.aclose()
