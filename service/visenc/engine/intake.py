"""Intake: the front of the engine. Admission, single-flight, look-ups, waiting.

A request is taken in waves (``items.waves``), each inspected, looked up (in-flight map, then one index
round trip), admitted and started before the next is hashed; every item ends with one outcome
(``items.py``), its own error never failing the others. A new image becomes one ``Job`` per key
(single-flight: later requests join it), encoded here or, with a shared index, waited for at the
replica already encoding it (``coordination.py``). Every entry read from a tier is checked against its
header and key first: a corrupt one is a miss. Intake owns the in-flight map: a job is in it from its
admission until its future is resolved (``outputs.py``); a finished job is never joined.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Executor

from visenc.config import Settings
from visenc.engine.coordination import Coordination
from visenc.engine.interface import EncodeItem, Handle, Timing
from visenc.engine.items import (
    MISSING,
    Failed,
    Found,
    Item,
    Outcome,
    Pending,
    VideoPending,
    handle_of,
    inspect,
    itemise,
    waves,
)
from visenc.engine.job import Job, JobState, Place
from visenc.engine.prepare import ImagePrep
from visenc.engine.scheduler import Scheduler
from visenc.engine.videos import expand, fold, inspect_videos, manifests, video_rows
from visenc.engine.worker import DeviceWorker
from visenc.errors import (
    DeadlineExceeded,
    EncodeFailed,
    InvalidHash,
    NotFound,
    NotReady,
    Overloaded,
    PayloadTooLarge,
    VisencError,
)
from visenc.index.tiered import Index
from visenc.metrics import Metrics
from visenc.tasks import spawn
from visenc_client.format import CorruptEntry, Entry, entry_key, is_valid_hash, unpack_entry

log = logging.getLogger(__name__)


class Intake:
    def __init__(
        self,
        *,
        index: Index,
        prep: ImagePrep,
        pool: Executor,
        scheduler: Scheduler,
        worker: DeviceWorker,
        settings: Settings,
        metrics: Metrics,
        coordination: Coordination,
    ) -> None:
        self.index = index
        self.prep = prep
        self.pool = pool
        self.scheduler = scheduler
        self.worker = worker
        self.settings = settings
        self.metrics = metrics
        self.coordination = coordination
        tower = prep.tower
        self.fingerprint = tower.fingerprint
        self.hidden_size = tower.hidden_size
        self.dtype = str(tower.dtype).removeprefix("torch.")
        self.inflight: dict[str, Job] = {}
        self._requests = itertools.count()
        self.closing = False

    # --- the in-flight map ---------------------------------------------------------------
    def _joinable(self, key: str) -> Job | None:
        job = self.inflight.get(key)
        return None if job is None or job.finished else job

    def _admit(self, key: str, image_hash: str, order: tuple[int, int]) -> Job:
        loop = asyncio.get_running_loop()
        job = Job(
            key=key, image_hash=image_hash, order=order, future=loop.create_future(), admitted_at=time.monotonic()
        )
        self.inflight[key] = job
        job.future.add_done_callback(lambda _: self._forget(job))
        self.metrics.inflight.set(len(self.inflight))
        return job

    def _forget(self, job: Job) -> None:
        if self.inflight.get(job.key) is job:
            del self.inflight[job.key]
        self.metrics.inflight.set(len(self.inflight))
        if not job.future.cancelled():
            job.future.exception()  # retrieved: a failed job nobody waits for is not logged

    # --- entries ---------------------------------------------------------------------------
    def _checked(self, key: str, image_hash: str, entry: Entry | None, *, video: bool = False) -> Entry | None:
        """``entry`` if its stored value matches its header and this key, else ``None`` (a miss); a video's
        manifest only where ``video`` asks for one. O(1): the header is parsed, the rows are not read."""
        if entry is None:
            return None
        try:
            stored = unpack_entry(entry.blob, fingerprint=self.fingerprint, hash=image_hash)
            if (stored.rows, stored.hidden, stored.dtype, stored.grid_thw) != (
                entry.rows,
                entry.hidden,
                entry.dtype,
                entry.grid_thw,
            ):
                raise CorruptEntry("entry fields differ from its stored header")
            if stored.kind != entry.kind:
                raise CorruptEntry("entry kind differs from its stored header")
            if stored.kind == "video":
                return entry if video else None
            if stored.hidden != self.hidden_size or stored.dtype != self.dtype:
                raise CorruptEntry(
                    f"entry is [{stored.rows}, {stored.hidden}] {stored.dtype}, the tower "
                    f"makes rows of {self.hidden_size} {self.dtype}"
                )
        except CorruptEntry as e:
            log.warning("corrupt index entry for image %s treated as a miss: %s", image_hash, e)
            self.metrics.corrupt_entries.inc()
            self.index.discard(key)
            return None
        return entry

    def _peek(self, key: str, image_hash: str) -> Entry | None:
        return self._checked(key, image_hash, self.index.peek(key))

    def _handle(self, item: Item) -> Handle:
        return handle_of(item, self.hidden_size, self.dtype, self.prep.tower.video)

    # --- the request path --------------------------------------------------------------------
    def not_ready_reason(self) -> str | None:
        """Why new work (misses) cannot be taken now; ``None`` when it can."""
        if self.closing:
            return "the service is shutting down"
        if not self.worker.healthy:
            return self.worker.reason or "the device worker is not running"
        return None

    def check_accepting(self) -> None:
        """503 unless new work (misses) can be taken now."""
        if (reason := self.not_ready_reason()) is not None:
            raise NotReady(reason)

    async def _lookup(self, items: list[Item], namespace: str) -> None:
        """Every tier, one round trip for the whole request (images in flight are not looked up)."""
        live = [it for it in items if it.open]
        for it in live:
            it.key = entry_key(namespace, self.fingerprint, it.hash)
        todo = [it for it in live if self._joinable(it.key) is None]
        if todo:
            for it, entry in zip(todo, await self.index.get_many([it.key for it in todo])):
                # a hash alone may be a video's: its key then holds the video's manifest
                found = self._checked(it.key, it.hash, entry, video=it.source is None)
                if found is None:
                    continue
                if found.kind != "video":
                    it.outcome = Found(found)
                    continue
                try:  # ready when every tube is; pending while one is encoded (a fetch waits)
                    it.outcome = Found(await self._video(found, it.hash, namespace, 0.0))
                except DeadlineExceeded:
                    it.outcome = VideoPending(found)
                except NotFound:  # a tube was evicted: missing (upload the frames again)
                    pass

    def _admission(self, items: list[Item]) -> set[str]:
        """Keys this request would queue; 503 / 429 when it cannot."""
        live = [it for it in items if it.open]
        new = {it.key for it in live if it.inspected is not None and self._joinable(it.key) is None}
        if new or any(self._joinable(it.key) for it in live):
            self.check_accepting()
        if self.scheduler.depth + len(new) > self.settings.max_queue_images:
            raise Overloaded(
                f"encoder queue is full (max_queue_images={self.settings.max_queue_images})", retry_after_s=1.0
            )
        return new

    async def _place(self, items: list[Item], new: set[str]) -> dict[str, Entry | Place]:
        """Where each new image is encoded (one round trip); an entry written meanwhile is taken."""
        placed = await self.coordination.admit(sorted(new)) if new else {}
        for it in items:
            got = placed.get(it.key)
            if it.open and it.inspected is not None and isinstance(got, Entry):
                if (entry := self._checked(it.key, it.hash, got)) is not None:
                    it.outcome = Found(entry)
                    self.index.store_local(it.key, entry)
        return placed

    def _start(self, it: Item, order: tuple[int, int], placed: dict[str, Entry | Place]) -> Job:
        assert it.inspected is not None and it.source is not None
        job = self._admit(it.key, it.hash, order)
        job.join()
        job.give_bytes(it.source, it.inspected)
        if placed.get(it.key) is Place.ELSEWHERE:
            self.scheduler.watch(job)  # another replica encodes it
        else:
            self.scheduler.submit(job)
        return job

    async def _take(self, part: list[Item], lo: int, namespace: str, order: int) -> list[tuple[Handle, Job | None]]:
        """Inspect, look up, admit and start (or join) ``part`` (items ``lo``...): handles and jobs."""
        await inspect(part, self.prep, self.pool)
        await self._lookup(part, namespace)
        placed = await self._place(part, self._admission(part))
        out: list[tuple[Handle, Job | None]] = []
        for i, it in enumerate(part, lo):
            if it.open and (entry := self._peek(it.key, it.hash)) is not None:
                it.outcome = Found(entry)  # finished while we looked elsewhere
            if it.open:
                it.outcome = self._join_or_start(it, (order, i), placed)
            elif isinstance(it.outcome, Found) and self.index.peek(it.key) is it.outcome.entry:
                self.index.pin(it.key)  # answered ready: kept until the caller reads it
            out.append((self._handle(it), it.outcome.job if isinstance(it.outcome, Pending) else None))
        return out

    def _join_or_start(self, it: Item, order: tuple[int, int], placed: dict[str, Entry | Place]) -> Outcome:
        """The job in flight for an open item, joined, or a new one with its bytes; missing without them."""
        job = self._joinable(it.key)
        if job is None:
            return Pending(self._start(it, order, placed)) if it.inspected is not None else MISSING
        self.metrics.singleflight_joins.inc()
        job.join()
        if job.state is JobState.FOLLOWING and it.source is not None and it.inspected is not None:
            job.give_bytes(it.source, it.inspected)  # a fetch's wait for another replica adopts the bytes
        return Pending(job)

    async def encode(
        self,
        items: Sequence[EncodeItem],
        namespace: str,
        *,
        wait: bool,
        timing: Timing | None = None,
        timeout_s: float | None = None,
    ) -> list[Handle]:
        """Handles for ``items`` in order; with ``wait``, once every admitted image is (``timeout_s`` at most)."""
        if self.closing:
            raise NotReady("the service is shutting down")
        if len(items) > self.settings.max_items:
            raise PayloadTooLarge(f"{len(items)} items exceed the limit of max_items={self.settings.max_items}")
        asked = itemise(items)
        if any(it.frames is not None for it in asked):
            await inspect_videos(asked, self.prep, self.pool)
        work, spans = expand(asked)  # a video is taken as its tubes
        order, admitted = next(self._requests), time.monotonic()
        handles: list[Handle] = []
        joined: dict[int, Job] = {}
        uploads = sum(it.source is not None for it in work)
        fits = self.scheduler.depth + uploads <= self.settings.max_queue_images
        try:  # one wave where the request may not fit: a 429 then comes before any of it starts
            for lo, hi in waves(work) if fits else [(0, len(work))]:
                for i, (handle, job) in enumerate(await self._take(work[lo:hi], lo, namespace, order), lo):
                    handles.append(handle)
                    if job is not None:
                        joined[i] = job
        except BaseException:
            for job in joined.values():  # a later wave was refused (429/503) or the client left
                self._leave(job)
            raise
        self.metrics.queue_depth.set(self.scheduler.depth)
        for key, manifest in manifests(spans, work, namespace, self.fingerprint):  # found by the video's hash
            self.index.store_local(key, manifest)
            spawn(self.index.write_through(key, manifest), "manifest-write", self.metrics)
        if wait and joined:
            await self._wait(joined, handles, work, admitted, timing, timeout_s)
        if wait:  # videos asked by hash whose tubes are being encoded (here or at another replica)
            for i, it in enumerate(work):
                if isinstance(it.outcome, VideoPending):
                    try:
                        it.outcome = Found(await self._video(it.outcome.manifest, it.hash, namespace, timeout_s))
                    except NotFound:  # a tube evicted meanwhile: missing
                        it.outcome = MISSING
                    handles[i] = self._handle(it)
        return fold(handles, spans)

    async def _wait(
        self,
        joined: dict[int, Job],
        handles: list[Handle],
        work: list[Item],
        admitted: float,
        timing: Timing | None,
        timeout_s: float | None,
    ) -> None:
        timeout_s = self.settings.request_timeout_s if timeout_s is None else timeout_s
        try:
            _, not_done = await asyncio.wait({j.future for j in joined.values()}, timeout=max(0.0, timeout_s))
            if not_done:
                raise DeadlineExceeded(
                    f"{len(not_done)} images were not encoded within request_timeout_s="
                    f"{self.settings.request_timeout_s}"
                )
        finally:
            for job in joined.values():  # also on cancellation (the client went away)
                self._leave(job)
        if timing is not None:
            jobs = list(joined.values())
            timing.queue_s = max((max(0.0, j.started_at - admitted) for j in jobs if j.started_at), default=0.0)
            timing.encode_s = sum({j.started_at: j.forward_s or 0.0 for j in jobs if j.started_at}.values())
        for i, job in joined.items():
            error = job.future.exception()
            if isinstance(error, NotReady):
                raise error  # device failed, stalled or shutting down: retry (503), not a per-image failure
            if isinstance(error, VisencError) and error.item_reason is None:
                error = EncodeFailed(error.message)
            if error is not None:
                work[i].outcome = Failed(error if isinstance(error, VisencError) else EncodeFailed("encoding failed"))
            else:
                work[i].outcome = Found(job.future.result())
            handles[i] = self._handle(work[i])

    def _leave(self, job: Job) -> None:
        """One waiter is done with ``job``; drop it if it is queued and nobody else wants it."""
        if job.leave():
            self.scheduler.drop(job)

    def served(self, image_hash: str, namespace: str) -> None:
        self.index.unpin(entry_key(namespace, self.fingerprint, image_hash))

    # --- fetch ---------------------------------------------------------------------------------
    async def _follow(self, key: str, image_hash: str) -> Job | None:
        """A job following another replica's encode of ``key`` (pending there), or ``None``; a local
        encode that brings the bytes adopts it."""
        if not await self.coordination.elsewhere(key):
            return None
        job = self._joinable(key)  # a local encode may have started while we asked
        if job is None:
            job = self._admit(key, image_hash, (next(self._requests), 0))
            self.scheduler.watch(job)
            self.metrics.claims.labels("fetch_wait").inc()
        return job

    async def lookup(self, image_hash: str, namespace: str, *, timeout_s: float | None = None) -> Entry:
        """The entry of an image, waiting (and raising its priority) if it is being encoded."""
        if not is_valid_hash(image_hash):
            raise InvalidHash("hash must be 64 lowercase hex digits (SHA-256 of the image bytes)")
        key = entry_key(namespace, self.fingerprint, image_hash)
        entry = self._checked(key, image_hash, self.index.peek(key), video=True)
        job = None if entry is not None else self._joinable(key)
        if entry is None and job is None:
            (entry,) = await self.index.get_many([key])
            entry = self._checked(key, image_hash, entry, video=True) or self._peek(key, image_hash)
            if entry is None:
                job = self._joinable(key) or await self._follow(key, image_hash)
                if job is None:
                    raise NotFound(f"no embedding for image {image_hash} (never encoded, or evicted)")
        if entry is not None:  # rows, or a video's manifest: its tubes' rows
            return entry if entry.kind != "video" else await self._video(entry, image_hash, namespace, timeout_s)
        assert job is not None
        return await self._wait_one(job, image_hash, timeout_s)

    async def _video(self, manifest: Entry, video: str, namespace: str, timeout_s: float | None) -> Entry:
        """A video's rows: every tube of its manifest looked up (waited for while pending)."""
        return await video_rows(manifest, video, lambda tube: self.lookup(tube, namespace, timeout_s=timeout_s))

    async def _wait_one(self, job: Job, image_hash: str, timeout_s: float | None) -> Entry:
        timeout_s = self.settings.fetch_timeout_s if timeout_s is None else timeout_s
        self.scheduler.bump(job)
        job.join()
        self.metrics.singleflight_waits.inc()
        try:
            done, _ = await asyncio.wait({job.future}, timeout=max(0.0, timeout_s))
        finally:
            self._leave(job)
            self.metrics.singleflight_waits.dec()
        if not done:
            raise DeadlineExceeded(
                f"image {image_hash} was not encoded within fetch_timeout_s={self.settings.fetch_timeout_s}"
            )
        return job.future.result()
