"""The in-flight map: one job per key from its admission until its future resolves; later requests and
fetches join it (single-flight)."""

from __future__ import annotations

import asyncio
import copy
import itertools
import time
from collections import OrderedDict
from typing import TypeGuard

from visenc.engine.items import MISSING, Encodable, Item, Outcome, Pending
from visenc.engine.job import Job, JobState, Place
from visenc.engine.scheduler import Scheduler
from visenc.engine.tenants import Account
from visenc.errors import VisencError
from visenc.index.memory import Lease
from visenc.metrics import Metrics
from visenc_client.format import Entry, Priority

#: who asks: the tenant's account (none: counted nowhere) and the request's class
Requester = tuple[Account | None, Priority]

#: how many keys of items that failed while encoded it remembers, so that a later fetch answers their error
FAILED_KEPT = 4096


class InFlight:
    """Event loop only, no lock; a job is in ``jobs`` from ``admit`` until its future resolves."""

    def __init__(self, scheduler: Scheduler, metrics: Metrics) -> None:
        self.scheduler = scheduler
        self.metrics = metrics
        self.jobs: dict[str, Job] = {}
        self._requests = itertools.count()
        self._failed: OrderedDict[str, VisencError] = OrderedDict()

    def next_request(self) -> int:
        """The arrival number of a new request (or fetch)."""
        return next(self._requests)

    def joinable(self, key: str) -> Job | None:
        job = self.jobs.get(key)
        return None if job is None or job.finished else job

    def admit(self, key: str, image_hash: str, order: tuple[int, int], by: Requester = (None, "interactive")) -> Job:
        job = Job(
            key=key,
            image_hash=image_hash,
            order=order,
            future=asyncio.get_running_loop().create_future(),
            admitted_at=time.monotonic(),
            account=by[0],
            priority=by[1],
        )
        self.jobs[key] = job
        job.future.add_done_callback(lambda _: self._forget(job))
        self.metrics.inflight.set(len(self.jobs))
        return job

    def join_or_start(
        self, it: Item, order: tuple[int, int], placed: Entry | Place | None, reader: Lease | None, by: Requester
    ) -> Outcome:
        """The job in flight for an open item, joined, or a new one with its bytes (charged to ``by``'s tenant,
        in its class); missing without."""
        job = self.joinable(it.looked_up)
        if job is None:
            if not isinstance(it.state, Encodable):
                return MISSING
            job = self.admit(it.looked_up, it.hash, order, by)
            job.join(reader)
            job.give_bytes(it.state.source, it.state.inspected)
            if placed is Place.ELSEWHERE:
                self.scheduler.watch(job)  # another replica encodes it
            else:
                self.scheduler.submit(job)
            return Pending(job)
        self.metrics.singleflight_joins.inc()
        job.join(reader, by[1])
        if job.state is JobState.FOLLOWING and isinstance(it.state, Encodable):
            job.give_bytes(it.state.source, it.state.inspected)  # a fetch's wait for another replica adopts the bytes
        return Pending(job)

    def leave(self, job: Job, reader: Lease | None = None) -> None:
        """One waiter is done with ``job``: the scheduler drops it if nobody else wants it."""
        if job.leave(reader):
            self.scheduler.drop(job)

    def _forget(self, job: Job) -> None:
        if self.jobs.get(job.key) is job:
            del self.jobs[job.key]
        self.metrics.inflight.set(len(self.jobs))
        if job.future.cancelled():
            return
        error = job.future.exception()  # retrieved: a failed job nobody waits for is not logged
        if _of_item(error):
            self._failed[job.key] = error
            self._failed.move_to_end(job.key)
            if len(self._failed) > FAILED_KEPT:
                self._failed.popitem(last=False)
        else:
            self._failed.pop(job.key, None)

    def settling(self, key: str) -> Job | None:
        """The job of ``key`` that finished (done or failed), still in the map until its answer is out."""
        job = self.jobs.get(key)
        return job if job is not None and job.finished else None

    def ended_here(self, key: str) -> bool:
        """Whether the last encode of ``key`` here has finished but is not answered yet, or failed for its item."""
        return self.settling(key) is not None or self.failure(key) is not None

    def failure(self, key: str) -> VisencError | None:
        """The item's own error (a copy, to raise) where the last encode of ``key`` here failed for it."""
        job = self.jobs.get(key)
        answered = job.future if job is not None and job.future.done() and not job.future.cancelled() else None
        error = answered.exception() if answered is not None else self._failed.get(key)
        return copy.copy(error).with_traceback(None) if _of_item(error) else None


def _of_item(error: BaseException | None) -> TypeGuard[VisencError]:
    """Whether ``error`` is about the item's bytes (a per-item reason), not the service."""
    return isinstance(error, VisencError) and error.item_reason is not None
