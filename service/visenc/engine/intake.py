"""Intake: the front of the engine. Admission, single-flight, placement, waiting.

A request is taken in waves (``items.waves``), each inspected, looked up (in-flight map, then one index
round trip), admitted and started before the next is hashed; every item ends with one outcome
(``items.py``), its own error never failing the others. A new image becomes one ``Job`` per key
(single-flight: later requests and fetches join it, ``inflight.py``), encoded here or, with a shared
index, waited for at the replica already encoding it (``coordination.py``). A request with videos is
taken the same way, as its images and its videos' tubes (``videos.VideoRequest``). Every entry read from
a tier is checked first (``entries.py``); fetching by hash is the fetch path's (``fetch.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from concurrent.futures import Executor

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
from visenc.engine.videos import Joins, Videos
from visenc.engine.worker import DeviceWorker
from visenc.errors import DeadlineExceeded, NotReady, Overloaded, PayloadTooLarge
from visenc.index.memory import Lease
from visenc.index.tiered import Index
from visenc.metrics import Metrics
from visenc_client.format import Entry, entry_key


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
        self.index, self.prep, self.pool, self.coordination = index, prep, pool, coordination
        self.scheduler, self.worker, self.settings, self.metrics = scheduler, worker, settings, metrics
        self.tower, self.fingerprint = prep.tower, prep.tower.fingerprint
        # the parts intake shares with the fetch path, and its video side
        self.entries = EntryCheck(index, prep.tower, metrics)
        self.flight = InFlight(scheduler, metrics)
        video, row_bytes = self.tower.video, self.tower.hidden_size * self.tower.dtype.itemsize
        tube_rows = video.tube_tokens if video is not None else (lambda grid: 0)
        joins = Joins(settings.joined_rows_bytes or 0, metrics, tube_rows, row_bytes)
        self.fetch = Fetch(
            index, self.entries, self.flight, scheduler, coordination, settings.fetch_timeout_s, metrics, joins
        )
        self.videos = Videos(prep, pool, index, metrics)
        self.pins = Pins(index, self.fingerprint)
        self.closing = False

    @property
    def inflight(self) -> dict[str, Job]:
        """The jobs in flight, by key (``inflight.py``)."""
        return self.flight.jobs

    # --- readiness ------------------------------------------------------------------------------
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

    # --- the request path -------------------------------------------------------------------------
    async def encode(
        self,
        items: Sequence[EncodeItem],
        namespace: str,
        *,
        wait: bool,
        timing: Timing | None = None,
        timeout_s: float | None = None,
        lease: LeaseMode = "anonymous",
    ) -> list[Handle]:
        """Handles for ``items`` in order; with ``wait``, once every admitted image is (``timeout_s`` at most).
        Each ready or pending image is kept in L1 for the caller under one lease (``pins.py``)."""
        if self.closing:
            raise NotReady("the service is shutting down")
        if len(items) > self.settings.max_items:
            raise PayloadTooLarge(f"{len(items)} items exceed the limit of max_items={self.settings.max_items}")
        asked = itemise(items)
        has_videos = any(isinstance(it.state, Frames) for it in asked)
        request = await self.videos.request(asked, namespace) if has_videos else ImageRequest(asked)
        admitted, reader = time.monotonic(), Reader.new(lease, waits=wait)
        try:
            jobs = await self._take_all(request.work, namespace, reader)
            request.started(reader.of_pending(uploaded=True))
            if wait:
                await self._wait(jobs, request.work, admitted, timing, timeout_s, reader.lease)
                if any(isinstance(it.state, VideoPending) for it in request.work):  # videos asked by their hash
                    await self.fetch.wait_videos(request.work, namespace, timeout_s)
        except BaseException:  # refused in a later wave, past the deadline, or the client went away
            self.pins.unpin(request.held, namespace, reader.lease)  # its caller reads none of it
            raise
        return request.answer(reader.handles(request.work, [self._handle(it) for it in request.work]))

    async def _take_all(self, work: list[Item], namespace: str, reader: Reader) -> dict[int, Job]:
        """Every item taken, wave after wave: the jobs the request joined, by item. One wave where the
        request may not fit: a 429 then comes before any of it starts."""
        order = self.flight.next_request()
        uploads = sum(isinstance(it.state, Upload | Encodable) for it in work)
        fits = self.scheduler.depth + uploads <= self.settings.max_queue_images
        try:
            for lo, hi in waves(work) if fits else [(0, len(work))]:
                await self._take(work[lo:hi], lo, namespace, (order, reader))
        except BaseException:
            for job in joined(work).values():  # a later wave was refused (429/503) or the client left
                self.flight.leave(job, reader.lease)
            raise
        self.metrics.queue_depth.set(self.scheduler.depth)
        return joined(work)

    async def _take(self, part: list[Item], lo: int, namespace: str, by: tuple[int, Reader]) -> None:
        """Inspect, look up, admit and start (or join) ``part`` (items ``lo``...) for request ``by``
        (its arrival number and its reader)."""
        order, reader = by
        await inspect(part, self.prep, self.pool)
        await self._lookup(part, namespace)
        placed = await self._place(part, self._admission(part))
        for i, it in enumerate(part, lo):
            if it.open and (entry := self.entries.peek(it.key, it.hash)) is not None:
                it.state = Found(entry)  # finished while we looked elsewhere
            match it.state:
                case Found(entry):  # answered ready: L1 keeps it until the caller reads it
                    self.pins.hold(it.hash, namespace, entry, reader.lease)
                case HashOnly() | Encodable():
                    keep = reader.of_pending(uploaded=isinstance(it.state, Encodable))
                    it.state = self.flight.join_or_start(it, (order, i), placed.get(it.key), keep)

    async def _lookup(self, items: list[Item], namespace: str) -> None:
        """Every tier, one round trip for the whole wave (images in flight are not looked up)."""
        live = [it for it in items if it.open]
        for it in live:
            it.key = entry_key(namespace, self.fingerprint, it.hash)
        todo = [it for it in live if self.flight.joinable(it.key) is None]
        step = self.index.batch_keys
        for lo in range(0, len(todo), step):  # one batch of Redis reads at a time (``redis_batch_bytes``)
            for it, got in zip(
                todo[lo : lo + step], await self.index.get_many([it.key for it in todo[lo : lo + step]])
            ):
                # a hash alone may be a video's: its key then holds the video's manifest
                match self.entries.checked(it.key, it.hash, got, video=isinstance(it.state, HashOnly)):
                    case Entry(kind="video") as manifest:  # ready when every tube is, pending while one is encoded
                        it.state = await self.fetch.video_outcome(manifest, it.hash, namespace)
                    case Entry() as entry:
                        it.state = Found(entry)
            for it in todo[: lo + step]:  # what L1 let go (Redis still holds it) is answered from its fields
                if isinstance(it.state, Found) and self.index.peek(it.key) is not it.state.entry:
                    it.state = Found(dataclasses.replace(it.state.entry, blob=b""))

    def _admission(self, items: list[Item]) -> set[str]:
        """Keys this wave would queue; 503 / 429 when it cannot."""
        live = [it for it in items if it.open]
        new = {it.key for it in live if isinstance(it.state, Encodable) and self.flight.joinable(it.key) is None}
        if new or any(self.flight.joinable(it.key) for it in live):
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
            if isinstance(it.state, Encodable) and isinstance(got, Entry):
                if (entry := self.entries.checked(it.key, it.hash, got)) is not None:
                    it.state = Found(entry)
                    self.index.store_local(it.key, entry)
        return placed

    # --- answers ----------------------------------------------------------------------------------
    def _handle(self, item: Item) -> Handle:
        return handle_of(item, self.tower.hidden_size, self.entries.dtype, self.tower.video)

    # --- waiting ------------------------------------------------------------------------------------
    async def _wait(
        self,
        jobs: dict[int, Job],
        work: list[Item],
        admitted: float,
        timing: Timing | None,
        timeout_s: float | None,
        reader: Lease | None,
    ) -> None:
        """Until every joined job is done (``request_timeout_s`` at most); each item takes its job's outcome.
        A request that stops waiting first (deadline, client gone) takes its ``reader`` lease back."""
        if not jobs:
            return
        timeout_s = self.settings.request_timeout_s if timeout_s is None else timeout_s
        try:
            _, not_done = await asyncio.wait({j.future for j in jobs.values()}, timeout=max(0.0, timeout_s))
            if not_done:
                limit = f"request_timeout_s={self.settings.request_timeout_s}"
                raise DeadlineExceeded(f"{len(not_done)} images were not encoded within {limit}")
        finally:
            for job in jobs.values():  # also on cancellation (the client went away)
                self.flight.leave(job, reader)
        if timing is not None:
            ran = list(jobs.values())
            timing.queue_s = max((max(0.0, j.started_at - admitted) for j in ran if j.started_at), default=0.0)
            timing.encode_s = sum({j.started_at: j.forward_s or 0.0 for j in ran if j.started_at}.values())
        for i, job in jobs.items():
            work[i].state = outcome_of(job)
