"""This replica's cross-replica encode claims: mark queued, claim at encode start, renew, unclaim."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Sequence

from visenc.engine.job import Job, JobState, Place
from visenc.index.redis_claims import ClaimState, RedisClaims
from visenc.metrics import Metrics
from visenc.tasks import spawn, stop_task
from visenc_client.format import Entry

log = logging.getLogger(__name__)


class Claims:
    """Event loop only, no lock; this replica's claims are its own, renewed by one task (``start`` to ``stop``)."""

    def __init__(self, store: RedisClaims, *, ttl_ms: int, metrics: Metrics) -> None:
        self.store = store
        self.token = uuid.uuid4().hex  # one per replica process: identifies its claims
        self.ttl_ms = ttl_ms
        self.metrics = metrics
        self._owned: dict[str, Job] = {}
        self._queued: dict[str, Job] = {}
        self._starting: list[tuple[Job, asyncio.Future[Entry | Place]]] = []
        self._flush: asyncio.Task[None] | None = None
        self._task: asyncio.Task[None] | None = None

    async def admit(self, keys: Sequence[str]) -> dict[str, Entry | Place]:
        """Per key: the entry (already encoded elsewhere), ``HERE`` (queue it here; marked queued, or
        Redis is unavailable) or ``ELSEWHERE`` (another replica is encoding it: wait)."""
        replies = await self.store.states(keys, "queue", self.token, self.ttl_ms)
        if replies is None:
            return dict.fromkeys(keys, Place.HERE)
        out: dict[str, Entry | Place] = {}
        for key, reply in zip(keys, replies):
            if reply is ClaimState.HELD:
                self.metrics.claims.labels("held").inc()
            elif isinstance(reply, Entry):
                self.metrics.claims.labels("ready").inc()
            out[key] = (
                reply if isinstance(reply, Entry) else Place.ELSEWHERE if reply is ClaimState.HELD else Place.HERE
            )
        return out

    def queued(self, job: Job) -> None:
        """``job`` waits in this replica's queue: keep its queued mark alive while it does."""
        self._queued[job.key] = job

    async def look(self, keys: Sequence[str]) -> list[Entry | ClaimState] | None:
        """Where each image stands (read only); ``None`` while Redis is unavailable."""
        return await self.store.states(keys, "look", self.token, self.ttl_ms)

    async def begin(self, job: Job) -> Entry | Place:
        """``job``'s encode starts: ``HERE`` (the claim is ours, or Redis is unavailable: encode it),
        its entry (another replica finished it) or ``ELSEWHERE`` (another replica is encoding it).

        The calls made before the event loop next turns share one pipelined round trip."""
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[Entry | Place] = loop.create_future()
        self._starting.append((job, answer))
        if self._flush is None:
            self._flush = spawn(self._claim_starting(), "claims-flush", self.metrics)
        return await answer

    async def _claim_starting(self) -> None:
        await asyncio.sleep(0)  # the other jobs of this dispatch join the round trip
        starting, self._starting, self._flush = self._starting, [], None
        try:
            replies = await self.store.states([job.key for job, _ in starting], "claim", self.token, self.ttl_ms)
        except BaseException as e:  # the store swallows Redis errors: a bug, the encodes fail with it
            for _, answer in starting:
                if not answer.done():
                    answer.set_exception(e)
            raise
        unavailable: list[Entry | ClaimState | None] = [None] * len(starting)
        given_up = []
        for (job, answer), reply in zip(starting, replies or unavailable):
            outcome = "unavailable" if reply is None else "ready" if isinstance(reply, Entry) else reply.name.lower()
            self.metrics.claims.labels("owned" if outcome == "ours" else outcome).inc()
            mine = reply is None or reply is ClaimState.OURS
            if mine and reply is not None:
                self._owned[job.key] = job
            if answer.done() or job.finished:  # its encode was given up while we asked
                given_up.append(job.key)
            else:
                answer.set_result(reply if isinstance(reply, Entry) else Place.HERE if mine else Place.ELSEWHERE)
        for key in given_up:  # after every answer is out: no encode start waits on these round trips
            await self.unclaim(key)

    async def unclaim(self, key: str) -> None:
        """The entry of ``key`` is written (or its encode failed): let the claim go (if it is ours)."""
        if self._owned.pop(key, None) is not None:
            await self.store.unclaim([key], self.token)

    # --- renewal loop ------------------------------------------------------------------
    def start(self) -> None:
        self._task = spawn(self._renew_loop(), "claims-renew", self.metrics)

    async def stop(self) -> None:
        await stop_task(self._task)
        self._task = None
        owned, self._owned, self._queued = list(self._owned), {}, {}
        if owned:  # let other replicas take over at once instead of after the claims lapse
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.store.unclaim(owned, self.token), timeout=2.0)

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_ms / 3000)
            # a finished job stays owned until ``unclaim`` (after its entry is written), but needs no renewal
            owned = [k for k, job in self._owned.items() if not job.finished]
            self._queued = {k: job for k, job in self._queued.items() if job.state is JobState.QUEUED}
            try:
                if owned:
                    await self.store.renew_claims(owned, self.token, self.ttl_ms)
                if self._queued:
                    await self.store.mark_queued(list(self._queued), self.token, self.ttl_ms)
            except Exception:  # the store swallows Redis errors; anything else is a bug: log, go on
                log.exception("claim renewal failed")
