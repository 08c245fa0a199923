"""Background tasks: a failure is logged with its traceback and counted, never dropped."""

from __future__ import annotations

import asyncio
import logging

import pytest
from harness.waits import metric

from visenc.metrics import Metrics
from visenc.tasks import spawn, stop_task


def failures(m: Metrics, task: str) -> float:
    from prometheus_client import generate_latest

    return metric(generate_latest(m.registry).decode(), "visenc_background_failures_total", task=task)


async def test_a_failed_task_is_logged_with_its_traceback_and_counted(caplog):
    m = Metrics()

    async def broken() -> None:
        raise KeyError("a stage bug")

    with caplog.at_level(logging.ERROR, logger="visenc.tasks"):
        task = spawn(broken(), "index-write", m)
        await asyncio.wait({task})
        await asyncio.sleep(0)  # the done callback runs on the next turn of the loop
    (record,) = caplog.records
    assert "index-write" in record.getMessage() and record.exc_info[0] is KeyError
    assert failures(m, "index-write") == 1


async def test_a_cancelled_task_is_no_failure(caplog):
    m = Metrics()
    task = spawn(asyncio.sleep(60), "claims-renew", m)
    await stop_task(task)
    await asyncio.sleep(0)
    assert failures(m, "claims-renew") == 0 and not caplog.records


async def test_stopping_a_task_that_already_failed_raises_its_error():
    async def broken() -> None:
        raise RuntimeError("failed before the stop")

    task = spawn(broken(), "outputs", Metrics())
    await asyncio.wait({task})
    with pytest.raises(RuntimeError, match="before the stop"):
        await stop_task(task)


async def test_a_request_whose_wait_raises_a_bug_after_the_client_left_is_reported(caplog):
    """``guarded``: the client is gone, the work it waited for ends with a bug: logged and counted."""
    from types import SimpleNamespace

    from visenc.api.guard import guarded

    m = Metrics()
    gone = asyncio.Event()

    async def receive() -> dict:
        gone.set()
        return {"type": "http.disconnect"}

    async def work() -> None:
        await gone.wait()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            raise ValueError("a bug while cancelling") from None

    request = SimpleNamespace(receive=receive, app=SimpleNamespace(state=SimpleNamespace(metrics=m)))
    loop = asyncio.get_running_loop()
    with caplog.at_level(logging.ERROR, logger="visenc.tasks"), pytest.raises(Exception, match="closed"):
        await guarded(request, work(), loop.time() + 30, "the test's deadline")  # type: ignore[arg-type]
    assert failures(m, "request") == 1 and caplog.records[0].exc_info[0] is ValueError
