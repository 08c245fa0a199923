"""Deadlines and client disconnects for handlers that wait (uvicorn does not cancel a handler itself).

An answer at hand costs neither: ``within`` arms a timer, not a task, and ``guarded`` listens for a
disconnect only once its work has had to wait."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Coroutine
from typing import Any, TypeVar

from starlette.requests import Request

from visenc.errors import ClientClosed, DeadlineExceeded, VisencError
from visenc.tasks import report

T = TypeVar("T")


async def _until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _cancel(request: Request, task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` and wait for it."""
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, VisencError):
        pass
    except Exception:
        report("request", request.app.state.metrics, task)


def remaining(deadline: float) -> float:
    """Seconds left until ``deadline`` (a ``loop.time()`` value), never negative."""
    return max(0.0, deadline - asyncio.get_running_loop().time())


@contextlib.asynccontextmanager
async def _timeout_at(deadline: float) -> AsyncIterator[None]:  # Python 3.10: asyncio has no timeout_at
    task = asyncio.current_task()
    assert task is not None
    fired = False

    def fire() -> None:
        nonlocal fired
        fired = True
        task.cancel()

    timer = asyncio.get_running_loop().call_at(deadline, fire)
    try:
        yield
    except asyncio.CancelledError as e:
        if fired:
            raise asyncio.TimeoutError from e
        raise
    finally:
        timer.cancel()


timeout_at = getattr(asyncio, "timeout_at", _timeout_at)


async def within(coro: Awaitable[T], deadline: float, what: str) -> T:
    """``await coro`` with a deadline (for reading the body, before ``guarded`` may listen)."""
    try:
        async with timeout_at(deadline):
            return await coro
    except asyncio.TimeoutError as e:
        raise DeadlineExceeded(f"{what}") from e


async def guarded(request: Request, coro: Coroutine[Any, Any, T], deadline: float, what: str) -> T:
    """Run ``coro`` until it finishes, the client disconnects, or ``deadline`` passes (``what`` names the limit
    in the 504 message)."""
    work = asyncio.ensure_future(coro)
    try:
        await asyncio.sleep(0)  # its first step: an answer at hand is returned with no watcher
    except asyncio.CancelledError:
        await _cancel(request, work)
        raise
    if work.done():
        return work.result()
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        done, _ = await asyncio.wait({work, watcher}, timeout=remaining(deadline), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        await _cancel(request, work)
        raise
    finally:
        await _cancel(request, watcher)
    if work in done:
        return work.result()
    await _cancel(request, work)
    if watcher in done:
        raise ClientClosed("the client closed the connection")
    raise DeadlineExceeded(what)
