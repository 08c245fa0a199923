"""Rows bodies sent from threads when the loop is busy writing another: the socket copy of a large body leaves
the event loop.

One event loop thread sending every caller's rows is one core's worth of socket copies; on loopback the
receiver's half of the work runs in the sender's system call too. A body that is a view of at least
``MIN_BYTES`` is written by the loop itself while it writes no other (``LoopBody``: a thread's hand-off and
its GIL round trips cost a lone caller more than the copy they move); while it does, the body is sent by a
pool thread on a duplicate of the connection's descriptor (the system call drops the GIL), once what uvicorn
wrote before it has left; uvicorn then ends the response as usual. Either way a caller that reads none of
its body for ``STALL_S`` loses its connection. Anything else (TLS, a write buffer not yet empty, HEAD,
chunked bodies) is written by uvicorn itself.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

log = logging.getLogger(__name__)

#: smaller bodies are written by the loop (a thread's hand-off costs more than their copy)
MIN_BYTES = 1 << 20
#: a caller that reads nothing for this long loses its connection (the thread is not held for ever)
STALL_S = 60.0
#: threads sending at once; more wait their turn
THREADS = min(16, 4 * (os.cpu_count() or 1))

_pool: ThreadPoolExecutor | None = None


def pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(THREADS, thread_name_prefix="visenc-send")
    return _pool


def send_all(sock: socket.socket, body: memoryview) -> None:
    """On a pool thread: ``body`` whole, or ``OSError`` (the caller went away, or read nothing for ``STALL_S``)."""
    sock.settimeout(STALL_S)  # the descriptor stays non-blocking (the loop's is the same); the wait is poll's
    view = body.cast("B")
    while view:  # not sendall: its timeout bounds the whole body, a caller reading slowly but steadily included
        view = view[sock.send(view) :]


class ThreadSentCycle(RequestResponseCycle):
    """uvicorn's request cycle, sending a large view body from ``pool()``."""

    owner: RowsProtocol | None = None

    async def send(self, message: Any) -> None:
        body = message.get("body") if message["type"] == "http.response.body" else None
        if isinstance(body, memoryview) and len(body) >= MIN_BYTES and self._may_send_raw(len(body)):
            if not LoopBody.busy():
                await super().send(message)
                LoopBody(self.transport)
                return
            fd = self.transport.get_extra_info("socket").fileno()
            sock = socket.socket(fileno=os.dup(fd))
            sending = asyncio.get_running_loop().run_in_executor(pool(), send_all, sock, body)
            sending.add_done_callback(lambda f: _closed(sock, f))
            if self.owner is not None:
                self.owner.sending = sending
            try:
                await asyncio.shield(sending)
            except asyncio.CancelledError:
                _cut(sock)  # the thread's send fails at once: nothing of the body is left half-sent later
                self.transport.close()
                raise
            except OSError as error:
                log.debug("rows body not sent: %r", error)
                self.disconnected = True
                self.transport.close()
                return
            self.expected_content_length -= len(body)
            message = {**message, "body": b""}
        await self._send_behind(message)

    async def _send_behind(self, message: Any) -> None:
        """uvicorn's send; what it adds behind a loop-written body still pending counts as sent to that body's
        stall check."""
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()  # as uvicorn's send would, so that its write alone is measured
        before = self.transport.get_write_buffer_size()
        await super().send(message)
        LoopBody.grew(self.transport, self.transport.get_write_buffer_size() - before)

    def _may_send_raw(self, nbytes: int) -> bool:
        """Whether the body may go past uvicorn's transport: plain TCP or a Unix socket, nothing unsent before
        it, the whole body announced by its content-length."""
        transport = self.transport
        return (
            self.response_started
            and not self.response_complete
            and not self.disconnected
            and self.chunked_encoding is False
            and self.scope["method"] != "HEAD"
            and nbytes <= self.expected_content_length
            and not transport.is_closing()
            and transport.get_write_buffer_size() == 0
            and transport.get_extra_info("sslcontext") is None
            and transport.get_extra_info("socket") is not None
        )


class LoopBody:
    """The one large body the loop is writing itself (what the socket could not take yet waits in the
    transport). Event loop only. Lives until its bytes are gone, its connection is, or another takes its place."""

    current: LoopBody | None = None

    def __init__(self, transport: Any) -> None:
        self.transport = transport
        self.left = transport.get_write_buffer_size()
        self.added = 0
        LoopBody.current = self
        if self.left:
            self._watch()

    @classmethod
    def busy(cls) -> bool:
        """Whether the loop is still writing a large body."""
        body = cls.current
        return body is not None and body.pending() > 0

    @classmethod
    def grew(cls, transport: Any, nbytes: int) -> None:
        """``nbytes`` more were written behind the current body on ``transport`` (the next views of its answer)."""
        body = cls.current
        if body is not None and body.transport is transport and nbytes > 0:
            body.added += nbytes

    def pending(self) -> int:
        """Bytes not yet taken by the socket; a closing transport (``Connection: close``) still writes them."""
        return int(self.transport.get_write_buffer_size())

    def _watch(self) -> None:
        asyncio.get_running_loop().call_later(STALL_S, self._check)

    def _check(self) -> None:
        """Every ``STALL_S`` while pending: a caller that read none of it since the last check is cut off."""
        left = self.pending()
        if LoopBody.current is not self or not left:
            return
        if left >= self.left + self.added:
            log.debug("rows body not sent: the caller read nothing for %s s", STALL_S)
            self.transport.abort()
            return
        self.left, self.added = left, 0
        self._watch()


def _closed(sock: socket.socket, sent: asyncio.Future[None]) -> None:
    """On the loop once the thread is done: the duplicate closed (the connection stays the loop's), the
    outcome read (a cancelled send's error is nobody's to raise)."""
    sock.close()
    if not sent.cancelled():
        sent.exception()


def _cut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class RowsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol whose request cycles are ``ThreadSentCycle``."""

    sending: asyncio.Future[None] | None = None

    def send_400_response(self, msg: str) -> None:
        """A bad request pipelined behind a body a thread sends is answered after that body, not inside it."""
        sending = self.sending
        if sending is not None and not sending.done():
            sending.add_done_callback(lambda _: self.send_400_response(msg))
        elif sending is not None and (sending.cancelled() or sending.exception() is not None):
            self.transport.close()  # the body was cut short: nothing more is written on this connection
        elif not self.transport.is_closing():
            super().send_400_response(msg)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        if type(self.cycle) is RequestResponseCycle:
            self.cycle.__class__ = ThreadSentCycle  # before its task first runs: every send is the subclass's
            self.cycle.owner = self  # type: ignore[attr-defined]
