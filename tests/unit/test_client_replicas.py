"""The connector's sources (``visenc_client._sources.RowSources``): when a replica refuses, resets, hangs
on connect, never answers or cuts its answer short, the rows come from the next replica, then from the
shared index; a replica that failed is skipped for a while, then asked again; a replica that did not
answer at start-up is checked, and ``transport: auto`` decided, once it answers. A real ``visenc serve``
with a real ``redis-server``, and real dead sockets (``tests.support.dead_ends``).
"""

from __future__ import annotations

import contextlib
import http.server
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import msgpack
import pytest
import torch
from harness.images import png_bytes
from harness.paths import ROOT
from harness.processes import redis_process, serve_subprocess, stop_process
from harness.waits import free_port, wait_ready, wait_until
from tests.support.dead_ends import NOT_VISENC, Blackhole, Peer, refused

from visenc_client import Client
from visenc_client._backoff import Backoff
from visenc_client._sources import Absent, RowSources, Served, Want, torch_rows
from visenc_client.format import MSGPACK, ROWS_MEDIA_TYPE, frame_head, split_frame

#: far above every bound a test sets: a call that took this long waited for the wrong timeout
SLOW_S = 30.0
#: the bounds the sources are given here (the connector's defaults are 1 s)
QUICK = {"timeout_s": 5.0, "connect_timeout_s": 0.5, "answer_timeout_s": 0.5}
#: a back-off that no test outlives by waiting (one that must end is ended by the test)
BACKOFF_S = 600.0


@pytest.fixture(scope="module")
def visenc() -> Iterator[dict[str, Any]]:
    """A real visenc (the default tiny tower) with its index in a real Redis; two images encoded."""
    with redis_process() as (redis_url, _):
        with serve_subprocess("--redis-url", redis_url, "--max-wait-ms", "1") as (url, _):
            images = [png_bytes(i, 64 + 8 * i, 48) for i in range(2)]
            with Client(url) as vc:
                handles = vc.encode(images)
                info = vc.model()
                rows = {h.hash: torch_rows(vc.fetch(h), h.dtype) for h in handles}
            yield {"url": url, "redis": redis_url, "info": info, "handles": handles, "rows": rows}


def served(visenc: dict[str, Any], fingerprint: bool = False) -> Served:
    info = visenc["info"]
    return Served(int(info["hidden_size"]), str(info["image_loader"]), info["fingerprint"] if fingerprint else None)


def wants(visenc: dict[str, Any]) -> dict[str, Want]:
    return {h.hash: Want(h.num_tokens, None) for h in visenc["handles"]}


def assert_rows(visenc: dict[str, Any], got: dict[str, Any]) -> None:
    assert set(got) == set(visenc["rows"])
    for identifier, rows in got.items():
        assert isinstance(rows, torch.Tensor), rows
        assert torch.equal(rows, visenc["rows"][identifier])


@contextlib.contextmanager
def dead(kind: str) -> Iterator[tuple[str, Any]]:
    """(URL, the peer or ``None``) of a replica that fails as ``kind`` says."""
    if kind == "refused":
        yield refused(), None
    elif kind == "connect-hangs":
        with Blackhole() as hole:
            yield hole.url, hole
    else:
        with Peer(kind) as peer:
            yield peer.url, peer


@pytest.mark.parametrize("kind", ["connect-hangs", "silent"])
def test_a_replica_that_hangs_costs_its_timeout_once_per_back_off(visenc: dict[str, Any], kind: str) -> None:
    with dead(kind) as (url, peer):
        # a back-off far longer than any pause of a loaded host; its end is then brought forward
        sources = RowSources([url, visenc["url"]], served=served(visenc), backoff_s=BACKOFF_S, **QUICK)
        try:
            started = time.monotonic()
            assert_rows(visenc, sources.obtain(wants(visenc), wait=False))
            assert time.monotonic() - started < SLOW_S
            assert sources.backoff.skipped_for(url) > 0  # skipped for a while ...
            seen = peer.connections if isinstance(peer, Peer) else 0
            assert_rows(visenc, sources.obtain(wants(visenc), wait=False))
            if isinstance(peer, Peer):
                assert peer.connections == seen  # ... not asked meanwhile ...
            sources.backoff._until[url] = 0.0  # the back-off has passed
            assert_rows(visenc, sources.obtain(wants(visenc), wait=False))
            if isinstance(peer, Peer):
                assert peer.connections > seen  # ... then asked again
            assert sources.backoff.skipped_for(url) > BACKOFF_S  # failed again: a longer back-off
        finally:
            sources.close()


@pytest.mark.parametrize("kind", ["refused", "reset", "cut"])
def test_a_replica_that_fails_at_once_is_asked_again_at_once(visenc: dict[str, Any], kind: str) -> None:
    """Asking it again costs nothing, and finds it as soon as it is back: it is never skipped."""
    with dead(kind) as (url, peer):
        sources = RowSources([url, visenc["url"]], served=served(visenc), **QUICK)
        try:
            for round_ in range(3):
                seen = peer.connections if isinstance(peer, Peer) else 0
                assert_rows(visenc, sources.obtain(wants(visenc), wait=False))
                assert sources.backoff.skipped_for(url) == 0
                assert sources.backoff.unreachable == round_ + 1
                if isinstance(peer, Peer):
                    assert peer.connections > seen
        finally:
            sources.close()


def pinned_bytes(url: str) -> int:
    """The bytes the replica at ``url`` holds pinned for readers (``/readyz``)."""
    index = httpx.get(f"{url}/readyz", timeout=30).json()["index"]
    return int(index.get("memory", index)["pinned_bytes"])


@pytest.mark.parametrize("transport", ["http", "shm"])
def test_the_connectors_reads_leave_no_pin_after_a_dead_first_replica(visenc: dict[str, Any], transport: str) -> None:
    """Rows inline (HTTP) or a look-up then a shared-memory read naming its lease: the replica that
    answered holds no pin afterwards, waiting or not. The control: a look-up that pins and is never
    read leaves one, until its read."""
    assert pinned_bytes(visenc["url"]) == 0
    sources = RowSources([refused(), visenc["url"]], served=served(visenc), transport=transport, **QUICK)
    try:
        for wait in (False, True):
            assert_rows(visenc, sources.obtain(wants(visenc), wait=wait))
            assert pinned_bytes(visenc["url"]) == 0
    finally:
        sources.close()
    with Client(visenc["url"]) as vc:
        handles = vc.lookup([h.hash for h in visenc["handles"]])
        assert pinned_bytes(visenc["url"]) > 0
        for h in handles:
            vc.fetch(h)
    assert pinned_bytes(visenc["url"]) == 0


def test_rows_come_from_redis_when_no_replica_answers(visenc: dict[str, Any]) -> None:
    with Blackhole() as hole:
        sources = RowSources(
            [refused(), hole.url], served=served(visenc, fingerprint=True), redis_url=visenc["redis"], **QUICK
        )
        try:
            assert_rows(visenc, sources.obtain(wants(visenc), wait=False))
        finally:
            sources.close()


def test_nothing_answers_every_image_is_absent_saying_why(visenc: dict[str, Any]) -> None:
    first, dead_redis = refused(), f"redis://127.0.0.1:{free_port()}/0"
    with Blackhole() as hole:
        sources = RowSources(
            [first, hole.url],
            served=served(visenc, fingerprint=True),
            redis_url=dead_redis,
            backoff_s=BACKOFF_S,
            **QUICK,
        )
        try:
            started = time.monotonic()
            got = sources.obtain(wants(visenc), wait=False)
            assert time.monotonic() - started < SLOW_S
            for answer in got.values():
                assert isinstance(answer, Absent)
                for name in (first, hole.url, dead_redis):
                    assert name in str(answer)
            again = sources.obtain(wants(visenc), wait=False)  # the replica that hung is skipped
            assert all(f"{hole.url}: not asked" in str(a) for a in again.values())
        finally:
            sources.close()


def _within(limit_s: float, fn: Callable[[], Any]) -> Any:
    """``fn()``'s result, failing the test if it has not returned after ``limit_s``."""
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.update(got=fn()), daemon=True)
    thread.start()
    thread.join(limit_s)
    assert not thread.is_alive(), f"still waiting after {limit_s} s"
    return box["got"]


@pytest.mark.parametrize("kind", ["connect-hangs", "silent"])
def test_a_redis_that_hangs_costs_one_timeout_per_back_off(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The index holds ready rows only: a read there is bounded as a look-up that does not wait
    (``answer_timeout_s``, never ``timeout_s``, set here past the test's patience), one connect a
    look-up (a timeout is not retried), then skipped for the back-off."""
    connects: list[object] = []
    resolve = socket.getaddrinfo

    def counted(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        connects.append(port)
        return resolve(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", counted)
    with dead(kind) as (url, peer):
        redis_url = url.replace("http://", "redis://") + "/0"
        quick = {**QUICK, "timeout_s": 3 * SLOW_S}
        sources = RowSources([], served=Served(8, "any", "f" * 32), redis_url=redis_url, backoff_s=BACKOFF_S, **quick)
        try:
            got = _within(SLOW_S, lambda: sources.obtain({"a" * 64: Want(1, None)}, wait=False))
            assert "redis: " in str(got["a" * 64]) and "Timeout" in str(got["a" * 64]), got
            assert connects.count(peer.port) == 1  # one connect, not retried
            if isinstance(peer, Peer):
                assert peer.connections == 1
            again = sources.obtain({"a" * 64: Want(1, None)}, wait=False)
            assert "redis: not asked" in str(again["a" * 64])
        finally:
            sources.close()


def test_a_replica_that_answers_an_error_is_not_skipped(visenc: dict[str, Any]) -> None:
    """A 4xx/5xx is an answer, not an unreachable replica: it is asked again at once."""
    sources = RowSources([visenc["url"]], served=served(visenc), namespace="no such namespace?", **QUICK)
    try:
        sources.obtain({"not-a-hash": Want(1, None)}, wait=False)
        assert sources.backoff.skipped_for(visenc["url"]) == 0
    finally:
        sources.close()


def test_a_replica_started_later_is_checked_and_chooses_shared_memory(visenc: dict[str, Any]) -> None:
    """``transport: auto`` with visenc down at start-up: once it answers, it is checked and, being on
    this host, read over shared memory (before, the look-ups asked for rows over HTTP forever)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    sources = RowSources([url], served=served(visenc), transport="auto", backoff_s=0.1, **QUICK)
    try:
        sources.check_at_start()
        replica = sources.replicas[0]
        assert not replica.checked and not replica.prompt.shared_memory
        with visenc_on(port, visenc["redis"]):
            wait_until(lambda: sources.backoff.skipped_for(url) == 0, 10, "the back-off ends")
            assert_rows(visenc, sources.obtain(wants(visenc), wait=False))  # from the shared index, via visenc
        assert replica.checked and replica.prompt.shared_memory and replica.waiting.shared_memory
    finally:
        sources.close()


JSON_LIST = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n[]"


@pytest.mark.parametrize("reply", [NOT_VISENC, JSON_LIST], ids=["html", "json-list"])
def test_a_url_that_answers_something_else_is_passed_over(visenc: dict[str, Any], reply: bytes) -> None:
    """A first URL that answers 200 with what no visenc answers (an ingress's page while visenc starts):
    the engine still starts (no exception from the start-up check), and the rows come from the next
    replica (before, the unreadable answer escaped the look-up: no other source was asked)."""
    with Peer("answer", reply=reply) as peer:
        sources = RowSources([peer.url, visenc["url"]], served=served(visenc), **QUICK)
        try:
            sources.check_at_start()
            assert [r.checked for r in sources.replicas] == [False, True]
            assert_rows(visenc, sources.obtain(wants(visenc), wait=False))
            assert peer.connections >= 2  # asked at start-up and by the look-up
        finally:
            sources.close()


def test_a_replica_of_another_model_is_refused_when_it_first_answers(visenc: dict[str, Any]) -> None:
    other = Served(int(visenc["info"]["hidden_size"]) + 1, str(visenc["info"]["image_loader"]))
    sources = RowSources([visenc["url"]], served=other, **QUICK)
    try:
        got = sources.obtain(wants(visenc), wait=False)
        assert all("serves another model" in str(a) for a in got.values())
        assert sources.replicas[0].refused is not None
        with pytest.raises(ValueError, match="serves another model"):
            RowSources([visenc["url"]], served=other, **QUICK).check_at_start()
    finally:
        sources.close()


class Reordering(http.server.BaseHTTPRequestHandler):
    """A replica that relays to a real visenc (``upstream``) but answers a look-up's items in reverse
    order: each handle, with its rows, is whole and true, only not where it was asked."""

    upstream = ""
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self._relay(httpx.get(self.upstream + self.path, headers={"accept": self.headers["accept"] or "*/*"}))

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        headers = {k: self.headers[k] for k in ("content-type", "accept")}
        answer = httpx.post(self.upstream + self.path, content=body, headers=headers, timeout=30)
        kind = answer.headers.get("content-type", "")
        if self.path != "/v1/encode":  # a fetch: one image's rows, as asked
            pass
        elif kind.startswith(MSGPACK):  # handles alone (their rows then read from shared memory)
            handles = msgpack.unpackb(answer.content)
            handles["items"].reverse()
            answer = httpx.Response(200, headers={"content-type": MSGPACK}, content=msgpack.packb(handles))
        elif kind.startswith(ROWS_MEDIA_TYPE):
            items, rows, at = [], [], 0
            for item, view in reversed(split_frame(answer.content)):
                if view is not None:
                    item = {**item, "offset": at}
                    rows.append(bytes(view))
                    at += len(view)
                items.append(item)
            answer = httpx.Response(
                200, headers={"content-type": ROWS_MEDIA_TYPE}, content=frame_head(items) + b"".join(rows)
            )
        self._relay(answer)

    def _relay(self, answer: httpx.Response) -> None:
        self.send_response(answer.status_code)
        self.send_header("content-type", answer.headers.get("content-type", "application/octet-stream"))
        self.send_header("content-length", str(len(answer.content)))
        self.end_headers()
        self.wfile.write(answer.content)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("transport", ["http", "shm"])
def test_rows_answered_for_another_image_are_never_taken(visenc: dict[str, Any], transport: str) -> None:
    """A replica whose answer lists the images asked in another order, two of one size (the same row
    count and grid): their rows come from the next replica, each its own image's (before, each image got
    the other's rows)."""
    images = [png_bytes(i, 80, 56) for i in (7, 8)]
    with Client(visenc["url"]) as vc:
        handles = vc.encode(images)
        truth = {h.hash: torch_rows(vc.fetch(h), h.dtype) for h in handles}
    assert len({(h.num_tokens, h.grid_thw) for h in handles}) == 1 and not torch.equal(*truth.values())
    Reordering.upstream = visenc["url"]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Reordering)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    urls = [f"http://127.0.0.1:{server.server_port}", visenc["url"]]
    sources = RowSources(urls, served=served(visenc), transport=transport, **QUICK)
    try:
        got = sources.obtain({h.hash: Want(h.num_tokens, None) for h in handles}, wait=False)
        for identifier, rows in got.items():
            assert isinstance(rows, torch.Tensor), rows
            assert torch.equal(rows, truth[identifier])
    finally:
        sources.close()
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def visenc_on(port: int, redis_url: str) -> Iterator[str]:
    """A ``visenc serve`` on ``port``, sharing ``redis_url``'s index (so it holds the images)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "service"), str(ROOT / "clients"), str(ROOT)])}
    command = ["-m", "visenc", "serve", "--host", "127.0.0.1", "--port", str(port), "--redis-url", redis_url]
    proc = subprocess.Popen([sys.executable, *command], env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        yield url
    finally:
        stop_process(proc)


def test_backoff_doubles_and_resets() -> None:
    backoff = Backoff(first_s=10.0, max_s=25.0)
    backoff.done("a", reached=False, costly=False)  # refused at once: nothing to skip
    assert backoff.usable("a") and backoff.skipped_for("a") == 0 and backoff.unreachable == 1
    assert backoff.usable("a")
    backoff.done("a", reached=False)
    assert not backoff.usable("a") and 9 < backoff.skipped_for("a") <= 10
    backoff._until["a"] = 0.0  # the back-off has passed: one caller probes, the others still skip
    assert backoff.usable("a") and not backoff.usable("a")
    backoff.done("a", reached=False)
    assert 19 < backoff.skipped_for("a") <= 20
    backoff._until["a"] = 0.0
    assert backoff.usable("a")
    backoff.done("a", reached=False)
    assert 24 < backoff.skipped_for("a") <= 25  # capped
    backoff._until["a"] = 0.0
    assert backoff.usable("a")
    backoff.done("a", reached=True)
    assert backoff.usable("a") and backoff.usable("a") and backoff.skipped_for("a") == 0
