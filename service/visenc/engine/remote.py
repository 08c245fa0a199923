"""Images another replica is encoding: wait for its entry, or take over.

A job is *watched* when another replica holds its claim, found at admission or
when its encode was about to start here (``begin``, the scheduler's gate). A
watched job sits in intake's in-flight map (local requests join it) but is not
queued here. One background loop reads every due watched image's state in one
pipelined round trip of the state script, backing off from 1 ms to
``claim_poll_ms`` per image. Each poll either finds the entry (the job
completes with it, no forward here), or finds the claim gone without an entry
(owner died or failed: the job is queued here again, and claims at its own
encode start), or, after ``claim_wait_s``, gives up waiting and queues the job
here anyway. A watched job nobody waits for any more is cancelled. A *fetch*
(no bytes) waits while the image is claimed or queued at some replica.

Why polling and not pub/sub: the same script answers "done?" and "owner
gone?" atomically, works unchanged on Redis Cluster (pub/sub there is
broadcast or sharded, with per-node subscriptions to keep alive), survives
Redis restarts with no subscription to restore, and costs one small round trip
per tick for *all* watched images of this replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from visenc.engine.claims import Claims
from visenc.engine.job import Job, JobState
from visenc.engine.outputs import Outputs
from visenc.engine.scheduler import Scheduler
from visenc.errors import Cancelled, NotFound, NotReady
from visenc.index.redis_claims import ClaimState
from visenc.metrics import Metrics
from visenc.tasks import spawn, stop_task
from visenc_client.format import Entry

log = logging.getLogger(__name__)

#: first pause between polls of a watched image, seconds (doubles up to ``poll_max_s``)
FIRST_POLL_S = 0.001


@dataclass(eq=False, slots=True)
class _Watch:
    job: Job
    since: float
    due: float
    interval: float


class RemoteWaits:
    def __init__(
        self,
        claims: Claims,
        scheduler: Scheduler,
        outputs: Outputs,
        *,
        poll_max_s: float,
        wait_s: float,
        metrics: Metrics,
    ) -> None:
        self.claims = claims
        self.scheduler = scheduler
        self.outputs = outputs
        self.poll_max_s = max(poll_max_s, FIRST_POLL_S)
        self.wait_s = wait_s
        self.metrics = metrics
        self._watched: dict[str, _Watch] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def watch(self, job: Job) -> None:
        """Wait for another replica to encode ``job`` (not queued here unless the owner goes away)."""
        job.state = JobState.WATCHING
        now = time.monotonic()
        self._watched[job.key] = _Watch(job, now, now + FIRST_POLL_S, FIRST_POLL_S)
        self.metrics.claim_waiting.set(len(self._watched))
        self._wake.set()

    async def begin(self, job: Job) -> bool:
        """The scheduler's gate as ``job``'s encode starts: whether to encode it here (the claim is
        ours). Otherwise it is completed with the entry another replica wrote, or watched."""
        if job.unclaimed:
            return True
        got = await self.claims.begin(job)
        if isinstance(got, Entry):
            self.outputs.complete_remote(job, got)
        elif not got:
            self.watch(job)
        return got is True

    @property
    def watching(self) -> int:
        return len(self._watched)

    def start(self) -> None:
        self._task = spawn(self._run(), "remote-waits", self.metrics)

    async def stop(self) -> None:
        await stop_task(self._task)
        self._task = None
        watched, self._watched = [w.job for w in self._watched.values()], {}
        self.outputs.fail(watched, NotReady("the service is shutting down"))
        self.metrics.claim_waiting.set(0)

    async def _run(self) -> None:
        while True:
            now = time.monotonic()
            wake_at = min([w.due for w in self._watched.values()], default=now + 3600)
            if wake_at > now:
                self._wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), wake_at - now)
                continue
            try:
                await self._poll([w for w in self._watched.values() if w.due <= now])
            except Exception:  # the store swallows Redis errors; anything else is a bug: log, go on
                log.exception("remote wait poll failed")
                await asyncio.sleep(self.poll_max_s)

    def _unwatch(self, w: _Watch) -> None:
        if self._watched.get(w.job.key) is w:
            del self._watched[w.job.key]
        self.metrics.claim_waiting.set(len(self._watched))

    async def _poll(self, due: list[_Watch]) -> None:
        live = []
        for w in due:
            if w.job.state is not JobState.WATCHING:  # finished, or adopted by a local encode
                self._unwatch(w)
            elif w.job.interest <= 0:
                self._unwatch(w)
                self.outputs.fail([w.job], Cancelled("every request waiting for this image went away"))
            else:
                live.append(w)
        if not live:
            return
        replies = await self.claims.look([w.job.key for w in live])
        now = time.monotonic()
        for i, w in enumerate(live):
            if self._watched.get(w.job.key) is not w or w.job.state is not JobState.WATCHING:
                continue
            reply = None if replies is None else replies[i]
            # a fetch (no bytes) also waits while some replica has the image queued
            waits = (ClaimState.HELD,) if w.job.data is not None else (ClaimState.HELD, ClaimState.QUEUED)
            if isinstance(reply, Entry):
                self._unwatch(w)
                self.metrics.claims.labels("ready").inc()
                self.outputs.complete_remote(w.job, reply)
            elif reply not in waits or now - w.since >= self.wait_s:
                # claim gone without an entry (owner died or failed), Redis unavailable, or waited long
                # enough: encode here
                self._unwatch(w)
                outcome = "unavailable" if reply is None else "timeout" if reply in waits else "takeover"
                self.metrics.claims.labels(outcome).inc()
                w.job.unclaimed = outcome == "timeout"
                self._take_over(w.job)
            else:
                w.interval = min(w.interval * 2, self.poll_max_s)
                w.due = now + w.interval

    def _take_over(self, job: Job) -> None:
        if job.data is None:  # a fetch watched another replica's encode: no bytes to encode it here
            self.outputs.fail(
                [job],
                NotFound(
                    f"image {job.image_hash} was being encoded by another replica that did "
                    "not finish; encode it again with its bytes"
                ),
            )
            return
        self.claims.queued(job)
        self.scheduler.submit(job)
