"""Scheduler: which images are preprocessed next, and which run together (``docs/internals.md``)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor

from visenc.engine.coordination import Coordination, WaitOutcome
from visenc.engine.job import IllegalTransition, Job, JobState, Place
from visenc.engine.outputs import Outputs
from visenc.engine.policy import BatchPolicy, SchedulerConfig
from visenc.engine.prepare import Source
from visenc.engine.staging import Staging
from visenc.errors import Cancelled, NotFound
from visenc.metrics import Metrics
from visenc.models.base import Prepared, TokenLayout
from visenc.tasks import spawn
from visenc_client.format import Entry

log = logging.getLogger(__name__)

Preprocess = Callable[[Source], Prepared]


class Scheduler:
    """Queues jobs, dispatches their preparation and claims, and hands the device its batches; what runs next
    and together is ``policy.BatchPolicy``'s. Event loop, except ``take`` and the preparation threads' hand-over
    (``_ready`` under ``_lock``); open until ``cancel_all``."""

    def __init__(
        self,
        config: SchedulerConfig,
        *,
        preprocess: Preprocess,
        pool: Executor,
        outputs: Outputs,
        coordination: Coordination,
        metrics: Metrics,
        batch_bytes: Callable[[Sequence[TokenLayout]], int] | None = None,
        on_prepared: Callable[[Job, float], None] | None = None,
    ) -> None:
        self._metrics = metrics
        self._preprocess = preprocess
        self._pool = pool
        self._outputs = outputs
        self._coordination = coordination
        self.config = config
        self.policy = BatchPolicy(config, batch_bytes)
        self._on_prepared = on_prepared
        self._waiting: list[Job] = []
        #: preprocessed, not yet taken; written only under ``_lock`` (the device thread takes from it)
        self._ready: list[Job] = []
        self._lock = threading.Condition()
        self._preparing: dict[asyncio.Task[None], Job] = {}
        #: preparations started and not ended (read by the device thread: a plain count)
        self._preparations = 0
        self.staging = Staging()
        self._closed: BaseException | None = None

    @property
    def staged_tokens(self) -> int:
        return self.staging.tokens

    @property
    def depth(self) -> int:
        """Jobs admitted and not yet handed to the device (a just-prepared job counts once)."""
        with self._lock:  # a thread hands its job over under the lock: not between the two reads
            return len(self._waiting) + self._in_preparation + len(self._ready)

    @property
    def _in_preparation(self) -> int:
        return len(self._preparing_jobs())

    def _preparing_jobs(self) -> list[Job]:
        # a job its preprocessing thread made ready counts as ready, while its task ends on the loop
        return [job for t, job in self._preparing.items() if not t.done() and job.state is JobState.PREPARING]

    @property
    def idle(self) -> bool:
        return self.depth == 0

    def submit(self, job: Job) -> None:
        if self._closed is not None:
            self._outputs.fail([job], self._closed)
            return
        job.queue()
        self._coordination.queued(job)
        self._waiting.append(job)
        self.dispatch()

    def watch(self, job: Job) -> None:
        """Wait for another replica's encode of ``job``; queue it here if that replica goes away."""
        job.watch()
        self._coordination.watch(job, self._wait_ended)

    def _wait_ended(self, job: Job, outcome: WaitOutcome) -> None:
        if job.finished:
            return
        if isinstance(outcome, Entry):
            self._outputs.complete_remote(job, outcome)
        elif outcome is not None:
            self._outputs.fail([job], outcome)
        elif job.state is JobState.FOLLOWING:
            self._outputs.fail(
                [job],
                NotFound(
                    f"image {job.image_hash} was being encoded by another replica that did "
                    "not finish; encode it again with its bytes"
                ),
            )
        else:
            self.submit(job)

    def bump(self, job: Job) -> None:
        """Move a job ahead of all non-urgent work, past the prefetch gate by one batch at most."""
        if not job.bump():
            return
        if job in self._waiting and self._fits(job, self.config.prefetch + self.config.max_batch_tokens):
            self._waiting.remove(job)
            self._start(job)

    def _fits(self, job: Job, bound: int) -> bool:
        with self._lock:  # a job handed over meanwhile is read in one of the two, never in neither
            nothing_ahead = not self._ready and not self._in_preparation
        return self.policy.fits(job, self.staging.tokens, bound, nothing_ahead)

    def drop(self, job: Job) -> None:
        """A waiter went away: drop ``job`` if nobody else wants it and it is not on the device."""
        if job.interest > 0:
            return
        if job in self._waiting:
            self._waiting.remove(job)
            self._drop_if_unwanted(job)
        elif self._unready(job):
            self._drop_if_unwanted(job)
            self.dispatch()

    def _unready(self, job: Job) -> bool:
        with self._lock:
            if job not in self._ready:
                return False
            self._ready.remove(job)
            return True

    def _drop_if_unwanted(self, job: Job) -> bool:
        if job.interest > 0:
            return False
        if job.turn:
            self.policy.refund(job)
        self._outputs.fail([job], Cancelled("every request waiting for this image went away"))
        return True

    def dispatch(self) -> None:
        """Start preprocessing the most urgent waiting jobs while the prefetch budget allows."""
        while (job := self.policy.pick(self._waiting)) is not None:
            bound = self.policy.prefetch_bound(job, self._batch_staged)
            if job.interest > 0 and not self._fits(job, bound):
                return  # wait for the device to free staged work: priority order is kept
            self._waiting.remove(job)
            self._start(job)

    def _batch_staged(self) -> bool:
        """Whether batch-class work holds staged input (preparing or ready)."""
        with self._lock:
            return any(job.priority == "batch" for job in (*self._preparing_jobs(), *self._ready))

    def _start(self, job: Job) -> None:
        if self._drop_if_unwanted(job):
            return
        self.policy.charge(job)
        job.start_preparing(self.staging)
        task = spawn(self._prepare(job), "prepare", self._metrics)
        self._preparing[task] = job
        self._preparations += 1
        task.add_done_callback(self._prepared)

    def _prepared(self, task: asyncio.Task[None]) -> None:
        self._preparing.pop(task)
        self._preparations -= 1

    async def _prepare(self, job: Job) -> None:
        try:
            match await self._coordination.begin(job):
                case Place.HERE:
                    await self._preprocess_here(job)
                case Place.ELSEWHERE:
                    self.watch(job)
                case Entry() as entry:
                    job.watch()
                    self._outputs.complete_remote(job, entry)
        except BaseException as e:
            self._outputs.fail([job], e)
            self.dispatch()
            if isinstance(e, asyncio.CancelledError):
                raise
            return
        self.dispatch()

    async def _preprocess_here(self, job: Job) -> None:
        t0 = time.perf_counter()
        data = job.take_bytes()
        handed = await asyncio.get_running_loop().run_in_executor(self._pool, self._prepare_and_hand, job, data)
        if self._on_prepared is not None:
            self._on_prepared(job, time.perf_counter() - t0)
        # whether it is still wanted is told here, on the loop: a request may have joined it meanwhile
        if not handed or (job.interest <= 0 and self._unready(job)):
            self._drop_if_unwanted(job)

    def _prepare_and_hand(self, job: Job, data: Source) -> bool:
        """On a preprocessing thread: the tower input, put where the device thread takes it (no event loop)."""
        tower_input = self._preprocess(data)
        with self._lock:
            if job.state is not JobState.PREPARING:
                return False
            try:
                job.prepared(tower_input)
            except IllegalTransition:  # failed meanwhile by the loop (cancelled, shut down)
                return False
            self._ready.append(job)
            self._lock.notify()
        return True

    def take_batch(self) -> list[Job]:
        with self._lock:
            unwanted = [job for job in self._ready if job.interest <= 0]
            self._ready = [job for job in self._ready if job.interest > 0]
            batch = self._form_batch()
        for job in unwanted:
            self._drop_if_unwanted(job)
        self.dispatch()  # with nothing left ahead of the device, its next input starts now
        return batch

    def take(self, max_wait_s: float, timeout_s: float) -> list[Job]:
        """On the device thread: the next batch within ``timeout_s`` (``docs/internals.md``)."""
        with self._lock:
            self._ready = [job for job in self._ready if not job.finished]  # failed while ready
            idle = not self._wanted()
            if idle and not self._lock.wait_for(self._wanted, timeout_s):
                return []
            if idle and max_wait_s > 0 and self._preparations:
                self._lock.wait_for(lambda: len(self._ready) >= self.config.max_batch_images, max_wait_s)
            return self._form_batch()

    def _wanted(self) -> bool:
        return any(job.interest > 0 for job in self._ready)

    def _form_batch(self) -> list[Job]:
        batch = self.policy.form_batch([job for job in self._ready if job.interest > 0])
        taken = set(map(id, batch))
        self._ready = [j for j in self._ready if id(j) not in taken]
        for job in batch:
            job.run()
        return batch

    def backlog(self) -> list[Job]:
        """Jobs wanted and not yet on the device, in no order (for the autoscaling gauges)."""
        with self._lock:  # a job its thread handed over while its task still runs is listed once, as ready
            ready = list(self._ready)
            preparing = self._preparing_jobs()
        return [job for job in (*self._waiting, *preparing, *ready) if job.interest > 0]

    def cancel_all(self, error: BaseException) -> None:
        """Fail every job not yet on the device with ``error``; nothing is encoded here afterwards."""
        self._closed = error
        preparing = [job for task, job in self._preparing.items() if not task.done()]
        with self._lock:
            ready, self._ready = self._ready, []
        self._outputs.fail([*self._waiting, *preparing, *ready], error)
        self._waiting.clear()
        for task in list(self._preparing):
            task.cancel()
