"""``api/guard.py``: deadlines and disconnects for a handler's waits; an answer at hand costs no watcher."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from visenc.api import guard
from visenc.errors import ClientClosed, DeadlineExceeded
from visenc.metrics import Metrics


def request(receive: Any) -> Any:
    return SimpleNamespace(receive=receive, app=SimpleNamespace(state=SimpleNamespace(metrics=Metrics())))


async def stays() -> dict:
    await asyncio.Event().wait()
    return {}


async def test_an_answer_at_hand_is_returned_with_no_listener():
    asked: list[str] = []

    async def listened() -> dict:
        asked.append("receive")
        return await stays()

    async def at_hand() -> int:
        return 7

    loop = asyncio.get_running_loop()
    assert await guard.guarded(request(listened), at_hand(), loop.time() + 5, "x") == 7
    await asyncio.sleep(0.01)  # a listener started would have asked by now
    assert asked == []


async def test_a_wait_ends_when_the_client_leaves_and_its_work_is_cancelled():
    cancelled = asyncio.Event()

    async def leaves() -> dict:
        await asyncio.sleep(0.05)
        return {"type": "http.disconnect"}

    async def work() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(ClientClosed):
        await guard.guarded(request(leaves), work(), asyncio.get_running_loop().time() + 30, "x")
    assert cancelled.is_set()


async def test_a_wait_past_its_deadline_is_a_504_naming_the_limit():
    with pytest.raises(DeadlineExceeded, match="the limit"):
        await guard.guarded(request(stays), asyncio.sleep(60), asyncio.get_running_loop().time() + 0.1, "the limit")


async def test_a_cancelled_handler_cancels_its_work_even_in_the_first_step():
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def work() -> None:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    handler = asyncio.ensure_future(guard.guarded(request(stays), work(), asyncio.get_running_loop().time() + 30, "x"))
    await started.wait()
    handler.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handler
    assert cancelled.is_set()


@pytest.fixture(params=["asyncio", "fallback"])
def timeouts(request, monkeypatch):
    """``within`` on asyncio's own ``timeout_at`` and on the one Python 3.10 gets."""
    if request.param == "fallback":
        monkeypatch.setattr(guard, "timeout_at", guard._timeout_at)
    elif not hasattr(asyncio, "timeout_at"):
        pytest.skip("this Python's asyncio has no timeout_at")


async def test_within_returns_in_time(timeouts):
    assert await guard.within(asyncio.sleep(0.01, "body"), asyncio.get_running_loop().time() + 5, "x") == "body"


async def test_within_a_deadline_passed_is_a_504(timeouts):
    with pytest.raises(DeadlineExceeded, match="the body did not arrive"):
        await guard.within(asyncio.sleep(60), asyncio.get_running_loop().time() + 0.05, "the body did not arrive")


async def test_within_a_cancel_from_outside_stays_a_cancel(timeouts):
    task = asyncio.ensure_future(guard.within(asyncio.sleep(60), asyncio.get_running_loop().time() + 30, "x"))
    await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
