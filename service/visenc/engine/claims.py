"""This replica's cross-replica encode claims: take, renew, release.

The in-process single-flight map (``engine/intake.py``) stops one replica from
encoding an image twice; claims stop two replicas from doing so. Protocol (the
Redis scripts are in ``index/redis_claims.py``):

1. Before queueing the new images of a request, intake runs one pipelined round
   trip that, per image and atomically, returns the entry if it was written
   meanwhile, else takes the image's **claim** (``SET claim token PX
   claim_ttl_ms``) if nobody holds it. Owned claims are queued here as usual;
   an image whose claim another replica holds is *watched* (``engine/remote.py``).
2. The owner **renews** its claims every ``claim_ttl_ms / 3`` while their jobs
   are unfinished, writes the entry (one atomic ``SET``), then **releases** the
   claim (``engine/outputs.py``). A claim therefore lapses only if its owner dies.

When Redis is unavailable every claim answers "encode here": replicas may then
encode the same image twice, which is correct, only wasteful.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Sequence

from visenc.engine.job import Job
from visenc.engine.threads import stop_task
from visenc.index.redis_claims import RedisClaims
from visenc.metrics import Metrics
from visenc_client.format import Entry

log = logging.getLogger(__name__)


class Claims:
    def __init__(self, store: RedisClaims, *, ttl_ms: int, metrics: Metrics) -> None:
        self.store = store
        self.token = uuid.uuid4().hex  # one per replica process: identifies its claims
        self.ttl_ms = ttl_ms
        self.metrics = metrics
        self._owned: dict[str, Job] = {}
        self._task: asyncio.Task[None] | None = None

    async def claim(self, keys: Sequence[str]) -> dict[str, Entry | bool]:
        """Per key: the entry (already encoded elsewhere), ``True`` (encode here; the claim is ours,
        or Redis is unavailable) or ``False`` (another replica encodes it)."""
        replies = await self.store.claim_many(keys, self.token, self.ttl_ms)
        if replies is None:
            self.metrics.claims.labels("unavailable").inc(len(keys))
            return dict.fromkeys(keys, True)
        for reply in replies:
            outcome = "owned" if reply is True else "held" if reply is False else "ready"
            self.metrics.claims.labels(outcome).inc()
        return dict(zip(keys, replies))

    async def poll(self, keys: Sequence[str]) -> list[Entry | bool] | None:
        """``claim`` for watched images, unrecorded: ``None`` while Redis is unavailable."""
        return await self.store.claim_many(keys, self.token, self.ttl_ms)

    async def held(self, key: str) -> bool:
        """Whether another replica is encoding ``key`` right now (its claim is held)."""
        replies = await self.store.claims_held([key])
        return bool(replies and replies[0])

    def own(self, job: Job) -> None:
        """``job`` is queued here under our claim: keep the claim alive until ``release``."""
        self._owned[job.key] = job

    async def release(self, key: str) -> None:
        """The entry of ``key`` is written (or its encode failed): let the claim go (if it is ours)."""
        if self._owned.pop(key, None) is not None:
            await self.store.release_claims([key], self.token)

    # --- renewal loop ------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._renew_loop(), name="visenc-claims")

    async def stop(self) -> None:
        await stop_task(self._task)
        self._task = None
        owned, self._owned = list(self._owned), {}
        if owned:  # let other replicas take over at once instead of after the claims lapse
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.store.release_claims(owned, self.token), timeout=2.0)

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_ms / 3000)
            # a finished job stays owned until ``release`` (after its entry is written), but needs no renewal
            keys = [k for k, job in self._owned.items() if not job.finished]
            try:
                if keys:
                    await self.store.renew_claims(keys, self.token, self.ttl_ms)
            except Exception:  # the store swallows Redis errors; anything else is a bug: log, go on
                log.exception("claim renewal failed")
