"""Background tasks whose failures are never lost."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from functools import partial
from typing import Any, TypeVar

from visenc.metrics import Metrics

log = logging.getLogger("visenc.tasks")
T = TypeVar("T")


def spawn(coro: Coroutine[Any, Any, T], name: str, metrics: Metrics) -> asyncio.Task[T]:
    """``coro`` as a task named ``visenc-<name>`` whose failure is logged and counted as ``name``."""
    task = asyncio.get_running_loop().create_task(coro, name=f"visenc-{name}")
    task.add_done_callback(partial(report, name, metrics))
    return task


def report(name: str, metrics: Metrics, task: asyncio.Future[Any]) -> None:
    """Log and count ``task``'s exception, if it ended with one (a done callback)."""
    if task.cancelled():
        return
    error = task.exception()
    if error is None:
        return
    log.error("background task %s failed", name, exc_info=error)
    metrics.background_failures.labels(name).inc()


async def stop_task(task: asyncio.Task[Any] | None) -> None:
    """Cancel a background task and wait until it has ended; what it raised before is re-raised."""
    if task is not None:
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
