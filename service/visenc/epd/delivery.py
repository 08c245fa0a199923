"""Where an SGLang part goes: the receive URLs its scheduler ranks register, and ZMQ PUSH sockets."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import zmq
import zmq.asyncio


@dataclass
class _Registration:
    expected: int = 0
    urls: list[str] = field(default_factory=list)
    since: float = field(default_factory=time.monotonic)
    complete: asyncio.Event = field(default_factory=asyncio.Event)


class Destinations:
    """Receive URLs registered per part (``/scheduler_receive_url``), until its ``/encode`` takes them."""

    def __init__(self, *, max_parts: int = 10_000, ttl_s: float = 300.0) -> None:
        self.max_parts = max_parts
        self.ttl_s = ttl_s
        self._parts: OrderedDict[str, _Registration] = OrderedDict()

    def __len__(self) -> int:
        return len(self._parts)

    def _get(self, req_id: str) -> _Registration:
        now = time.monotonic()
        while self._parts:  # forget parts whose /encode never came
            oldest = next(iter(self._parts.values()))
            if now - oldest.since < self.ttl_s and len(self._parts) < self.max_parts:
                break
            self._parts.popitem(last=False)
        registration = self._parts.get(req_id)
        if registration is None:
            registration = self._parts[req_id] = _Registration()
        return registration

    def register(self, req_id: str, receive_count: int, url: str) -> None:
        registration = self._get(req_id)
        if registration.expected and registration.expected != receive_count:
            raise ValueError(
                f"inconsistent receive_count for req_id={req_id}: registered {registration.expected}, "
                f"got {receive_count}"
            )
        registration.expected = receive_count
        if url not in registration.urls:
            registration.urls.append(url)
        if len(registration.urls) >= registration.expected:
            registration.complete.set()

    def registered(self, req_id: str) -> list[str]:
        registration = self._parts.get(req_id)
        return [] if registration is None else list(registration.urls)

    async def take(self, req_id: str, timeout_s: float) -> tuple[list[str], bool]:
        """The part's receive URLs once all registered, or those that did within ``timeout_s``, and whether all did."""
        registration = self._get(req_id)
        try:
            await asyncio.wait_for(registration.complete.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass
        self._parts.pop(req_id, None)
        return list(registration.urls), registration.complete.is_set()


class Pusher:
    """ZMQ PUSH sockets to SGLang's receivers, one per endpoint; a send no connected peer takes in time fails."""

    def __init__(self, *, timeout_s: float = 30.0, max_sockets: int = 256) -> None:
        self.timeout_s = timeout_s
        self.max_sockets = max_sockets
        self._context = zmq.asyncio.Context()
        self._sockets: OrderedDict[str, zmq.asyncio.Socket] = OrderedDict()
        self._locks: dict[str, asyncio.Lock] = {}

    def _socket(self, endpoint: str) -> zmq.asyncio.Socket:
        sock = self._sockets.get(endpoint)
        if sock is not None:
            self._sockets.move_to_end(endpoint)
            return sock
        while len(self._sockets) >= self.max_sockets:
            old, stale = self._sockets.popitem(last=False)
            stale.close(linger=0)
            self._locks.pop(old, None)
        sock = self._context.socket(zmq.PUSH)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only for a connected peer
        sock.setsockopt(zmq.SNDTIMEO, int(self.timeout_s * 1000))
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        self._sockets[endpoint] = sock
        return sock

    async def push(self, receive_url: str, frames: list[bytes | memoryview]) -> None:
        """Send ``frames`` to ``host:port``; raises ``zmq.ZMQError`` or ``TimeoutError`` when it cannot."""
        endpoint = receive_url if "://" in receive_url else f"tcp://{_bracket(receive_url)}"
        lock = self._locks.setdefault(endpoint, asyncio.Lock())
        async with lock:
            sock = self._socket(endpoint)
            try:
                await asyncio.wait_for(sock.send_multipart(frames, copy=False), self.timeout_s)
            except BaseException:
                self._sockets.pop(endpoint, None)
                sock.close(linger=0)
                raise

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close(linger=0)
        self._sockets.clear()
        with contextlib.suppress(Exception):
            self._context.term()


def _bracket(host_port: str) -> str:
    host, _, port = host_port.rpartition(":")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"
