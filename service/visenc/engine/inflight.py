"""The in-flight map: one job per key from its admission until its future resolves; later requests and
fetches join it (single-flight)."""

from __future__ import annotations

import asyncio
import itertools
import time

from visenc.engine.items import MISSING, Encodable, Item, Outcome, Pending
from visenc.engine.job import Job, JobState, Place
from visenc.engine.scheduler import Scheduler
from visenc.engine.tenants import Account
from visenc.index.memory import Lease
from visenc.metrics import Metrics
from visenc_client.format import Entry, Priority

#: who asks: the tenant's account (none: counted nowhere) and the request's class
Requester = tuple[Account | None, Priority]


class InFlight:
    """Event loop only, no lock; a job is in ``jobs`` from ``admit`` until its future resolves."""

    def __init__(self, scheduler: Scheduler, metrics: Metrics) -> None:
        self.scheduler = scheduler
        self.metrics = metrics
        self.jobs: dict[str, Job] = {}
        self._requests = itertools.count()

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
        if not job.future.cancelled():
            job.future.exception()  # retrieved: a failed job nobody waits for is not logged
