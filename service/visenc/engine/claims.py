"""Cross-replica single-flight: one forward per new image across every replica.

The in-process single-flight map (``Encoder.inflight``) stops one replica from
encoding an image twice; ``ClaimBoard`` stops two replicas from doing so.

Protocol (all of it Redis scripts, see ``index/redis.py``):

1. Before queueing the new images of a request, a replica runs one pipelined
   round trip that, per image and atomically, returns the entry if it was
   written meanwhile, else takes the image's **claim** (``SET claim token PX
   claim_ttl_ms``) if nobody holds it. Owned claims are queued here as usual;
   an image whose claim another replica holds becomes a *watched* job: it sits
   in the local in-flight map (local requests join it) but is not queued.
2. The owner **renews** its claims every ``claim_ttl_ms / 3`` while their jobs
   are queued or encoding, writes the entry (one atomic ``SET``), then
   **releases** the claim. A claim therefore lapses only if its owner dies.
3. A background loop **polls** the watched images, all due ones in one
   pipelined round trip of the same script, backing off from 1 ms to
   ``claim_poll_ms`` per image. Each poll either finds the entry (the job
   completes with it, no forward here), or finds the claim gone without an
   entry (owner died or failed: the claim is taken and the job is queued here),
   or, after ``claim_wait_s``, gives up waiting and queues the job here anyway.
   A watched job nobody waits for any more is cancelled.

Why polling and not pub/sub: the same script answers "done?", "owner gone?"
and "take over" atomically, works unchanged on Redis Cluster (pub/sub there is
broadcast or sharded, with per-node subscriptions to keep alive), survives
Redis restarts with no subscription to restore, and costs one small round trip
per tick for *all* watched images of this replica.

When Redis is unavailable every claim answers "encode here": replicas may then
encode the same image twice, which is correct, only wasteful.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from visenc.engine.job import Job
from visenc.engine.scheduler import Cancelled
from visenc.errors import NotReady
from visenc.index.format import Entry
from visenc.metrics import Metrics

log = logging.getLogger(__name__)

#: first pause between polls of a watched image, seconds (doubles up to ``poll_max_s``)
FIRST_POLL_S = 0.001


class ClaimStore(Protocol):
    """Where claims live (``RedisIndex``); every method answers ``None``/nothing on an outage."""

    async def claim_many(self, keys: Sequence[str], token: str, ttl_ms: int) -> list[Entry | bool] | None: ...

    async def renew_claims(self, keys: Sequence[str], token: str, ttl_ms: int) -> None: ...

    async def release_claims(self, keys: Sequence[str], token: str) -> None: ...

    async def claims_held(self, keys: Sequence[str]) -> list[bool] | None: ...


@dataclass(eq=False, slots=True)
class _Watch:
    job: Job
    since: float
    due: float
    interval: float


class ClaimBoard:
    """This replica's claims (owned) and the images it waits for (watched).

    Callbacks run on the event loop thread: ``ready(job, entry)`` when another
    replica's entry arrived, ``takeover(job)`` to queue a watched job here,
    ``fail(job, error)`` when nobody wants a watched job any more, or at shutdown."""

    def __init__(self, store: ClaimStore, *, ttl_ms: int, poll_max_s: float, wait_s: float, metrics: Metrics,
                 ready: Callable[[Job, Entry], None], takeover: Callable[[Job], None],
                 fail: Callable[[Job, BaseException], None]) -> None:
        self.store = store
        self.token = uuid.uuid4().hex  # one per replica process: identifies its claims
        self.ttl_ms = ttl_ms
        self.poll_max_s = max(poll_max_s, FIRST_POLL_S)
        self.wait_s = wait_s
        self.metrics = metrics
        self._ready, self._takeover, self._fail = ready, takeover, fail
        self._owned: dict[str, Job] = {}
        self._watched: dict[str, _Watch] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # --- request path ------------------------------------------------------------------
    async def claim(self, keys: Sequence[str]) -> dict[str, Entry | bool]:
        """Per key: the entry (already encoded elsewhere), ``True`` (encode here; the claim is ours,
        or Redis is unavailable) or ``False`` (another replica encodes it: ``watch`` the job)."""
        replies = await self.store.claim_many(keys, self.token, self.ttl_ms)
        if replies is None:
            self.metrics.claims.labels("unavailable").inc(len(keys))
            return dict.fromkeys(keys, True)
        for reply in replies:
            outcome = "owned" if reply is True else "held" if reply is False else "ready"
            self.metrics.claims.labels(outcome).inc()
        return dict(zip(keys, replies))

    async def held(self, key: str) -> bool:
        """Whether another replica is encoding ``key`` right now (its claim is held)."""
        replies = await self.store.claims_held([key])
        return bool(replies and replies[0])

    def own(self, job: Job) -> None:
        """``job`` is queued here under our claim: keep the claim alive until ``release``."""
        self._owned[job.key] = job

    def watch(self, job: Job) -> None:
        """Wait for another replica to encode ``job`` (not queued here unless the owner goes away)."""
        now = time.monotonic()
        self._watched[job.key] = _Watch(job, now, now + FIRST_POLL_S, FIRST_POLL_S)
        self.metrics.claim_waiting.set(len(self._watched))
        self._wake.set()

    async def release(self, key: str) -> None:
        """The entry of ``key`` is written (or its encode failed): let the claim go (if it is ours)."""
        if self._owned.pop(key, None) is not None:
            await self.store.release_claims([key], self.token)

    # --- background loop ------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="visenc-claims")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        watched, self._watched = list(self._watched.values()), {}
        for w in watched:
            self._fail(w.job, NotReady("the service is shutting down"))
        self.metrics.claim_waiting.set(0)
        owned, self._owned = list(self._owned), {}
        if owned:  # let other replicas take over at once instead of after the claims lapse
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.store.release_claims(owned, self.token), timeout=2.0)

    async def _run(self) -> None:
        renew_every_s = self.ttl_ms / 3000
        next_renew = time.monotonic() + renew_every_s
        while True:
            now = time.monotonic()
            wake_at = min([w.due for w in self._watched.values()] + [next_renew])
            if wake_at > now:
                self._wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), wake_at - now)
                continue
            try:
                if now >= next_renew:
                    next_renew = now + renew_every_s
                    await self._renew()
                due = [w for w in self._watched.values() if w.due <= now]
                if due:
                    await self._poll(due)
            except Exception:  # the store swallows Redis errors; anything else is a bug: log, go on
                log.exception("claim loop iteration failed")
                await asyncio.sleep(self.poll_max_s)

    async def _renew(self) -> None:
        # a finished job stays owned until ``release`` (after its entry is written), but needs no renewal
        keys = [k for k, job in self._owned.items() if not job.future.done()]
        if keys:
            await self.store.renew_claims(keys, self.token, self.ttl_ms)

    def _unwatch(self, w: _Watch) -> None:
        if self._watched.get(w.job.key) is w:
            del self._watched[w.job.key]
        self.metrics.claim_waiting.set(len(self._watched))

    async def _poll(self, due: list[_Watch]) -> None:
        live = []
        for w in due:
            if w.job.future.done():
                self._unwatch(w)
            elif w.job.interest <= 0:
                self._unwatch(w)
                self._fail(w.job, Cancelled("every request waiting for this image went away"))
            else:
                live.append(w)
        if not live:
            return
        replies = await self.store.claim_many([w.job.key for w in live], self.token, self.ttl_ms)
        now = time.monotonic()
        for i, w in enumerate(live):
            if self._watched.get(w.job.key) is not w or w.job.future.done():
                continue
            reply = None if replies is None else replies[i]
            if isinstance(reply, Entry):
                self._unwatch(w)
                self.metrics.claims.labels("ready").inc()
                self._ready(w.job, reply)
            elif reply is not False or now - w.since >= self.wait_s:
                # claim taken over (owner gone), Redis unavailable, or waited long enough: encode here
                self._unwatch(w)
                outcome = "takeover" if reply is True else "unavailable" if reply is None else "timeout"
                self.metrics.claims.labels(outcome).inc()
                self.own(w.job)
                self._takeover(w.job)
            else:
                w.interval = min(w.interval * 2, self.poll_max_s)
                w.due = now + w.interval
