"""Peers that fail the way a real network does, on real loopback sockets, for the client's and the
connector's failure paths:
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from typing import Any

from harness.waits import free_port

#: a host name that never resolves (RFC 2606 reserves ``.invalid``)
UNRESOLVABLE = "visenc-nowhere.invalid"

#: an HTTP answer that stops 90 bytes short of its ``Content-Length``: a rows frame, or the rows of one image
CUT_HTTP = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/x-visenc-rows\r\ncontent-length: 100\r\n"
    b"x-visenc-shape: 25,1\r\nx-visenc-dtype: float32\r\n\r\n" + struct.pack("<I", 40) + b"\x00" * 6
)
#: a Redis bulk string that stops short of its length
CUT_RESP = b"$100\r\n" + b"\x00" * 10
#: a whole HTTP answer of a server that is not visenc: 200 with a page (an ingress's default backend)
NOT_VISENC = b"HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: 20\r\n\r\n<html>nothing</html>"


def refused() -> str:
    """The URL of a loopback port nothing listens on."""
    return f"http://127.0.0.1:{free_port()}"


def fill_accept_queue(port: int) -> list[socket.socket]:
    """Connections that fill the accept queue of a socket listening on ``port`` that never accepts,
    connected until one hangs (keep them open: the queue stays full)."""
    held = []
    for _ in range(64):
        probe = socket.socket()
        probe.settimeout(0.3)
        try:
            probe.connect(("127.0.0.1", port))
        except TimeoutError:
            probe.close()
            return held
        held.append(probe)
    raise RuntimeError("could not fill the accept queue of a listening socket")


class Blackhole:
    """A port whose connects hang: it listens with a backlog of 0 and never accepts, and its accept
    queue is filled at start, so the kernel drops every further SYN."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(0)
        self.port = int(self._sock.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._fill: list[socket.socket] = []

    def __enter__(self) -> Blackhole:
        self._fill = fill_accept_queue(self.port)
        return self

    def __exit__(self, *exc: object) -> None:
        for s in self._fill:
            s.close()
        self._sock.close()


class Peer:
    """A thread that accepts connections on a free loopback port and fails each as ``mode`` says
    (``silent``, ``reset``, ``cut``, ``stall`` or ``answer``; see the module docstring)."""

    def __init__(self, mode: str, *, reply: bytes = CUT_HTTP) -> None:
        assert mode in ("silent", "reset", "cut", "stall", "answer"), mode
        self.mode, self.reply = mode, reply
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self._sock.settimeout(0.1)
        self.port = int(self._sock.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.connections = 0
        self._held: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"peer-{mode}", daemon=True)

    def __enter__(self) -> Peer:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(10)
        for s in self._held:
            s.close()
        self._sock.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            if self.mode == "silent":
                self._held.append(conn)  # open, and never a byte back
                continue
            conn.settimeout(5)
            try:
                conn.recv(1 << 16)  # the request (its first bytes)
                if self.mode == "reset":
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                elif self.mode == "stall":
                    conn.sendall(self.reply)
                    self._held.append(conn)  # open, and not a byte more
                    continue
                else:
                    conn.sendall(self.reply)
                    conn.shutdown(socket.SHUT_WR)  # the bytes, then the end: no more will come
                    while conn.recv(1 << 16):  # until the client hangs up (unread bytes would reset)
                        pass
            except OSError:
                pass
            conn.close()


class Switch:
    """One loopback port whose behaviour ``set(mode)`` changes: ``forward`` (to ``upstream``),
    ``refused``, ``connect-hangs`` or ``silent``; ``connections`` counts what it accepted."""

    MODES = ("forward", "refused", "connect-hangs", "silent")

    def __init__(self, upstream: str) -> None:
        host, port = upstream.removeprefix("http://").rstrip("/").split(":")
        self.upstream = (host, int(port))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.mode = "refused"
        self.connections = 0
        self._listener: socket.socket | None = None
        self._held: list[socket.socket] = []
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> Switch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.set("refused")

    def set(self, mode: str) -> None:
        assert mode in self.MODES, mode
        self._close()
        self.mode = mode
        if mode == "refused":
            return
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        if mode == "connect-hangs":
            listener.listen(0)
            self._listener = listener
            self._held += fill_accept_queue(self.port)
            return
        listener.listen(64)
        listener.settimeout(0.1)
        self._listener = listener
        thread = threading.Thread(target=self._accept, args=(listener, mode), daemon=True)
        thread.start()
        self._threads.append(thread)

    def _accept(self, listener: socket.socket, mode: str) -> None:
        while self._listener is listener:
            try:
                conn, _ = listener.accept()
            except (TimeoutError, OSError):
                continue
            self.connections += 1
            if mode == "silent":
                self._held.append(conn)
                continue
            try:
                upstream = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                conn.close()
                continue
            upstream.settimeout(None)
            conn.settimeout(None)
            self._held += [conn, upstream]
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    def _close(self) -> None:
        listener, self._listener = self._listener, None
        for thread in self._threads:
            thread.join(5)
        self._threads.clear()
        if listener is not None:
            listener.close()
        held, self._held = self._held, []
        for s in held:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)  # wakes a relay thread blocked on it (a close alone would not)
            s.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy ``src`` to ``dst`` until either end closes."""
    with contextlib.suppress(OSError):
        while data := src.recv(1 << 16):
            dst.sendall(data)
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)
