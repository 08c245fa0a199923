"""The engine's stages for a test of one of them: stand-ins for the stages around it
(``RecordedFailures``, ``SlowTower``), a scheduler and a job built in one call (``make_scheduler``,
``job``), the stages from the scheduler to the outputs wired around a tower (``pipeline``), a device that
finishes a batch (``forwarded``), and a pool that runs its calls inline (``InlinePool``, ``settle``)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from visenc.engine.coordination import LocalCoordination
from visenc.engine.job import Job
from visenc.engine.outputs import Outputs
from visenc.engine.policy import SchedulerConfig
from visenc.engine.prepare import Inspected
from visenc.engine.scheduler import Scheduler
from visenc.engine.worker import DeviceWorker
from visenc.index.memory import MemoryCache
from visenc.index.tiered import Index
from visenc.metrics import Metrics
from visenc.models.base import Prepared, TokenLayout, VisionTower


class RecordedFailures:
    """An outputs stage that only records failures: ``failed`` holds ``(job, error)`` pairs."""

    def __init__(self, into: list[tuple[Job, BaseException]] | None = None) -> None:
        self.failed: list[Any] = into if into is not None else []

    def fail(self, jobs: Sequence[Job], error: BaseException) -> None:
        for job in jobs:
            if not job.finished:
                job.fail()
                self.failed.append((job, error))


def make_scheduler(packable=False, max_tokens=100, max_images=8, prefetch=None, failed=None):
    def preprocess(data: bytes) -> Prepared:
        n = len(data)
        return Prepared(np.zeros((n, 1), np.float32), TokenLayout(n, (1, 1, n), n))

    return Scheduler(
        SchedulerConfig(max_tokens, max_images, packable, prefetch_tokens=prefetch),
        preprocess=preprocess,
        pool=ThreadPoolExecutor(2),
        outputs=RecordedFailures(failed),  # type: ignore[arg-type]
        coordination=LocalCoordination(),
        metrics=Metrics(),
    )


def job(cost: int, order: tuple[int, int], bucket=None, account=None, priority="interactive") -> Job:
    loop = asyncio.get_running_loop()
    j = Job(
        key=f"k{order}{id(account)}",
        image_hash="h",
        order=order,
        future=loop.create_future(),
        admitted_at=0.0,
        account=account,
        priority=priority,
    )
    j.give_bytes(b"x" * cost, Inspected("h", TokenLayout(cost, (1, 1, cost), bucket or cost), cost, 0))
    j.join()
    return j


class SlowTower(VisionTower):
    """Fixed-shape stand-in whose preprocess and forward take known time and record
    where and when they ran."""

    name = "slow"
    hidden_size = 4
    dtype = torch.float32
    device = torch.device("cpu")

    def __init__(self, forward_s: float, preprocess_s: float) -> None:
        self.forward_s, self.preprocess_s = forward_s, preprocess_s
        self.forwards: list[tuple[float, float, int]] = []
        self.preps: list[tuple[float, float, str]] = []
        self._layout = TokenLayout(1, (1, 1, 1), "only")

    def layout(self, width: int, height: int) -> TokenLayout:
        return self._layout

    def preprocess(self, image: Any) -> Prepared:
        t0 = time.monotonic()
        time.sleep(self.preprocess_s)  # the decode/resize/normalise stand-in: blocking CPU work
        self.preps.append((t0, time.monotonic(), threading.current_thread().name))
        return Prepared(np.zeros((1, 4), np.float32), self._layout)

    def forward(self, batch: Sequence[Prepared]) -> list[torch.Tensor]:
        t0 = time.monotonic()
        time.sleep(self.forward_s)
        self.forwards.append((t0, time.monotonic(), len(batch)))
        return [torch.zeros(1, 4) for _ in batch]

    def fingerprint_fields(self) -> dict[str, Any]:
        return {"slow": 1}


def pipeline(
    tower: VisionTower, *, batch: int, prefetch: int
) -> tuple[ThreadPoolExecutor, Outputs, Scheduler, DeviceWorker]:
    """The engine's stages around ``tower`` (the outputs stage started, the worker not yet)."""
    pool = ThreadPoolExecutor(2, thread_name_prefix="visenc-pre")
    local = LocalCoordination()
    outputs = Outputs(
        index=Index(MemoryCache(1 << 20, Metrics())),
        metrics=Metrics(),
        fingerprint="f" * 32,
        hidden_size=4,
        runtime=tower.runtime,
        coordination=local,
    )
    outputs.start()
    s = Scheduler(
        SchedulerConfig(batch, batch, False, prefetch_tokens=prefetch),
        preprocess=lambda data: tower.preprocess(data),
        pool=pool,
        outputs=outputs,
        coordination=local,
        metrics=Metrics(),
    )
    return pool, outputs, s, DeviceWorker(tower, s, outputs, metrics=Metrics(), max_wait_s=0.0, stall_timeout_s=30)


def forwarded(scheduler: Scheduler, batch: Sequence[Job]) -> None:
    """The device finished ``batch``: each job's forward ended (its staged input is given back with
    that transition) and the scheduler dispatches the jobs behind them."""
    for j in batch:
        j.forwarded(0.0, 0.0)
    scheduler.dispatch()


class InlinePool(Executor):
    """A preprocessing pool that runs each call at once, on the event loop's thread: a scheduler's
    preparations then progress only when the test awaits, so its interleavings are a function of the
    test's steps alone, never of thread timing."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as e:
            future.set_exception(e)
        return future


async def settle(scheduler: Scheduler) -> None:
    """Until no preparation is in progress: each one the scheduler started (and any it starts
    meanwhile) has ended."""
    while scheduler._preparing:
        await asyncio.gather(*scheduler._preparing, return_exceptions=True)
