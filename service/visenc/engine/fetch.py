"""The fetch path: an image's entry by its hash, waited for while it is encoded here or at another replica.

``Fetch.lookup`` finds where the image is, nearest first (``Located``): L1 or the in-flight map; else one
index round trip, then L1 and the map again (either may have changed meanwhile); else another replica's
encode, which a job here follows (``FOLLOWING``). A match on what was found answers: rows; a video's
manifest, answered with its tubes' rows (each fetched the same way); a job, waited for with its priority
raised; or ``NotFound``. Intake asks the same path where a video asked by its hash stands, without
waiting or following anything (``video_outcome``), and waits for its tubes (``wait_videos``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from functools import partial

from visenc.engine.coordination import Coordination
from visenc.engine.entries import EntryCheck
from visenc.engine.inflight import InFlight
from visenc.engine.items import MISSING, Failed, Found, Item, Missing, VideoPending
from visenc.engine.job import Job
from visenc.engine.scheduler import Scheduler
from visenc.engine.videos import Joins, tube_hashes
from visenc.errors import DeadlineExceeded, InvalidHash, NotFound, PayloadTooLarge
from visenc.index.tiered import Index
from visenc.metrics import Metrics
from visenc_client.format import Entry, entry_key, is_valid_hash


@dataclass(frozen=True, slots=True)
class Stored:
    """A tier holds it: its rows, or a video's manifest."""

    entry: Entry


@dataclass(frozen=True, slots=True)
class Encoding:
    """A job here encodes it, or follows another replica's encode of it."""

    job: Job


@dataclass(frozen=True, slots=True)
class Elsewhere:
    """Another replica encodes it (and nothing here follows it)."""


@dataclass(frozen=True, slots=True)
class Absent:
    """No tier holds it and nobody encodes it."""


Located = Stored | Encoding | Elsewhere | Absent
ABSENT = Absent()


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
        joins: Joins,
    ) -> None:
        self.index = index
        self.entries = entries
        self.inflight = inflight
        self.scheduler = scheduler
        self.coordination = coordination
        self.fetch_timeout_s = fetch_timeout_s
        self.metrics = metrics
        self.joins = joins
        self.fingerprint = entries.fingerprint

    async def lookup(self, image_hash: str, namespace: str, *, timeout_s: float | None = None) -> Entry:
        """The entry of an image, waiting (and raising its priority) if it is being encoded."""
        if not is_valid_hash(image_hash):
            raise InvalidHash("hash must be 64 lowercase hex digits (SHA-256 of the image bytes)")
        match await self._locate(entry_key(namespace, self.fingerprint, image_hash), image_hash, follow=True):
            case Stored(Entry(kind="video") as manifest):
                return await self.video_rows(manifest, image_hash, namespace, timeout_s)
            case Stored(entry):
                return entry
            case Encoding(job):
                return await self._wait(job, image_hash, timeout_s)
        raise NotFound(f"no embedding for image {image_hash} (never encoded, or evicted)")

    async def video_rows(self, manifest: Entry, video: str, namespace: str, timeout_s: float | None) -> Entry:
        """A video's rows: every tube of its manifest fetched (waited for while pending, ``NotFound`` for an
        evicted one), joined in order."""
        tubes = tube_hashes(manifest, video)
        self.joins.check(manifest, video)  # before its tubes are read: they would be read for nothing
        entries = await asyncio.gather(*(self.lookup(t, namespace, timeout_s=timeout_s) for t in tubes))
        return self.joins.rows(entry_key(namespace, self.fingerprint, video), manifest, video, entries)

    async def wait_videos(self, items: list[Item], namespace: str, timeout_s: float | None) -> None:
        """Each item that is a video asked by its hash whose tubes are being encoded (here or at another
        replica): its rows, once every tube is encoded (``timeout_s`` at most); missing if one was evicted."""
        for it in items:
            if isinstance(it.state, VideoPending):
                try:
                    rows = await self.video_rows(it.state.manifest, it.hash, namespace, timeout_s)
                    it.state = Found(replace(rows, blob=b""))  # its fields: the rows stay within ``joins``
                except NotFound:
                    it.state = MISSING
                except PayloadTooLarge as e:
                    it.state = Failed(e)

    async def video_outcome(
        self, manifest: Entry, video: str, namespace: str
    ) -> Found | VideoPending | Missing | Failed:
        """Where a video asked by its hash stands, without waiting or following anything: ready (its rows)
        once every tube is stored, missing while one is in no tier nor being encoded, else pending."""
        try:
            tubes = tube_hashes(manifest, video)
            self.joins.check(manifest, video)  # before its tubes are read: they would be read for nothing
        except NotFound:
            return MISSING
        except PayloadTooLarge as e:
            return Failed(e)
        found = await asyncio.gather(
            *(self._locate(entry_key(namespace, self.fingerprint, t), t, follow=False) for t in tubes)
        )
        stored = [f.entry for f in found if isinstance(f, Stored)]
        if len(stored) == len(found):
            try:
                rows = self.joins.rows(entry_key(namespace, self.fingerprint, video), manifest, video, stored)
                return Found(replace(rows, blob=b""))  # its fields: the rows stay within ``joins``
            except PayloadTooLarge as e:
                return Failed(e)
        return MISSING if any(isinstance(f, Absent) for f in found) else VideoPending(manifest)

    # --- where an image is -------------------------------------------------------------------
    async def _locate(self, key: str, image_hash: str, *, follow: bool) -> Located:
        """Where an image is, nearest first: the first place that holds or encodes it answers."""
        places: tuple[Callable[[str, str], Awaitable[Located]], ...] = (
            self._here,
            self._stored,
            self._here,  # again: an encode here may have finished, or started, during the round trip
            partial(self._elsewhere, follow=follow),
        )
        for place in places:
            found = await place(key, image_hash)
            if not isinstance(found, Absent):
                return found
        return ABSENT

    async def _here(self, key: str, image_hash: str) -> Located:
        """L1's entry, or the job in flight for ``key``."""
        if (entry := self.entries.peek(key, image_hash, video=True)) is not None:
            return Stored(entry)
        job = self.inflight.joinable(key)
        return ABSENT if job is None else Encoding(job)

    async def _stored(self, key: str, image_hash: str) -> Located:
        """Every tier, one round trip."""
        (entry,) = await self.index.get_many([key])
        entry = self.entries.checked(key, image_hash, entry, video=True)
        return ABSENT if entry is None else Stored(entry)

    async def _elsewhere(self, key: str, image_hash: str, *, follow: bool) -> Located:
        """Another replica's encode of ``key``; with ``follow``, a job here follows it (a local encode that
        brings the bytes adopts that job)."""
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
        """``job``'s entry, ahead of every job nobody fetches (``fetch_timeout_s`` at most)."""
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
