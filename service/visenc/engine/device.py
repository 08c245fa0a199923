"""The device thread's own loop: takes its next batch, forwards it, hands the rows to the outputs."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from visenc import heap
from visenc.engine.job import Job, JobState
from visenc.engine.outputs import Forwarded, Outputs
from visenc.errors import NotReady, OutOfMemory
from visenc.metrics import Metrics
from visenc.models.base import Prepared, VisionTower

log = logging.getLogger(__name__)

TAKE_TIMEOUT_S = 0.25
#: forwards unfinished when the next batch is taken (more would queue images one a forward: no batch forms)
LAUNCHED_AHEAD = 1


class ReadyJobs(Protocol):
    def take(self, max_wait_s: float, timeout_s: float) -> list[Job]: ...

    def dispatch(self) -> None: ...


@dataclass(slots=True)
class Failure:
    batch: list[Job]
    reason: str
    error: BaseException | None = None


class DeviceLoop:
    """``run`` on the device thread, no lock of its own (it takes under the scheduler's); ``bind`` on the loop."""

    def __init__(
        self, tower: VisionTower, ready: ReadyJobs, outputs: Outputs, *, metrics: Metrics, max_wait_s: float
    ) -> None:
        self.tower = tower
        self.ready = ready
        self.outputs = outputs
        self.metrics = metrics
        self.max_wait_s = max_wait_s
        self.heap_idle_s = 2.0
        self._stream: Any = torch.cuda.Stream(tower.device) if tower.device.type == "cuda" else None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._generation = 0
        self.busy_since: float | None = None
        self._batch: list[Job] = []
        self._handed: set[int] = set()
        #: the forwards launched, oldest first: (event, launch time, jobs)
        self._launched: collections.deque[tuple[Any, float, list[Job]]] = collections.deque()

    def bind(self, loop: asyncio.AbstractEventLoop) -> int:
        self._loop = loop
        self._generation += 1
        self._launched.clear()  # a retired loop's forwards are not waited for (a stalled one never ends)
        return self._generation

    def retire(self) -> None:
        """The loop running now takes no more batches."""
        self._generation += 1

    def not_forwarded(self) -> list[Job]:
        return [j for j in self._batch if id(j) not in self._handed and j.state is JobState.RUNNING]

    def unfinished(self) -> list[Job]:
        """The jobs whose rows are not made: the batch in progress's and the launched forwards'."""
        launched = [j for event, _, jobs in list(self._launched) if not _done(event) for j in jobs]
        return [*self.not_forwarded(), *(j for j in launched if not j.finished)]

    def stalled_since(self) -> float | None:
        """Since when the device has worked on what it holds now (the oldest unfinished work)."""
        since = self.busy_since
        for event, launched_at, _ in list(self._launched):
            if not _done(event):
                return launched_at if since is None else min(since, launched_at)
        return since

    def run(self, generation: int) -> Failure | None:
        worked_at: float | None = None
        while generation == self._generation:
            self._wait_launched(generation)
            batch = self.ready.take(self.max_wait_s, TAKE_TIMEOUT_S)
            if not batch:
                if worked_at is not None and time.monotonic() - worked_at >= self.heap_idle_s:
                    worked_at = None
                    heap.trim()
                continue
            self._post(self.ready.dispatch)
            if generation != self._generation:
                self._post(self.outputs.fail, batch, NotReady("the service is shutting down"))
                break
            self._batch, self._handed = batch, set()
            try:
                self._run_batch(batch, generation)
            except Exception as error:
                if generation != self._generation:  # abandoned (a stall): its failure was answered
                    return None
                log.error("forward of %d images failed", len(batch), exc_info=error)
                return Failure(self.not_forwarded(), f"the device worker failed: {type(error).__name__}", error)
            finally:
                if generation == self._generation:  # an abandoned loop leaves the live one's state alone
                    self.busy_since = None
                self._post(self.ready.dispatch)
            worked_at = time.monotonic()
        return None

    def _wait_launched(self, generation: int) -> None:
        """Wait until at most ``LAUNCHED_AHEAD`` forwards are unfinished; a wait that never ends is a stall."""
        if len(self._launched) <= LAUNCHED_AHEAD:
            return
        self.busy_since = time.monotonic()
        while len(self._launched) > LAUNCHED_AHEAD and generation == self._generation:
            self._launched[0][0].synchronize()  # left in place meanwhile: a stall fails its jobs too
            if generation == self._generation and self._launched:
                self._launched.popleft()
        if generation == self._generation:
            self.busy_since = None

    def _run_batch(self, batch: list[Job], generation: int) -> None:
        """Forward ``batch`` in the tower's groups, each group's rows handed on once launched."""
        self.busy_since = time.monotonic()
        for job in batch:
            self.metrics.queue_wait_seconds.observe(self.busy_since - job.admitted_at)
        for group in self.tower.forward_groups([j.input for j in batch]):
            if generation != self._generation and any(batch[i].state is not JobState.RUNNING for i in group):
                return
            self._forward_fitting([batch[i] for i in group], generation)

    def _forward_fitting(self, jobs: list[Job], generation: int) -> None:
        """One forward of ``jobs``; on out-of-memory, the halves in turn, down to one image."""
        started = time.monotonic()
        try:
            outputs, event = self.forward([j.input for j in jobs])
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            self.metrics.oom_splits.inc()
            if self.tower.device.type == "cuda":
                torch.cuda.empty_cache()
            if len(jobs) == 1:
                log.warning("image %s does not fit in device memory alone: %r", jobs[0].image_hash, error)
                self._handed.add(id(jobs[0]))
                alone = OutOfMemory(f"the image does not fit in the device's memory alone ({type(error).__name__})")
                self._post(self.outputs.fail, jobs, alone)
                self._post(self.ready.dispatch)
                return
            log.info("forward of %d images ran out of memory; splitting it in two", len(jobs))
            half = len(jobs) // 2
            self._forward_fitting(jobs[:half], generation)
            self._forward_fitting(jobs[half:], generation)
            return
        elapsed = time.monotonic() - started
        self.metrics.forward_seconds.observe(elapsed)
        self.metrics.forwards.inc()
        self.metrics.batch_images.observe(len(jobs))
        self.metrics.batch_tokens.observe(sum(j.cost for j in jobs))
        self._handed.update(map(id, jobs))
        if event is not None and generation == self._generation:
            self._launched.append((event, started, jobs))
        self._post(self._forwarded, jobs, started, elapsed)  # before the copy's answer: the loop runs them in order
        self.outputs.submit(Forwarded(jobs, outputs, event))

    def _forwarded(self, jobs: list[Job], started: float, elapsed: float) -> None:
        for job in jobs:
            if job.state is JobState.RUNNING:
                job.forwarded(started, elapsed)
        self.ready.dispatch()

    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        assert self._loop is not None, "the device loop runs after bind"
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is left to answer
            log.debug("event loop closed; %s dropped", getattr(fn, "__name__", fn))

    def on_stream(self) -> AbstractContextManager[Any]:
        return torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()

    def forward(self, prepared: Sequence[Prepared]) -> tuple[list[torch.Tensor], Any]:
        with self.on_stream():
            outputs = self.tower.forward(prepared)
            if self._stream is None:
                return outputs, self.tower.record_event()
            event = torch.cuda.Event()
            event.record(self._stream)
        return outputs, event


def _done(event: Any) -> bool:
    query = getattr(event, "query", None)
    return query is None or bool(query())


def is_out_of_memory(error: BaseException) -> bool:
    """A device or host allocation failure (CUDA OOM, a CPU allocator refusal, ``MemoryError``)."""
    if isinstance(error, torch.OutOfMemoryError | MemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)
