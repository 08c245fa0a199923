"""Peers that fail the way a real network does, on real loopback sockets, for the client's and the
connector's failure paths:

- ``refused()``: a closed port (``ECONNREFUSED`` at once, as a killed process leaves it);
- ``UNRESOLVABLE``: a host name that never resolves (``.invalid``, RFC 2606);
- ``Blackhole()``: a listening socket whose accept queue is full, so a connect hangs (SYNs dropped, as
  behind a firewall that drops packets or on a host that is gone);
- ``Peer("silent")``: accepts and never answers (a wedged process: the kernel completes the handshake);
- ``Peer("reset")``: reads the request and resets the connection (RST) without an answer;
- ``Peer("cut")``: answers a head whose ``Content-Length`` promises more than it sends, then closes
  (the process died mid-body); ``reply`` is the head and the bytes sent (HTTP by default, or RESP for
  Redis).

Each counts the connections it saw (``connections``) and names its address (``url``, ``port``).
"""

from __future__ import annotations

import socket
import struct
import threading
from typing import Any

from tests.support.waits import free_port

#: a host name that never resolves (RFC 2606 reserves ``.invalid``)
UNRESOLVABLE = "visenc-nowhere.invalid"

#: an HTTP answer that stops 90 bytes short of its ``Content-Length``: a rows frame, or the rows of one image
CUT_HTTP = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/x-visenc-rows\r\ncontent-length: 100\r\n"
    b"x-visenc-shape: 25,1\r\nx-visenc-dtype: float32\r\n\r\n" + struct.pack("<I", 40) + b"\x00" * 6
)
#: a Redis bulk string that stops short of its length
CUT_RESP = b"$100\r\n" + b"\x00" * 10


def refused() -> str:
    """The URL of a loopback port nothing listens on."""
    return f"http://127.0.0.1:{free_port()}"


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
        for _ in range(64):  # until a connect hangs: the queue is full
            probe = socket.socket()
            probe.settimeout(0.3)
            try:
                probe.connect(("127.0.0.1", self.port))
            except TimeoutError:
                probe.close()
                return self
            self._fill.append(probe)
        raise RuntimeError("could not fill the accept queue of a listening socket")

    def __exit__(self, *exc: object) -> None:
        for s in self._fill:
            s.close()
        self._sock.close()


class Peer:
    """A thread that accepts connections on a free loopback port and fails each as ``mode`` says
    (``silent``, ``reset`` or ``cut``; see the module docstring)."""

    def __init__(self, mode: str, *, reply: bytes = CUT_HTTP) -> None:
        assert mode in ("silent", "reset", "cut"), mode
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
                else:
                    conn.sendall(self.reply)
                    conn.shutdown(socket.SHUT_WR)  # the bytes, then the end: no more will come
                    while conn.recv(1 << 16):  # until the client hangs up (unread bytes would reset)
                        pass
            except OSError:
                pass
            conn.close()
