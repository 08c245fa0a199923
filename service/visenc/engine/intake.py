"""Intake, the front of the engine: admission and placement over the Locator's answers, single-flight,
waiting (``docs/internals.md``)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

from visenc.config import Settings
from visenc.engine.entries import wire_dtype
from visenc.engine.fetch import Fetch
from visenc.engine.inflight import InFlight
from visenc.engine.interface import EncodeItem, Handle, LeaseMode, Timing
from visenc.engine.items import (
    MISSING,
    Encodable,
    Failed,
    Found,
    Frames,
    HashOnly,
    ImageRequest,
    Item,
    Upload,
    VideoPending,
    handle_of,
    inspect,
    itemise,
    joined,
    outcome_of,
    waves,
)
from visenc.engine.job import Job, Place
from visenc.engine.locator import ENCODE, ENCODE_ROWS, Ask, Locator, Stored
from visenc.engine.pins import Pins, Reader
from visenc.engine.prepare import ImagePrep
from visenc.engine.scheduler import Scheduler
from visenc.engine.tenants import Tenants
from visenc.engine.videos import Videos
from visenc.errors import DeadlineExceeded, NotFound, NotReady, PayloadTooLarge
from visenc.index.memory import Lease
from visenc.metrics import Metrics
from visenc_client.format import DEFAULT_PRIORITY, Entry, Priority


@dataclass(frozen=True, slots=True)
class IntakeConfig:
    """The settings intake applies (``config.Settings`` documents each)."""

    max_items: int
    max_queue_images: int
    request_timeout_s: float

    @classmethod
    def of(cls, settings: Settings) -> IntakeConfig:
        return cls(settings.max_items, settings.max_queue_images, settings.request_timeout_s)


@dataclass(frozen=True, slots=True)
class FrontStages:
    """What the engine hands intake: the stages it shares with the fetch and read paths, and readiness."""

    locator: Locator
    inflight: InFlight
    scheduler: Scheduler
    fetch: Fetch
    videos: Videos
    pins: Pins
    tenants: Tenants
    not_ready_reason: Callable[[], str | None]


class Intake:
    """Admission and placement of an encode's items over the Locator's answers, then the wait.

    Event loop only, no lock; a request's items are its own. Lifecycle: open until ``close``, which
    refuses every later request."""

    def __init__(
        self, config: IntakeConfig, prep: ImagePrep, pool: Executor, metrics: Metrics, stages: FrontStages
    ) -> None:
        self.config, self.prep, self.pool, self.metrics = config, prep, pool, metrics
        self.tower = prep.tower
        self.dtype = wire_dtype(prep.tower.dtype)
        self.locator, self.inflight, self.scheduler = stages.locator, stages.inflight, stages.scheduler
        self.fetch, self.videos, self.pins = stages.fetch, stages.videos, stages.pins
        self.not_ready_reason, self.tenants = stages.not_ready_reason, stages.tenants
        self._closed = False

    def close(self) -> None:
        """No request is taken from now on (the engine is stopping)."""
        self._closed = True

    async def encode(
        self,
        items: Sequence[EncodeItem],
        namespace: str,
        *,
        wait: bool,
        timing: Timing | None = None,
        timeout_s: float | None = None,
        lease: LeaseMode = "anonymous",
        rows: bool = False,
        priority: Priority = DEFAULT_PRIORITY,
    ) -> list[Handle]:
        """``interface.EngineAPI.encode``."""
        if self._closed:
            raise NotReady("the service is shutting down")
        if len(items) > self.config.max_items:
            raise PayloadTooLarge(f"{len(items)} items exceed the limit of max_items={self.config.max_items}")
        asked = itemise(items)
        has_videos = any(isinstance(it.state, Frames) for it in asked)
        request = await self.videos.request(asked, namespace) if has_videos else ImageRequest(asked)
        admitted, reader = time.monotonic(), Reader.new(lease, waits=wait)
        try:
            jobs = await self._take_all(request.work, namespace, reader, ENCODE_ROWS if rows else ENCODE, priority)
            request.started(reader.of_pending(uploaded=True))
            if wait:
                await self._wait(jobs, request.work, admitted, timing, timeout_s, reader.lease)
                await self._wait_videos(request.work, namespace, timeout_s, rows)
            handles = [self._handle(it, rows) for it in request.work]
            return self.metrics.count_failed_items(request.answer(reader.handles(request.work, handles), rows=rows))
        except BaseException:  # refused, past the deadline, or the client went away
            self.pins.unpin(request.held, namespace, reader.lease)
            raise

    async def _take_all(
        self, work: list[Item], namespace: str, reader: Reader, ask: Ask, priority: Priority
    ) -> dict[int, Job]:
        """Every item taken, wave after wave (one wave where it may not fit: a 429 before any starts)."""
        order = self.inflight.next_request()
        uploads = sum(isinstance(it.state, Upload | Encodable) for it in work)
        fits = self.scheduler.depth + uploads <= self.config.max_queue_images
        exempt = False  # the tenant held nothing at the first wave: its later waves pass its quotas too
        try:
            for lo, hi in waves(work) if fits else [(0, len(work))]:
                exempt = await self._take(work[lo:hi], lo, namespace, (order, reader, priority, exempt), ask)
        except BaseException:
            for job in joined(work).values():
                self.inflight.leave(job, reader.lease)
            raise
        self.metrics.queue_depth.set(self.scheduler.depth)
        return joined(work)

    async def _take(
        self, part: list[Item], lo: int, namespace: str, by: tuple[int, Reader, Priority, bool], ask: Ask
    ) -> bool:
        """Inspect, locate, admit and start (or join) ``part`` (items ``lo``...); whether its tenant is exempt
        from its quotas (``Tenants.admit``)."""
        order, reader, priority, exempt = by
        await inspect(part, self.prep, self.pool)
        await self._locate(part, namespace, ask)
        new, exempt, (images, tokens) = self._admission(part, namespace, exempt)
        with self.tenants.reserved(namespace, images, tokens):  # admitted: counted while its place is asked
            placed = await self._place(part, new)
            for i, it in enumerate(part, lo):
                match it.state:
                    case Found(entry):
                        self.pins.hold(it.hash, namespace, entry, reader.lease)
                    case HashOnly() | Encodable():
                        keep = reader.of_pending(uploaded=isinstance(it.state, Encodable))
                        asker = (self.tenants.account(namespace), priority)
                        it.to(self.inflight.join_or_start(it, (order, i), placed.get(it.looked_up), keep, asker))
        return exempt

    async def _locate(self, items: list[Item], namespace: str, ask: Ask) -> None:
        """Each open item's place: stored (found), a video's manifest (a hash alone may be a video's), or
        still open (in flight, or nowhere)."""
        live = [it for it in items if it.open]
        for it in live:
            it.key = self.locator.key(namespace, it.hash)
        for it, where in zip(live, await self.locator.locate_many([it.hash for it in live], namespace, ask)):
            match where:
                case Stored(Entry(kind="video") as manifest) if isinstance(it.state, HashOnly):
                    it.to(await self.videos.outcome(manifest, it.hash, namespace, rows=ask.rows))
                case Stored(Entry(kind="rows") as entry):
                    it.to(Found(entry))

    def _admission(self, items: list[Item], namespace: str, exempt: bool) -> tuple[set[str], bool, tuple[int, int]]:
        live = [it for it in items if it.open]
        new = {
            it.looked_up
            for it in live
            if isinstance(it.state, Encodable) and self.inflight.joinable(it.looked_up) is None
        }
        if new or any(self.inflight.joinable(it.looked_up) for it in live):
            if (reason := self.not_ready_reason()) is not None:
                raise NotReady(reason)
        costs = [it.state.inspected.cost for it in live if isinstance(it.state, Encodable) and it.looked_up in new]
        exempt = self.tenants.admit(namespace, len(costs), sum(costs), exempt)  # a quota, or the queue limit: 429
        return new, exempt, (len(costs), sum(costs))

    async def _place(self, items: list[Item], new: set[str]) -> dict[str, Entry | Place]:
        """Where each new image is encoded; one stored meanwhile (here or by another replica) is found."""
        placed = await self.locator.place({it.looked_up: it.hash for it in items if it.open}, new)
        for it in items:
            if it.open and isinstance(entry := placed.get(it.looked_up), Entry):
                it.to(Found(entry))
        return placed

    def _handle(self, item: Item, rows: bool) -> Handle:
        return handle_of(item, self.tower.hidden_size, self.dtype, self.tower.video, rows=rows)

    async def _wait(
        self,
        jobs: dict[int, Job],
        work: list[Item],
        admitted: float,
        timing: Timing | None,
        timeout_s: float | None,
        reader: Lease | None,
    ) -> None:
        """Until every joined job is done (``timeout_s`` at most); each item takes its job's outcome."""
        if not jobs:
            return
        timeout_s = self.config.request_timeout_s if timeout_s is None else timeout_s
        try:
            _, not_done = await asyncio.wait({j.future for j in jobs.values()}, timeout=max(0.0, timeout_s))
            if not_done:
                limit = f"request_timeout_s={self.config.request_timeout_s}"
                raise DeadlineExceeded(f"{len(not_done)} images were not encoded within {limit}")
        finally:
            for job in jobs.values():
                self.inflight.leave(job, reader)
        if timing is not None:
            ran = list(jobs.values())
            # each waited from its admission, or this request's if it joined later, as the histogram counts
            waits = (j.dequeued_at - max(admitted, j.admitted_at) for j in ran if j.dequeued_at is not None)
            timing.queue_s = max((max(0.0, w) for w in waits), default=0.0)
            timing.encode_s = sum({j.started_at: j.forward_s or 0.0 for j in ran if j.started_at}.values())
        for i, job in jobs.items():
            work[i].to(outcome_of(job))

    async def _wait_videos(self, work: list[Item], namespace: str, timeout_s: float | None, rows: bool) -> None:
        """Each video asked by its hash whose tubes were being encoded: its rows once all are, or missing."""
        for it in work:
            if isinstance(it.state, VideoPending):
                try:
                    video = await self.fetch.video(it.state.manifest, it.hash, namespace, timeout_s)
                    it.to(Found(video if rows else dataclasses.replace(video, blob=b"")))
                except NotFound:
                    it.to(MISSING)
                except PayloadTooLarge as e:
                    it.to(Failed(e))
