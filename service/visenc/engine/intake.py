"""Intake, the front of the engine: admission, single-flight, placement, waiting (``docs/internals.md``)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from functools import partial

from visenc.config import Settings
from visenc.engine.coordination import Coordination
from visenc.engine.entries import EntryCheck
from visenc.engine.fetch import Fetch
from visenc.engine.inflight import InFlight
from visenc.engine.interface import EncodeItem, Handle, LeaseMode, Timing
from visenc.engine.items import (
    Encodable,
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
from visenc.engine.pins import Pins, Reader
from visenc.engine.prepare import ImagePrep
from visenc.engine.scheduler import Scheduler
from visenc.engine.tenants import Tenants
from visenc.engine.videos import Videos
from visenc.errors import DeadlineExceeded, NotReady, PayloadTooLarge
from visenc.index.memory import Lease
from visenc.index.tiered import Index
from visenc.metrics import Metrics
from visenc_client.format import DEFAULT_PRIORITY, Entry, Priority, entry_key


@dataclass(frozen=True, slots=True)
class FrontStages:
    """What the engine hands intake: the parts it shares with the fetch and read paths, and readiness."""

    entries: EntryCheck
    inflight: InFlight
    fetch: Fetch
    videos: Videos
    pins: Pins
    not_ready_reason: Callable[[], str | None]


class Intake:
    def __init__(
        self,
        *,
        index: Index,
        prep: ImagePrep,
        pool: Executor,
        scheduler: Scheduler,
        settings: Settings,
        metrics: Metrics,
        coordination: Coordination,
        stages: FrontStages,
        tenants: Tenants,
    ) -> None:
        self.index, self.prep, self.pool, self.coordination = index, prep, pool, coordination
        self.scheduler, self.settings, self.metrics = scheduler, settings, metrics
        self.tower, self.fingerprint = prep.tower, prep.tower.fingerprint
        self.entries, self.inflight, self.fetch = stages.entries, stages.inflight, stages.fetch
        self.videos, self.pins, self.not_ready_reason = stages.videos, stages.pins, stages.not_ready_reason
        self.closing = False
        self.tenants = tenants

    async def encode(
        self,
        items: Sequence[EncodeItem],
        namespace: str,
        *,
        wait: bool,
        timing: Timing | None = None,
        timeout_s: float | None = None,
        lease: LeaseMode = "anonymous",
        priority: Priority = DEFAULT_PRIORITY,
    ) -> list[Handle]:
        """``interface.EngineAPI.encode``."""
        if self.closing:
            raise NotReady("the service is shutting down")
        if len(items) > self.settings.max_items:
            raise PayloadTooLarge(f"{len(items)} items exceed the limit of max_items={self.settings.max_items}")
        asked = itemise(items)
        has_videos = any(isinstance(it.state, Frames) for it in asked)
        request = await self.videos.request(asked, namespace) if has_videos else ImageRequest(asked)
        admitted, reader = time.monotonic(), Reader.new(lease, waits=wait)
        try:
            jobs = await self._take_all(request.work, namespace, reader, priority)
            request.started(reader.of_pending(uploaded=True))
            if wait:
                await self._wait(jobs, request.work, admitted, timing, timeout_s, reader.lease)
                if any(isinstance(it.state, VideoPending) for it in request.work):  # videos asked by their hash
                    await self.videos.wait(request.work, namespace, self.fetch.lookup_in(namespace, timeout_s))
        except BaseException:  # refused, past the deadline, or the client went away
            self.pins.unpin(request.held, namespace, reader.lease)
            raise
        return request.answer(reader.handles(request.work, [self._handle(it) for it in request.work]))

    async def _take_all(self, work: list[Item], namespace: str, reader: Reader, priority: Priority) -> dict[int, Job]:
        """Every item taken, wave after wave (one wave where it may not fit: a 429 before any starts)."""
        order = self.inflight.next_request()
        uploads = sum(isinstance(it.state, Upload | Encodable) for it in work)
        fits = self.scheduler.depth + uploads <= self.settings.max_queue_images
        try:
            for lo, hi in waves(work) if fits else [(0, len(work))]:
                await self._take(work[lo:hi], lo, namespace, (order, reader, priority))
        except BaseException:
            for job in joined(work).values():
                self.inflight.leave(job, reader.lease)
            raise
        self.metrics.queue_depth.set(self.scheduler.depth)
        return joined(work)

    async def _take(self, part: list[Item], lo: int, namespace: str, by: tuple[int, Reader, Priority]) -> None:
        """Inspect, look up, admit and start (or join) ``part`` (items ``lo``...)."""
        order, reader, priority = by
        await inspect(part, self.prep, self.pool)
        await self._lookup(part, namespace)
        placed = await self._place(part, self._admission(part, namespace))
        for i, it in enumerate(part, lo):
            if it.open and (entry := self.entries.peek(it.looked_up, it.hash)) is not None:
                it.to(Found(entry))  # finished while we looked elsewhere
            match it.state:
                case Found(entry):
                    self.pins.hold(it.hash, namespace, entry, reader.lease)
                case HashOnly() | Encodable():
                    keep = reader.of_pending(uploaded=isinstance(it.state, Encodable))
                    asker = (self.tenants.account(namespace), priority)
                    it.to(self.inflight.join_or_start(it, (order, i), placed.get(it.looked_up), keep, asker))

    async def _lookup(self, items: list[Item], namespace: str) -> None:
        """Every tier, one round trip for the whole wave (images in flight are not looked up)."""
        live = [it for it in items if it.open]
        for it in live:
            it.key = entry_key(namespace, self.fingerprint, it.hash)
        todo = [it for it in live if self.inflight.joinable(it.looked_up) is None]
        step = self.index.batch_keys
        locate = partial(self.fetch.locate, namespace=namespace)
        for lo in range(0, len(todo), step):  # one batch of Redis reads at a time (``redis_batch_bytes``)
            for it, got in zip(
                todo[lo : lo + step], await self.index.get_many([it.looked_up for it in todo[lo : lo + step]])
            ):
                # a hash alone may be a video's: its key then holds the video's manifest
                match self.entries.checked(it.looked_up, it.hash, got, video=isinstance(it.state, HashOnly)):
                    case Entry(kind="video") as manifest:
                        it.to(await self.videos.outcome(manifest, it.hash, namespace, locate))
                    case Entry() as entry:
                        it.to(Found(entry))
            for it in todo[: lo + step]:  # what L1 let go (Redis still holds it) is answered from its fields
                if isinstance(it.state, Found) and self.index.peek(it.looked_up) is not it.state.entry:
                    it.to(Found(dataclasses.replace(it.state.entry, blob=b"")))

    def _admission(self, items: list[Item], namespace: str) -> set[str]:
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
        self.tenants.admit(namespace, len(costs), sum(costs))  # a quota, or the queue limit: 429
        return new

    async def _place(self, items: list[Item], new: set[str]) -> dict[str, Entry | Place]:
        placed = await self.coordination.admit(sorted(new)) if new else {}
        for it in items:
            if not isinstance(it.state, Encodable):
                continue
            if isinstance(got := placed.get(it.looked_up), Entry):
                if (entry := self.entries.checked(it.looked_up, it.hash, got)) is not None:
                    it.to(Found(entry))
                    self.index.store_local(it.looked_up, entry)
        return placed

    def _handle(self, item: Item) -> Handle:
        return handle_of(item, self.tower.hidden_size, self.entries.dtype, self.tower.video)

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
        timeout_s = self.settings.request_timeout_s if timeout_s is None else timeout_s
        try:
            _, not_done = await asyncio.wait({j.future for j in jobs.values()}, timeout=max(0.0, timeout_s))
            if not_done:
                limit = f"request_timeout_s={self.settings.request_timeout_s}"
                raise DeadlineExceeded(f"{len(not_done)} images were not encoded within {limit}")
        finally:
            for job in jobs.values():
                self.inflight.leave(job, reader)
        if timing is not None:
            ran = list(jobs.values())
            timing.queue_s = max((max(0.0, j.started_at - admitted) for j in ran if j.started_at), default=0.0)
            timing.encode_s = sum({j.started_at: j.forward_s or 0.0 for j in ran if j.started_at}.values())
        for i, job in jobs.items():
            work[i].to(outcome_of(job))
