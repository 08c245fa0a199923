"""The client's own TCP connections: a name look-up within the connect timeout, and sockets whose waits the
kernel bounds (``TimedSocket``)."""

from __future__ import annotations

import ipaddress
import socket
import struct
import sys
import threading
import time
from typing import Any

#: where the kernel bounds a blocking socket's waits (``SO_RCVTIMEO`` takes a ``struct timeval``)
KERNEL_TIMEOUTS = sys.platform.startswith(("linux", "darwin")) and hasattr(socket, "MSG_WAITALL")


def resolve(host: str, port: int, timeout_s: float | None) -> list[tuple]:
    """``getaddrinfo`` within ``timeout_s`` (``TimeoutError`` past it; the look-up's answer is then dropped)."""
    try:
        ipaddress.ip_address(host.strip("[]"))
        return socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
    except ValueError:
        pass
    if timeout_s is None:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    box: dict[str, object] = {}
    done = threading.Event()

    def look_up() -> None:
        try:
            box["infos"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as e:
            box["error"] = e
        done.set()

    threading.Thread(target=look_up, name="visenc-resolve", daemon=True).start()
    if not done.wait(timeout_s):
        raise TimeoutError(f"the name {host} was not resolved within {timeout_s} s")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["infos"]  # type: ignore[return-value]


class TimedSocket(socket.socket):
    """A TCP connection that blocks, its waits bounded by the kernel (``SO_RCVTIMEO``, ``SO_SNDTIMEO``), not by
    ``poll`` before each call: a view is read in one system call however its bytes arrive, so a caller's
    thread waits for the GIL once per body, not once per segment (in a busy process, up to the switch interval
    each time). A wait past the bound raises ``TimeoutError``, as a socket timeout does."""

    def bound(self, seconds: float | None) -> None:
        """Block from now on, each system call's waits bounded by ``seconds`` in all (``None``: unbounded); where
        the kernel refuses the bound, Python's timeout stays (and the socket reads as any other)."""
        self.settimeout(seconds)  # Python's check of the value, and the bound should the kernel refuse its own
        if seconds is not None:
            micros = max(round(seconds * 1e6), 1)  # a zero timeval means no bound at all
            try:
                size = len(self.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16))  # the kernel's timeval
                timeval = struct.pack("@qq" if size == 16 else "@ll", *divmod(micros, 1_000_000))  # tv_usec < 10**6
                self.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
                self.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
            except OSError:
                return
        self.settimeout(None)

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        try:
            return super().recv_into(buffer, nbytes, flags)
        except BlockingIOError:  # the kernel's bound passed (``SocketIO`` would take it for "no data yet")
            raise TimeoutError("timed out") from None

    def sendall(self, data: Any, flags: int = 0) -> None:
        try:
            super().sendall(data, flags)
        except BlockingIOError:
            raise TimeoutError("timed out") from None


def socket_class() -> type[socket.socket]:
    """``TimedSocket`` where the kernel bounds waits and ``socket.socket`` is the standard library's, as
    ``TimedSocket``'s base; else ``socket.socket``: a cooperative one (gevent's, patched in before or after
    this import) never blocks in the kernel, so only its own timeouts bound its waits."""
    plain = socket.socket
    kernel = KERNEL_TIMEOUTS and plain.__module__ == "socket" and TimedSocket.__bases__ == (plain,)
    return TimedSocket if kernel else plain


def create_connection(
    address: tuple[str, int], timeout: float | None = None, source_address: tuple[str, int] | None = None
) -> socket.socket:
    """``socket.create_connection`` whose ``timeout`` bounds the name look-up too."""
    timeout = timeout if isinstance(timeout, int | float) else None  # http.client's "no timeout given"
    deadline = None if timeout is None else time.monotonic() + timeout
    error: OSError = OSError(f"no address for {address[0]}")
    for family, kind, proto, _, addr in resolve(*address, timeout):
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise TimeoutError(f"connect to {address[0]} timed out")
        sock = socket_class()(family, kind, proto)
        try:
            sock.settimeout(left)
            if source_address is not None:
                sock.bind(source_address)
            sock.connect(addr)
            return sock
        except OSError as e:
            sock.close()
            error = e
    raise error
