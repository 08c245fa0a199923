"""The fetch path: an image's entry by its hash, waited for while it is encoded here or at another replica."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from functools import partial

from visenc.engine.coordination import Coordination
from visenc.engine.entries import EntryCheck
from visenc.engine.inflight import InFlight
from visenc.engine.items import ABSENT, Absent, Elsewhere, Encoding, Located, Stored
from visenc.engine.job import Job
from visenc.engine.scheduler import Scheduler
from visenc.engine.videos import Videos
from visenc.errors import DeadlineExceeded, InvalidHash, NotFound
from visenc.index.tiered import Index
from visenc.metrics import Metrics
from visenc_client.format import Entry, entry_key, is_valid_hash


class Fetch:
    def __init__(
        self,
        index: Index,
        entries: EntryCheck,
        inflight: InFlight,
        scheduler: Scheduler,
        coordination: Coordination,
        fetch_timeout_s: float,
        metrics: Metrics,
        videos: Videos,
    ) -> None:
        self.index = index
        self.entries = entries
        self.inflight = inflight
        self.scheduler = scheduler
        self.coordination = coordination
        self.fetch_timeout_s = fetch_timeout_s
        self.metrics = metrics
        self.videos = videos
        self.fingerprint = entries.fingerprint

    async def lookup(self, image_hash: str, namespace: str, *, timeout_s: float | None = None) -> Entry:
        """The entry of an image, waiting (and raising its priority) if it is being encoded."""
        if not is_valid_hash(image_hash):
            raise InvalidHash("hash must be 64 lowercase hex digits (SHA-256 of the image bytes)")
        key = entry_key(namespace, self.fingerprint, image_hash)
        match await self._locate(key, image_hash, follow=True):
            case Stored(Entry(kind="video") as manifest):
                return await self.videos.rows(manifest, image_hash, namespace, self.lookup_in(namespace, timeout_s))
            case Stored(entry):
                return entry
            case Encoding(job):
                return await self._wait(job, image_hash, timeout_s)
        if (settling := self.inflight.settling(key)) is not None:  # finished: its answer is on its way
            answer = settling.future
            await asyncio.wait({answer}, timeout=self.fetch_timeout_s)
            if answer.done() and not answer.cancelled() and answer.exception() is None:
                return answer.result()
        if (failed := self.inflight.failure(key)) is not None:
            raise failed
        raise NotFound(f"no embedding for image {image_hash}: {self.index.absence(key)}")

    def lookup_in(self, namespace: str, timeout_s: float | None) -> Callable[[str], Awaitable[Entry]]:
        """``lookup`` of a hash in ``namespace``."""
        return lambda image_hash: self.lookup(image_hash, namespace, timeout_s=timeout_s)

    async def locate(self, image_hash: str, namespace: str) -> Located:
        """Where an image is, without waiting or following another replica's encode."""
        return await self._locate(entry_key(namespace, self.fingerprint, image_hash), image_hash, follow=False)

    async def _locate(self, key: str, image_hash: str, *, follow: bool) -> Located:
        """Nearest first: L1 or the in-flight map, the tiers, those two again, another replica."""
        places: tuple[Callable[[str, str], Awaitable[Located]], ...] = (
            self._here,
            self._stored,
            self._here,
            partial(self._elsewhere, follow=follow),
        )
        for place in places:
            found = await place(key, image_hash)
            if not isinstance(found, Absent):
                return found
        return ABSENT

    async def _here(self, key: str, image_hash: str) -> Located:
        if (entry := self.entries.peek(key, image_hash, video=True)) is not None:
            return Stored(entry)
        job = self.inflight.joinable(key)
        return ABSENT if job is None else Encoding(job)

    async def _stored(self, key: str, image_hash: str) -> Located:
        (entry,) = await self.index.get_many([key])
        entry = self.entries.checked(key, image_hash, entry, video=True)
        return ABSENT if entry is None else Stored(entry)

    async def _elsewhere(self, key: str, image_hash: str, *, follow: bool) -> Located:
        """Another replica's encode of ``key``; with ``follow``, a job here follows it."""
        if self.inflight.settling(key) is not None or self.inflight.failure(key) is not None:
            return ABSENT  # encoded or failed here: a mark of its in Redis is this replica's, not waited for
        if not await self.coordination.elsewhere(key):
            return ABSENT
        if (job := self.inflight.joinable(key)) is not None:  # a local encode may have started while we asked
            return Encoding(job)
        if not follow:
            return Elsewhere()
        job = self.inflight.admit(key, image_hash, (self.inflight.next_request(), 0))
        self.scheduler.watch(job)
        self.metrics.claims.labels("fetch_wait").inc()
        return Encoding(job)

    async def _wait(self, job: Job, image_hash: str, timeout_s: float | None) -> Entry:
        timeout_s = self.fetch_timeout_s if timeout_s is None else timeout_s
        self.scheduler.bump(job)
        job.join()
        self.metrics.singleflight_waits.inc()
        try:
            done, _ = await asyncio.wait({job.future}, timeout=max(0.0, timeout_s))
        finally:
            self.inflight.leave(job)
            self.metrics.singleflight_waits.dec()
        if not done:
            raise DeadlineExceeded(f"image {image_hash} was not encoded within fetch_timeout_s={self.fetch_timeout_s}")
        return job.future.result()
