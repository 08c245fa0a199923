"""Outputs: from a forward's device tensors to resolved futures, off the device thread (``docs/internals.md``)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from visenc.devices import DONE, Device, Event
from visenc.engine.coordination import Coordination
from visenc.engine.job import Job
from visenc.errors import Cancelled, EncodeFailed, PayloadTooLarge, VisencError
from visenc.index.tiered import Index
from visenc.metrics import Metrics
from visenc.tasks import spawn, stop_task
from visenc_client.format import Entry, pack_entry, tensor_words

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Forwarded:
    batch: list[Job]
    outputs: list[torch.Tensor]
    #: the events recorded after and before the forward on the device's stream
    end: Event = DONE
    start: Event | None = None
    #: bytes of its rows, held on the device until copied out
    nbytes: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.nbytes = sum(o.nbytes for o in self.outputs)


@dataclass(slots=True)
class _Done:
    jobs: list[Job]
    entries: list[Entry]
    #: written by another replica: nothing encoded or to write here
    remote: bool = False


@dataclass(slots=True)
class _Failed:
    jobs: list[Job]
    error: BaseException


raw_rows = tensor_words  # a CPU tensor's values as numpy without a copy (bfloat16 as its 16-bit words)


class Outputs:
    """Event loop (its task), plus one output thread for copies; ``start`` then ``stop``; alone finishes jobs."""

    def __init__(
        self,
        *,
        index: Index,
        metrics: Metrics,
        fingerprint: str,
        hidden_size: int,
        runtime: Device,
        coordination: Coordination,
        max_held_bytes: int | None = None,
    ) -> None:
        self.index = index
        self.metrics = metrics
        self.fingerprint = fingerprint
        self.hidden_size = hidden_size
        self.coordination = coordination
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="visenc-output")
        self.runtime = runtime
        #: rows made on the device and not yet copied out: bounded (``wait_for_room``), counted in the budget
        self.max_held_bytes = max_held_bytes
        self.held_bytes = self.peak_held_bytes = 0
        self._room = threading.Condition()
        self._queue: asyncio.Queue[_Done | _Failed] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._copies: set[concurrent.futures.Future[list[Entry]]] = set()
        self._writes: set[asyncio.Task[None]] = set()
        #: called on the loop with (batch, seconds) after each batch's outputs are materialised
        self.on_materialised: Callable[[list[Job], float], None] | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = spawn(self._run(), "outputs", self.metrics)

    async def stop(self, timeout_s: float) -> None:
        """Finish the copies in progress (up to ``timeout_s``), answer everything queued, stop."""
        if copies := list(self._copies):
            await asyncio.to_thread(concurrent.futures.wait, copies, timeout_s)
        await self._drain()
        await stop_task(self._task)
        if self._writes:
            await asyncio.wait(self._writes, timeout=timeout_s)
        self._thread.shutdown(wait=False, cancel_futures=True)

    @property
    def pending_writes(self) -> int:
        return len(self._writes)

    def wait_for_room(self, nbytes: int, given_up: Callable[[], bool]) -> bool:
        """On the device thread: wait while ``nbytes`` more rows would pass the bound; whether it waited."""
        if self.max_held_bytes is None:
            return False
        with self._room:
            waited = False
            while self.held_bytes and self.held_bytes + nbytes > self.max_held_bytes and not given_up():
                waited = True
                self._room.wait(0.05)
            return waited

    def _hold(self, nbytes: int) -> None:
        with self._room:
            self.held_bytes += nbytes
            self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
            if nbytes < 0:
                self._room.notify_all()

    def submit(self, forwarded: Forwarded) -> None:
        """A forward was launched (any thread): copy and pack its outputs on the output thread."""
        assert self._loop is not None, "outputs are submitted after start"
        loop, t0 = self._loop, time.perf_counter()
        self._hold(forwarded.nbytes)
        try:
            copy = self._thread.submit(self._materialise, forwarded)
        except BaseException:
            self._hold(-forwarded.nbytes)
            raise
        self._copies.add(copy)

        def copied(fut: concurrent.futures.Future[list[Entry]]) -> None:
            self._copies.discard(fut)
            try:
                loop.call_soon_threadsafe(self._landed, forwarded, fut, t0)
            except RuntimeError:  # the event loop is closed: nobody is left to answer
                pass

        copy.add_done_callback(copied)

    def _landed(self, forwarded: Forwarded, fut: concurrent.futures.Future[list[Entry]], t0: float) -> None:
        if fut.cancelled():
            self.fail(forwarded.batch, EncodeFailed("encoding was cancelled"))
            return
        error = fut.exception()
        if error is not None:
            log.error("copying out a forward of %d images failed", len(forwarded.batch), exc_info=error)
            self.metrics.encode_failures.labels("output").inc(len(forwarded.batch))
            self.fail(forwarded.batch, EncodeFailed(f"encoding failed: {type(error).__name__}"))
            return
        if forwarded.start is not None:  # the Encode-Time header is the device's time, as the histogram's
            for job in forwarded.batch:
                job.forward_s = self.runtime.seconds(forwarded.start, forwarded.end)
        if self.on_materialised is not None:
            self.on_materialised(forwarded.batch, time.perf_counter() - t0)
        self.metrics.output_seconds.observe(time.perf_counter() - t0)
        self._queue.put_nowait(_Done(forwarded.batch, fut.result()))

    def fail(self, jobs: Sequence[Job], error: BaseException) -> None:
        """Fail ``jobs`` (any stage): marked failed now, answered by the output task."""
        # a job its thread handed over while its task still runs is both preparing and ready: failed once
        live = list({id(j): j for j in jobs if not j.finished}.values())
        for job in live:
            job.fail()
        if live:
            self._queue.put_nowait(_Failed(live, error))

    def complete_remote(self, job: Job, entry: Entry) -> None:
        if not job.finished:
            self._queue.put_nowait(_Done([job], [entry], remote=True))

    def _materialise(self, forwarded: Forwarded) -> list[Entry]:
        batch, outputs = forwarded.batch, forwarded.outputs
        try:
            if len(outputs) != len(batch):
                raise RuntimeError(f"tower returned {len(outputs)} outputs for {len(batch)} images")
            hosts = self.runtime.copy_out(outputs, forwarded.end)
        finally:
            self._hold(-forwarded.nbytes)
        if forwarded.start is not None:
            self.metrics.forward_seconds.observe(self.runtime.seconds(forwarded.start, forwarded.end))
        entries = []
        for job, out in zip(batch, hosts):
            assert job.layout is not None
            if tuple(out.shape) != (job.layout.num_tokens, self.hidden_size):
                raise RuntimeError(
                    f"encoder produced {tuple(out.shape)}, expected ({job.layout.num_tokens}, {self.hidden_size})"
                )
            dtype = str(out.dtype).removeprefix("torch.")
            entries.append(
                pack_entry(
                    raw_rows(out),
                    dtype=dtype,
                    grid_thw=job.layout.grid_thw,
                    fingerprint=self.fingerprint,
                    hash=job.image_hash,
                )
            )
        return entries

    async def _run(self) -> None:
        while True:
            self._answer(await self._queue.get())

    async def _drain(self) -> None:
        while not self._queue.empty():
            self._answer(self._queue.get_nowait())

    def _answer(self, item: _Done | _Failed) -> None:
        if isinstance(item, _Done):
            for job, entry in zip(item.jobs, item.entries):
                self._complete(job, entry, remote=item.remote)
        else:
            for job in item.jobs:
                self._fail_now(job, item.error)

    def _complete(self, job: Job, entry: Entry, *, remote: bool) -> None:
        if job.finished:
            return
        if not self.index.store_local(job.key, entry, leases=job.readers):
            job.fail()  # never answered ready: nothing could read it (start-up sizes L1 for images)
            limit = f"cache_bytes={self.index.local.max_bytes}"
            self._fail_now(job, PayloadTooLarge(f"rows of {entry.nbytes} bytes exceed the in-process index, {limit}"))
            return
        job.finish()
        job.future.set_result(entry)
        if remote:
            return
        self.metrics.encoded_images.inc()
        self.metrics.encoded_tokens.inc(entry.rows)
        self._spawn(self._write_through(job.key, entry))

    def _fail_now(self, job: Job, error: BaseException) -> None:
        if isinstance(error, Cancelled):
            self.metrics.cancelled_images.inc()
        if not isinstance(error, VisencError):  # a bug in a stage: logged, answered without internals
            log.error("encode of %s failed", job.image_hash, exc_info=error)
            error = EncodeFailed(f"encoding failed: {type(error).__name__}")
        self._spawn(self.coordination.unclaim(job.key))
        if not job.future.done():
            job.future.set_exception(error)

    async def _write_through(self, key: str, entry: Entry) -> None:
        await self.index.write_through(key, entry)
        await self.coordination.unclaim(key)

    def _spawn(self, coro: Any) -> None:
        task = spawn(coro, "index-write", self.metrics)
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)
