"""Large rows bodies (``api/sender.py``), under real uvicorn on loopback, written by the loop while it writes no
other and by threads while it does: every byte in order, the connection kept alive after, a caller gone or
stalled mid-body costs only its connection."""

from __future__ import annotations

import http.client
import socket
import threading
import time

import pytest
import uvicorn
from harness.waits import free_port

from visenc.api import sender
from visenc.api.codec import ChunksResponse

BODY = bytes(range(256)) * (48 << 12)  # 48 MiB (more than loopback buffers hold), each byte known


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    size, *more = [int(n) for n in scope["path"].strip("/").split("/") if n]  # /SIZE, or /SIZE/COUNT/SMALL
    views = [memoryview(BODY)[:size]] + ([memoryview(BODY)[: more[1]]] * more[0] if more else [])
    parts = [b"head", *views] if size else [b"small body"]
    await ChunksResponse(parts, "application/octet-stream")(scope, receive, send)


class Held:
    """A caller that asks for a large body and reads only its start: the loop writes that body, and keeps
    what the socket cannot take, until this caller reads or goes."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.settimeout(30)
        self.sock.sendall(f"GET /{len(BODY)} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
        self.data = bytearray(self.sock.recv(4096))
        assert self.data.startswith(b"HTTP/1.1 200")

    def body(self) -> bytes:
        """The rest of the answer, read now: its body."""
        start = self.data.index(b"\r\n\r\n") + 4
        while len(self.data) < start + 4 + len(BODY) and (chunk := self.sock.recv(1 << 20)):
            self.data += chunk
        return bytes(self.data[start:])

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(params=[("uvloop", "idle"), ("asyncio", "idle"), ("uvloop", "busy"), ("asyncio", "busy")])
def served(request, monkeypatch):
    """(port, bodies sent from a thread, whether the loop is busy writing another caller's body) of uvicorn
    with ``RowsProtocol`` on the given loop."""
    loop, mode = request.param
    sent: list[int] = []
    real = sender.send_all

    def counted(sock, body):
        sent.append(len(body))
        real(sock, body)

    monkeypatch.setattr(sender, "send_all", counted)
    monkeypatch.setattr(sender.LoopBody, "current", None)
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, http=sender.RowsProtocol, loop=loop)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    holder = Held(port) if mode == "busy" else None
    yield port, sent, holder is not None
    if holder is not None:
        holder.close()
    server.should_exit = True
    thread.join(10)


def get(conn: http.client.HTTPConnection, size: int) -> bytes:
    conn.request("GET", f"/{size}")
    response = conn.getresponse()
    assert response.status == 200
    return response.read()


def test_a_large_body_comes_whole_and_in_order_and_the_connection_is_kept(served):
    port, sent, busy = served
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    for size in (len(BODY), 3 << 20):
        assert get(conn, size) == b"head" + BODY[:size]
    assert get(conn, 0) == b"small body"  # the same connection, a body the loop writes itself
    # each body left before the next was asked for: the loop writes them, unless it is busy with another's
    assert sent == ([len(BODY), 3 << 20] if busy else [])
    conn.close()


def test_a_body_asked_for_while_the_loop_writes_another_is_sent_by_a_thread(served):
    port, sent, busy = served
    first = Held(port)  # a second one, where the loop was busy already: a thread sends it
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    assert get(conn, 3 << 20) == b"head" + BODY[: 3 << 20]
    assert sent == ([len(BODY), 3 << 20] if busy else [3 << 20])
    assert first.body() == b"head" + BODY  # the held body, whole, at last
    first.close()
    assert get(conn, 2 << 20) == b"head" + BODY[: 2 << 20]
    conn.close()


def test_many_callers_at_once_each_get_their_own_body(served):
    port, sent, busy = served
    sizes = [(1 << 20) + 4096 * i for i in range(12)]
    got: dict[int, bytes] = {}

    def one(size: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        got[size] = get(conn, size)
        conn.close()

    threads = [threading.Thread(target=one, args=(s,)) for s in sizes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert {s: len(b) for s, b in got.items()} == {s: s + 4 for s in sizes}
    assert all(got[s] == b"head" + BODY[:s] for s in sizes)
    assert set(sent) <= set(sizes) and len(set(sent)) == len(sent)  # each body once, by a thread or the loop
    if busy:
        assert sorted(sent) == sizes


def test_a_caller_gone_mid_body_leaves_the_server_answering(served):
    port, _, _ = served
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(f"GET /{len(BODY)} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        # closed with most of the body unread: the send fails, the loop or the pool thread is free again
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    assert get(conn, len(BODY)) == b"head" + BODY
    conn.close()


@pytest.mark.parametrize("connection", ["", "connection: close\r\n"], ids=["kept", "closed after"])
def test_a_caller_that_reads_nothing_loses_its_connection_after_the_stall_bound(served, monkeypatch, connection):
    port, _, _ = served
    monkeypatch.setattr(sender, "STALL_S", 0.5)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(f"GET /{len(BODY)} HTTP/1.1\r\nhost: x\r\n{connection}\r\n".encode())
        time.sleep(2.0)  # past the bound: the server gave up on this connection
        sock.settimeout(10)
        received = 0
        while chunk := sock.recv(1 << 20):
            received += len(chunk)
        assert received < len(BODY)  # cut short, not hung
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    assert get(conn, 2 << 20) == b"head" + BODY[: 2 << 20]
    conn.close()


def test_a_bad_request_pipelined_behind_a_large_body_is_answered_after_that_body(served):
    port, _, _ = served
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(30)
        sock.sendall(f"GET /{len(BODY)} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
        data = bytearray(sock.recv(4096))  # the body has begun; most of it cannot have left yet
        sock.sendall(b"NOT HTTP \x00\r\n\r\n")
        time.sleep(0.5)  # the server has read the bad request while the body is still being sent
        while chunk := sock.recv(1 << 20):
            data += chunk
    start = data.index(b"\r\n\r\n") + 4
    assert data[start : start + 4 + len(BODY)] == b"head" + BODY
    assert data[start + 4 + len(BODY) :].startswith(b"HTTP/1.1 400")


def test_a_caller_reading_slowly_but_steadily_gets_the_whole_body(served, monkeypatch):
    port, _, _ = served
    monkeypatch.setattr(sender, "STALL_S", 1.0)  # the bound is on a caller reading nothing, not on the body
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(30)
        sock.sendall(f"GET /{len(BODY)} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
        data = bytearray(sock.recv(4096))
        start = data.index(b"\r\n\r\n") + 4
        while len(data) < start + 4 + len(BODY) and (chunk := sock.recv(1 << 20)):
            data += chunk
            time.sleep(0.05)  # 48 reads at least: the body takes longer than the bound, no pause comes near it
    assert data[start:] == b"head" + BODY


def test_a_caller_reading_a_large_view_and_smaller_ones_slowly_but_steadily_gets_them_all(served, monkeypatch):
    port, _, _ = served
    monkeypatch.setattr(sender, "STALL_S", 0.5)  # uvicorn writes each small view as the last leaves: no stall
    size, count, small = 16 << 20, 12, 900_000
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        sock.settimeout(30)
        sock.sendall(f"GET /{size}/{count}/{small} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
        data = bytearray(sock.recv(4096))
        start = data.index(b"\r\n\r\n") + 4
        while len(data) < start + 4 + size + count * small and (chunk := sock.recv(1 << 16)):
            data += chunk
            time.sleep(0.005)
    assert data[start:] == b"head" + BODY[:size] + BODY[:small] * count
