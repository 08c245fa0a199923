"""The device thread's own loop: takes its next batch, forwards it, hands the rows to the outputs."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from visenc import heap
from visenc.devices import Event
from visenc.engine.job import Job, JobState
from visenc.engine.outputs import Forwarded, Outputs
from visenc.errors import EncodeFailed, NotReady, OutOfMemory
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
        self.runtime = tower.runtime
        #: bytes of one row of rows (the bound on rows not yet copied out counts them)
        self.row_bytes = tower.hidden_size * tower.dtype.itemsize
        self._loop: asyncio.AbstractEventLoop | None = None
        self._generation = 0
        self.busy_since: float | None = None
        self._batch: list[Job] = []
        self._handed: set[int] = set()
        #: the forwards launched, oldest first: (end event, launch time, jobs)
        self._launched: collections.deque[tuple[Event, float, list[Job]]] = collections.deque()

    def bind(self, loop: asyncio.AbstractEventLoop) -> int:
        self._loop = loop
        self._generation += 1
        self._launched.clear()  # a retired loop's forwards are not waited for (a stalled one never ends)
        self.busy_since = None  # nor its work timed: the new loop starts idle
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
            if generation != self._generation:  # abandoned while it waited: the live loop takes the jobs
                break
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
        now = time.monotonic()
        if generation == self._generation:  # a retired loop's batch is not the live one's work
            self.busy_since = now
        for job in batch:
            job.dequeued_at = now
            self.metrics.queue_wait_seconds.observe(now - job.admitted_at)
        for group in self.tower.forward_groups([j.input for j in batch]):
            if generation != self._generation and any(batch[i].state is not JobState.RUNNING for i in group):
                return
            self._forward_fitting([batch[i] for i in group], generation)

    def _room_for_rows(self, jobs: list[Job], generation: int) -> None:
        """Wait while the rows not yet copied out would pass their bound with these jobs' (copy-out lags)."""
        nbytes = sum(j.shape.num_tokens for j in jobs) * self.row_bytes
        waited_from = time.monotonic()
        if self.outputs.wait_for_room(nbytes, lambda: generation != self._generation):
            self.runtime.note_wait("copy-out", waited_from, time.monotonic())
            self.metrics.device_wait_seconds.labels("copy-out").observe(time.monotonic() - waited_from)

    def _forward_fitting(self, jobs: list[Job], generation: int) -> None:
        """One forward of ``jobs``; on out-of-memory, the halves in turn, down to one image."""
        self._room_for_rows(jobs, generation)
        try:
            launch = self.forward([j.input for j in jobs])
        except Exception as error:
            if not self.runtime.is_out_of_memory(error):
                raise
            self.metrics.oom_splits.inc()
            self.runtime.free_cached()
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
        self.metrics.forward_launch_seconds.observe(launch.launch_s)
        self.metrics.forwards.inc()
        self.metrics.batch_images.observe(len(jobs))
        self.metrics.batch_tokens.observe(sum(j.cost for j in jobs))
        self._handed.update(map(id, jobs))
        if generation == self._generation:
            self._launched.append((launch.end, launch.launched_at, jobs))
        self._post(self._forwarded, jobs, launch.launched_at, launch.launch_s)  # before the copy's answer
        self._hand_over(Forwarded(jobs, launch.outputs, launch.end, launch.start))

    def _hand_over(self, forwarded: Forwarded) -> None:
        """The rows to the outputs; a hand-over that fails answers its jobs with the error."""
        try:
            self.outputs.submit(forwarded)
        except Exception as error:
            log.error("handing %d images' rows to the outputs failed", len(forwarded.batch), exc_info=error)
            self.metrics.encode_failures.labels("output").inc(len(forwarded.batch))
            self._post(self.outputs.fail, forwarded.batch, EncodeFailed(f"encoding failed: {type(error).__name__}"))

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

    def on_stream(self) -> AbstractContextManager[object]:
        return self.runtime.stream()

    def forward(self, prepared: Sequence[Prepared]) -> Launch:
        """Launch one forward on the device thread's stream, between two events; returns at launch."""
        with self.runtime.stream():
            start = self.runtime.record()
            launched_at = time.monotonic()
            outputs = self.tower.forward(prepared)
            launch_s = time.monotonic() - launched_at
            end = self.runtime.record()
        return Launch(outputs, start, end, launched_at, launch_s)


@dataclass(slots=True)
class Launch:
    outputs: list[torch.Tensor]
    #: events recorded around the forward on the device's stream: its device time, read once the rows are out
    start: Event
    end: Event
    launched_at: float
    #: host time of the launch (the forward call's own)
    launch_s: float


def _done(event: Event) -> bool:
    return event.query()
