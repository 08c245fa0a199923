"""Images another replica is encoding: wait for its entry, or take over."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

from visenc.engine.claims import Claims
from visenc.engine.job import Job, JobState
from visenc.errors import Cancelled, NotReady
from visenc.index.redis_claims import ClaimState
from visenc.metrics import Metrics
from visenc.tasks import spawn, stop_task
from visenc_client.format import Entry

log = logging.getLogger(__name__)

#: the states of a job that waits for another replica
_WAITING = (JobState.WATCHING, JobState.FOLLOWING)
#: first pause between polls of a watched image, seconds (doubles up to ``poll_max_s``)
FIRST_POLL_S = 0.001


#: ``(job, outcome, timed_out)``: the entry, ``None`` (encode it here; ``timed_out`` when the other
#: replica still held the claim after ``claim_wait_s``) or the error to fail the job with
Ended: TypeAlias = Callable[[Job, "Entry | BaseException | None", bool], None]


@dataclass(eq=False, slots=True)
class _Watch:
    job: Job
    then: Ended
    since: float
    due: float
    interval: float


class RemoteWaits:
    """Event loop only, no lock; its watches are polled by one task (``start`` to ``stop``, which ends them all)."""

    def __init__(self, claims: Claims, *, poll_max_s: float, wait_s: float, metrics: Metrics) -> None:
        self.claims = claims
        self.poll_max_s = max(poll_max_s, FIRST_POLL_S)
        self.wait_s = wait_s
        self.metrics = metrics
        self._watched: dict[str, _Watch] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def watch(self, job: Job, then: Ended) -> None:
        """Wait for another replica to encode ``job`` (``WATCHING`` or ``FOLLOWING``); ``then`` is called
        once, when the wait ends."""
        now = time.monotonic()
        self._watched[job.key] = _Watch(job, then, now, now + FIRST_POLL_S, FIRST_POLL_S)
        self.metrics.claim_waiting.set(len(self._watched))
        self._wake.set()

    @property
    def watching(self) -> int:
        return len(self._watched)

    def start(self) -> None:
        self._task = spawn(self._run(), "remote-waits", self.metrics)

    async def stop(self) -> None:
        await stop_task(self._task)
        self._task = None
        watched, self._watched = list(self._watched.values()), {}
        self.metrics.claim_waiting.set(0)
        for w in watched:
            w.then(w.job, NotReady("the service is shutting down"), False)

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
            if w.job.state not in _WAITING:  # finished meanwhile
                self._unwatch(w)
            elif w.job.interest <= 0:
                self._unwatch(w)
                w.then(w.job, Cancelled("every request waiting for this image went away"), False)
            else:
                live.append(w)
        if not live:
            return
        replies = await self.claims.look([w.job.key for w in live])
        now = time.monotonic()
        for i, w in enumerate(live):
            if self._watched.get(w.job.key) is not w or w.job.state not in _WAITING:
                continue
            reply = None if replies is None else replies[i]
            # a fetch (no bytes) also waits while some replica has the image queued
            waits = (ClaimState.HELD, ClaimState.QUEUED) if w.job.state is JobState.FOLLOWING else (ClaimState.HELD,)
            if isinstance(reply, Entry):
                self._unwatch(w)
                self.metrics.claims.labels("ready").inc()
                w.then(w.job, reply, False)
            elif reply not in waits or now - w.since >= self.wait_s:
                # claim gone without an entry (owner died or failed), Redis unavailable, or waited long
                # enough: encode here
                self._unwatch(w)
                outcome = "unavailable" if reply is None else "timeout" if reply in waits else "takeover"
                self.metrics.claims.labels(outcome).inc()
                w.then(w.job, None, outcome == "timeout")
            else:
                w.interval = min(w.interval * 2, self.poll_max_s)
                w.due = now + w.interval
