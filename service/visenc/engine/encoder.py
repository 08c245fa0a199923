"""The engine's front door: index lookups, single-flight, admission, waiting.

``Encoder.encode`` turns a request's items into handles:

* the image hash is checked (or computed) from uploaded bytes off the event
  loop, and a mismatch is rejected, so no request can write an entry under a
  hash its bytes do not have; a hash-only item can only *hit*, never create;
* lookups go in-flight map → the index tiers, one round trip for the whole
  request;
* a miss with bytes becomes one ``Job`` per distinct key (**single-flight**:
  concurrent requests for the same new image join the job in flight);
* the job is finished on the event loop thread: its entry is stored in the
  local tier *before* it leaves the in-flight map, so a later lookup always
  finds one or the other and an image is never encoded twice;
* every entry read from any tier is checked against its header and its key
  (length, shape, dtype, fingerprint, image hash) before it is used: a corrupt
  or truncated one is a miss (re-encoded when bytes came), never served;
* a waiter that goes away (deadline, client disconnect) releases its
  interest; a queued job nobody wants any more is dropped before its forward;
* a forward running past ``stall_timeout_s`` marks the worker stalled: queued
  jobs fail with 503 at once and new work is refused with 503 (cache hits are
  still answered) until the forward returns.
* with a shared index, new images are also claimed across replicas
  (``engine/claims.py``): an image another replica is encoding is waited for,
  not encoded again.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from visenc.config import Settings
from visenc.engine.budget import device_memory_budget, plan_budget
from visenc.engine.claims import ClaimBoard, ClaimStore
from visenc.engine.job import Job, Timing
from visenc.engine.scheduler import Cancelled, Scheduler
from visenc.engine.threads import default_preprocess_workers
from visenc.engine.worker import DeviceWorker
from visenc.errors import (
    BadRequest,
    DeadlineExceeded,
    HashMismatch,
    NotFound,
    NotReady,
    Overloaded,
    PayloadTooLarge,
    VisencError,
)
from visenc.imaging.decode import decode, probe
from visenc.imaging.hashing import image_hash, is_valid_hash
from visenc.index.base import Index
from visenc.index.format import CorruptEntry, Entry, unpack_entry
from visenc.index.keys import entry_key
from visenc.metrics import Metrics
from visenc.models.base import Prepared, TokenLayout, VisionTower

log = logging.getLogger(__name__)

#: layout of a job known only by its hash (a fetch waiting for another replica's encode)
UNKNOWN_LAYOUT = TokenLayout(0, (0, 0, 0), None)
#: host bytes per source pixel while an image is decoded and resized: PIL holds
#: RGB as 4 bytes per pixel, plus the converted copy and resize buffers
DECODE_BYTES_PER_PIXEL = 8


@dataclass(slots=True)
class EncodeItem:
    hash: str | None = None
    data: bytes | None = None


@dataclass(slots=True)
class Handle:
    """What a caller learns about one image: enough to lay out its prompt."""

    hash: str
    status: str  # ready | pending | missing | error
    num_tokens: int | None = None
    hidden_size: int | None = None
    dtype: str | None = None
    grid_thw: tuple[int, int, int] | None = None
    error: str | None = None

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "hash": self.hash, "status": self.status, "num_tokens": self.num_tokens,
            "hidden_size": self.hidden_size, "dtype": self.dtype,
            "grid_thw": list(self.grid_thw) if self.grid_thw else None,
        }
        if self.error is not None:
            out["error"] = self.error
        return out


def _retrieve(fut: asyncio.Future[Any]) -> None:
    # a failed job nobody waits for must not log "exception was never retrieved"
    if not fut.cancelled():
        fut.exception()


class Encoder:
    def __init__(self, tower: VisionTower, index: Index, settings: Settings, metrics: Metrics,
                 claims: ClaimStore | None = None) -> None:
        self.tower = tower
        self.index = index
        self.settings = settings
        self.metrics = metrics
        self.fingerprint = tower.fingerprint
        self.dtype = str(tower.dtype).removeprefix("torch.")
        self.inflight: dict[str, Job] = {}
        self._requests = itertools.count()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._input_bytes = max(1, tower.input_bytes_per_token())
        workers = settings.preprocess_workers or default_preprocess_workers(tower.device)
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="visenc-pre")
        self.budget = plan_budget(
            tower,
            settings.memory_budget_bytes or device_memory_budget(tower.device, settings.memory_fraction),
            max_batch_tokens=settings.max_batch_tokens,
            prefetch_tokens=settings.prefetch_tokens,
        )
        log.info("batch budget: %s", self.budget)
        self.scheduler = Scheduler(
            preprocess=self._preprocess,
            pool=self.pool,
            fail=self._fail,
            max_batch_tokens=self.budget.max_batch_tokens,
            max_batch_images=settings.max_batch_images,
            packable=tower.packable,
            prefetch_tokens=self.budget.prefetch_tokens,
            max_batch_bytes=self.budget.max_batch_bytes,
            batch_bytes=tower.forward_bytes,
            on_prepared=lambda job, s: metrics.preprocess_seconds.observe(s),
        )
        self.worker = DeviceWorker(
            tower, self.scheduler, complete=self._complete, fail=self._fail, metrics=metrics,
            max_wait_s=settings.max_wait_ms / 1000, compile_buckets=settings.compile_buckets,
            stall_timeout_s=settings.stall_timeout_s,
        )
        self._closing = False
        self._watchdog: asyncio.Task[None] | None = None
        self.claims = None if claims is None else ClaimBoard(
            claims, ttl_ms=settings.claim_ttl_ms, poll_max_s=settings.claim_poll_ms / 1000,
            wait_s=settings.claim_wait_s, metrics=metrics, ready=self._complete_remote, takeover=self._queue,
            fail=self._fail,
        )

    # --- lifecycle -------------------------------------------------------------
    async def start(self) -> None:
        self.worker.start()
        if self.claims is not None:
            self.claims.start()
        self.metrics.worker_alive.set(1)
        self._watchdog = asyncio.get_running_loop().create_task(self._watch(), name="visenc-stall-watchdog")
        self.metrics.queue_capacity.set(self.settings.max_queue_images)

    async def stop(self) -> None:
        self._closing = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        self.scheduler.cancel_all(NotReady("the service is shutting down"))
        await self.worker.stop()
        if self.claims is not None:
            await self.claims.stop()
        for t in list(self._tasks):
            t.cancel()
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.metrics.worker_alive.set(0)

    @property
    def ready(self) -> bool:
        return not self._closing and self.worker.alive and not self.worker.stalled

    def not_ready_reason(self) -> str | None:
        """Why readiness is false (None when ready)."""
        if self._closing:
            return "the service is shutting down"
        if not self.worker.alive:
            return "the device worker is not running"
        if self.worker.stalled:
            return self._stall_error().message
        return None

    def _stall_error(self) -> NotReady:
        return NotReady(f"the device worker is stalled: a forward has run longer than stall_timeout_s="
                        f"{self.settings.stall_timeout_s}", **{"Retry-After": "5"})

    async def _watch(self) -> None:
        """Every ~quarter of ``stall_timeout_s`` (at most 1 s): while the worker is stalled, fail
        whatever is queued behind it so its waiters are answered now, not at their deadline."""
        interval = min(1.0, self.settings.stall_timeout_s / 4)
        was_stalled = False
        while True:
            await asyncio.sleep(interval)
            stalled = self.worker.stalled
            if stalled and not was_stalled:
                log.error("device worker stalled: forward running for more than %s s",
                          self.settings.stall_timeout_s)
                self.metrics.worker_stalls.inc()
            elif was_stalled and not stalled:
                log.warning("device worker recovered from a stall")
            was_stalled = stalled
            self.metrics.worker_alive.set(0 if stalled or not self.worker.alive else 1)
            if stalled:
                self.scheduler.fail_queued(self._stall_error())
                self.metrics.queue_depth.set(self.scheduler.depth)

    # --- CPU-side helpers (pool threads) ---------------------------------------
    def _inspect(self, item: EncodeItem, position: int) -> tuple[str, TokenLayout, int]:
        """Hash (and check) uploaded bytes and read the image size from its header."""
        assert item.data is not None
        digest = image_hash(item.data)
        if item.hash is not None and item.hash != digest:
            raise HashMismatch(
                f"item {position}: the uploaded bytes hash to {digest}, not to the given {item.hash}"
            )
        try:
            width, height = probe(item.data, max_pixels=self.settings.max_image_pixels)
        except VisencError as e:
            e.message = f"item {position}: {e.message}"
            e.args = (e.message,)
            raise
        return digest, self.tower.layout(width, height), width * height

    def _preprocess(self, data: bytes) -> Prepared:
        image = decode(data, max_pixels=self.settings.max_image_pixels)
        return self.tower.preprocess(image)

    # --- job completion (event loop thread) ------------------------------------
    def _complete(self, job: Job, entry: Entry, *, remote: bool = False) -> None:
        self.index.store_local(job.key, entry)
        if not remote:
            self._spawn(self._write_through(job.key, entry))
        if self.inflight.get(job.key) is job:
            del self.inflight[job.key]
        if not job.future.done():
            job.future.set_result(entry)
        self.metrics.inflight.set(len(self.inflight))

    def _complete_remote(self, job: Job, entry: Entry) -> None:
        """Another replica encoded a watched job: take its entry, run no forward."""
        self._complete(job, entry, remote=True)

    async def _write_through(self, key: str, entry: Entry) -> None:
        await self.index.write_remote(key, entry)
        if self.claims is not None:  # entry first, then the claim: a waiter never sees neither
            await self.claims.release(key)

    def _queue(self, job: Job) -> None:
        """Queue a job for the device here (a watched job whose owner went away)."""
        if job.data is None:  # a fetch watched another replica's encode: no bytes to encode it here
            self._fail(job, NotFound(f"image {job.image_hash} was being encoded by another replica that did "
                                     "not finish; encode it again with its bytes"))
            return
        self.scheduler.submit(job)
        self.metrics.queue_depth.set(self.scheduler.depth)

    def _fail(self, job: Job, error: BaseException) -> None:
        if self.inflight.get(job.key) is job:
            del self.inflight[job.key]
        if isinstance(error, Cancelled):
            self.metrics.cancelled_images.inc()
        if self.claims is not None and not self._closing:
            self._spawn(self.claims.release(job.key))
        if not job.future.done():
            if not isinstance(error, VisencError):
                log.error("encode of %s failed: %r", job.image_hash, error)
                self.metrics.encode_failures.labels(type(error).__name__).inc()
                error = VisencError(f"encoding failed: {type(error).__name__}")
            job.future.set_exception(error)
        self.metrics.inflight.set(len(self.inflight))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _handle(self, image_hash: str, status: str, layout: TokenLayout | None = None,
                error: str | None = None) -> Handle:
        if layout is None:
            return Handle(image_hash, status, error=error)
        return Handle(image_hash, status, layout.num_tokens, self.tower.hidden_size, self.dtype,
                      layout.grid_thw, error)

    @staticmethod
    def _entry_layout(entry: Entry) -> TokenLayout:
        return TokenLayout(entry.rows, entry.grid_thw, entry.grid_thw)

    def _checked(self, key: str, image_hash: str, entry: Entry | None) -> Entry | None:
        """``entry`` if its stored value matches its header and this key, else ``None`` (a miss).

        O(1): parses the ~200-byte header, checks the length; the rows are not read."""
        if entry is None:
            return None
        try:
            stored = unpack_entry(entry.blob, fingerprint=self.fingerprint, hash=image_hash)
            if (stored.rows, stored.hidden, stored.dtype, stored.grid_thw) != (
                entry.rows, entry.hidden, entry.dtype, entry.grid_thw
            ):
                raise CorruptEntry("entry fields differ from its stored header")
            if stored.hidden != self.tower.hidden_size or stored.dtype != self.dtype:
                raise CorruptEntry(f"entry is [{stored.rows}, {stored.hidden}] {stored.dtype}, the tower "
                                   f"makes rows of {self.tower.hidden_size} {self.dtype}")
        except CorruptEntry as e:
            log.warning("corrupt index entry for image %s treated as a miss: %s", image_hash, e)
            self.metrics.corrupt_entries.inc()
            self.index.discard_local(key)
            return None
        return entry

    def _peek(self, key: str, image_hash: str) -> Entry | None:
        return self._checked(key, image_hash, self.index.peek(key))

    def _release(self, job: Job) -> None:
        """One waiter is done with ``job``; drop it if it is queued and nobody else wants it."""
        job.interest -= 1
        if job.interest <= 0 and not job.future.done():
            self.scheduler.release(job)

    # --- the request path -------------------------------------------------------
    async def encode(self, items: Sequence[EncodeItem], namespace: str, *, wait: bool,
                     timing: Timing | None = None, timeout_s: float | None = None) -> list[Handle]:
        """Handles for ``items`` in order; with ``wait``, every admitted image is finished first,
        waiting up to ``timeout_s`` (default ``request_timeout_s``).

        ``timing``, when given, is filled with where this request's time went
        (see ``Timing``; it stays zero for hits and for ``wait=false``)."""
        if self._closing or not self.worker.alive:
            raise NotReady("the encoder is not running")
        if len(items) > self.settings.max_items:
            raise PayloadTooLarge(f"{len(items)} items exceed the limit of max_items={self.settings.max_items}")
        loop = asyncio.get_running_loop()
        hashes: list[str] = []
        for i, item in enumerate(items):
            if item.data is None:
                if item.hash is None or not is_valid_hash(item.hash):
                    raise BadRequest(f"item {i}: 'hash' must be 64 lowercase hex digits (SHA-256 of the bytes)")
            elif len(item.data) > self.settings.max_image_bytes:
                raise PayloadTooLarge(
                    f"item {i}: {len(item.data)} bytes exceed max_image_bytes={self.settings.max_image_bytes}"
                )
            elif item.hash is not None and not is_valid_hash(item.hash):
                raise BadRequest(f"item {i}: 'hash' must be 64 lowercase hex digits (SHA-256 of the bytes)")
            hashes.append(item.hash or "")

        inspected: dict[int, TokenLayout] = {}
        source_pixels: dict[int, int] = {}
        with_data = [i for i, it in enumerate(items) if it.data is not None]
        if with_data:
            results = await asyncio.gather(
                *(loop.run_in_executor(self.pool, self._inspect, items[i], i) for i in with_data)
            )
            for i, (digest, layout, npix) in zip(with_data, results):
                hashes[i] = digest
                inspected[i] = layout
                source_pixels[i] = npix

        keys = [entry_key(namespace, self.fingerprint, h) for h in hashes]
        found: list[Entry | None] = [None] * len(keys)
        lookup = [i for i, k in enumerate(keys) if k not in self.inflight]
        if lookup:  # every tier, one round trip for the whole request
            for i, entry in zip(lookup, await self.index.get_many([keys[i] for i in lookup])):
                found[i] = self._checked(keys[i], hashes[i], entry)

        new = {keys[i] for i in inspected if found[i] is None and keys[i] not in self.inflight}
        joins = any(found[i] is None and keys[i] in self.inflight for i in range(len(keys)))
        if (new or joins) and self.worker.stalled:
            raise self._stall_error()
        if self.scheduler.depth + len(new) > self.settings.max_queue_images:
            raise Overloaded(
                f"encoder queue is full (max_queue_images={self.settings.max_queue_images})", retry_after_s=1.0
            )

        claimed: dict[str, Entry | bool] = {}
        if self.claims is not None and new:  # one round trip: entry written meanwhile, or claim, or wait
            claimed = await self.claims.claim(sorted(new))
            for i in inspected:
                got = claimed.get(keys[i])
                if isinstance(got, Entry) and self._checked(keys[i], hashes[i], got) is not None:
                    found[i] = got
                    self.index.store_local(keys[i], got)

        order = next(self._requests)
        now = time.monotonic()
        handles: list[Handle] = []
        joined: dict[int, Job] = {}
        for i, (h, key) in enumerate(zip(hashes, keys)):
            entry = found[i]
            if entry is None:
                entry = self._peek(key, h)  # finished while we looked elsewhere
            if entry is not None:
                handles.append(self._handle(h, "ready", self._entry_layout(entry)))
                continue
            job = self.inflight.get(key)
            if job is None and i not in inspected:
                handles.append(self._handle(h, "missing"))  # hash-only: may hit, never create
                continue
            if job is None:
                job = Job(key=key, image_hash=h, layout=UNKNOWN_LAYOUT, cost=0, order=(order, i),
                          future=loop.create_future(), admitted_at=now, interest=1)
                self._give_bytes(job, items[i].data, inspected[i], source_pixels[i])
                job.future.add_done_callback(_retrieve)
                self.inflight[key] = job
                if claimed.get(key, True) is False:
                    assert self.claims is not None
                    self.claims.watch(job)  # another replica encodes it
                else:
                    self.scheduler.submit(job)
                    if self.claims is not None:
                        self.claims.own(job)
            else:
                self.metrics.singleflight_joins.inc()
                job.interest += 1
                if job.layout is UNKNOWN_LAYOUT and i in inspected:  # adopt a fetch's remote wait
                    self._give_bytes(job, items[i].data, inspected[i], source_pixels[i])
            joined[i] = job
            handles.append(self._handle(h, "pending", None if job.layout is UNKNOWN_LAYOUT else job.layout))
        self.metrics.inflight.set(len(self.inflight))
        self.metrics.queue_depth.set(self.scheduler.depth)

        if not wait or not joined:
            return handles  # wait=false: the interest taken above stays until the job ends
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
                self._release(job)
        if timing is not None:
            measured = Timing.of(now, list(joined.values()))
            timing.queue_s, timing.encode_s = measured.queue_s, measured.encode_s
        for i, job in joined.items():
            error = job.future.exception()
            if isinstance(error, NotReady):
                raise error  # stalled or shutting down: retry elsewhere (503), not a per-image failure
            if error is not None:
                handles[i] = self._handle(hashes[i], "error", error=str(error))
            else:
                handles[i] = self._handle(hashes[i], "ready", self._entry_layout(job.future.result()))
        return handles

    def _give_bytes(self, job: Job, data: bytes | None, layout: TokenLayout, source_pixels: int) -> None:
        """Attach an image's bytes and what they cost to stage (tower input and decode buffers)."""
        job.data, job.layout = data, layout
        job.cost = self.tower.input_tokens(layout)
        job.decode_cost = -(-DECODE_BYTES_PER_PIXEL * source_pixels // self._input_bytes)

    async def _watch_remote(self, key: str, image_hash: str) -> Job | None:
        """A job waiting for another replica's encode of ``key`` (its claim is held), or ``None``.

        The job has no bytes and no layout yet (``UNKNOWN_LAYOUT``); it sits in the in-flight map so
        later local requests join it, and a local encode that brings the bytes adopts it."""
        if self.claims is None or not await self.claims.held(key):
            return None
        job = self.inflight.get(key)  # a local encode may have started while we asked
        if job is None:
            job = Job(key=key, image_hash=image_hash, layout=UNKNOWN_LAYOUT, cost=0,
                      order=(next(self._requests), 0), future=asyncio.get_running_loop().create_future(),
                      admitted_at=time.monotonic())
            job.future.add_done_callback(_retrieve)
            self.inflight[key] = job
            self.claims.watch(job)
            self.metrics.claims.labels("fetch_wait").inc()
        return job

    async def lookup(self, image_hash: str, namespace: str, *, timeout_s: float | None = None) -> Entry:
        """The entry of an image, waiting (and raising its priority) if it is being encoded."""
        if not is_valid_hash(image_hash):
            raise BadRequest("hash must be 64 lowercase hex digits (SHA-256 of the image bytes)")
        key = entry_key(namespace, self.fingerprint, image_hash)
        entry = self._peek(key, image_hash)
        if entry is not None:
            return entry
        job = self.inflight.get(key)
        if job is None:
            (entry,) = await self.index.get_many([key])
            entry = self._checked(key, image_hash, entry)
            if entry is not None:
                return entry
            entry, job = self._peek(key, image_hash), self.inflight.get(key)
            if entry is not None:
                return entry
            if job is None:
                job = await self._watch_remote(key, image_hash)
            if job is None:
                raise NotFound(f"no embedding for image {image_hash} (never encoded, or evicted)")
        timeout_s = self.settings.fetch_timeout_s if timeout_s is None else timeout_s
        self.scheduler.bump(job)
        job.interest += 1
        self.metrics.singleflight_waits.inc()
        try:
            done, _ = await asyncio.wait({job.future}, timeout=max(0.0, timeout_s))
        finally:
            self._release(job)
            self.metrics.singleflight_waits.dec()
        if not done:
            raise DeadlineExceeded(f"image {image_hash} was not encoded within fetch_timeout_s="
                                   f"{self.settings.fetch_timeout_s}")
        return job.future.result()
