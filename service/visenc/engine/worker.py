"""The device worker: one loop per device that feeds the tower batch after batch.

The loop itself is an asyncio task (batch formation and future resolution stay
on the event loop thread); the forward and the copy of its output into stored
values run on a single dedicated thread, so device work is serialised and the
event loop never blocks. A batch that raises fails only its own jobs; the loop
lives on.

Overlap: while the device thread runs batch N, the scheduler's CPU pool
preprocesses batch N+1 (up to ``prefetch_tokens`` staged), so the next forward
starts as soon as this one returns. On CUDA the worker owns one stream: its
host→device copies, kernels and the non-blocking device→host copies into
pinned memory are ordered on it, and only that stream is waited on.
``heartbeat`` advances every time the loop makes progress, so a stalled
forward is visible to readiness checks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np
import torch

from visenc.engine.job import Job
from visenc.engine.scheduler import Scheduler
from visenc.errors import EncodeFailed
from visenc.index.format import Entry, pack_entry
from visenc.metrics import Metrics
from visenc.models.base import VisionTower

log = logging.getLogger(__name__)

Complete = Callable[[Job, Entry], None]
Fail = Callable[[Job, BaseException], None]


def _raw_rows(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values as numpy without a copy (bfloat16 as its 16-bit words)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy()


def compile_tower(tower: VisionTower, max_graphs: int = 64) -> None:
    """``torch.compile`` the tower's module in place, shapes static: dynamo keeps one
    graph per input shape (resolution bucket x batch size) and runs shapes past
    ``max_graphs`` eagerly. A tower without a ``model`` module is left as it is."""
    module = getattr(tower, "model", None)
    if not isinstance(module, torch.nn.Module):
        log.warning("tower %s has no module to compile; running eagerly", tower.name)
        return
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, max_graphs)
    tower.model = torch.compile(module, dynamic=False)  # type: ignore[attr-defined]


class DeviceWorker:
    def __init__(
        self,
        tower: VisionTower,
        scheduler: Scheduler,
        *,
        complete: Complete,
        fail: Fail,
        metrics: Metrics,
        max_wait_s: float,
        compile_buckets: bool = False,
        stall_timeout_s: float = float("inf"),
    ) -> None:
        self.tower = tower
        self.scheduler = scheduler
        self._complete = complete
        self._fail = fail
        self.metrics = metrics
        self.max_wait_s = max_wait_s
        self.stall_timeout_s = stall_timeout_s
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="visenc-device")
        self._task: asyncio.Task[None] | None = None
        self._dtype = str(tower.dtype).removeprefix("torch.")
        if compile_buckets:
            compile_tower(tower)
        self._stream: Any = torch.cuda.Stream(tower.device) if tower.device.type == "cuda" else None
        #: monotonic time of the last sign of life; ``busy_since`` is set while a forward runs
        self.heartbeat = time.monotonic()
        self.busy_since: float | None = None
        self._stopping = False

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="visenc-device-worker")

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def stalled(self) -> bool:
        """A forward has run longer than ``stall_timeout_s`` (it cannot be interrupted: the
        device thread is stuck in it; the flag clears when it returns)."""
        busy = self.busy_since
        return busy is not None and time.monotonic() - busy > self.stall_timeout_s

    async def stop(self) -> None:
        self._stopping = True
        while self._task is not None and not self._task.done():
            # Python 3.11's wait_for swallows a cancel that lands as its inner wait completes
            # (the loop in ``next_batch``): cancel again until the task is really gone
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=1.0)
        self._thread.shutdown(wait=True, cancel_futures=True)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping:
            self.heartbeat = time.monotonic()
            batch = await self.scheduler.next_batch(self.max_wait_s, timeout_s=1.0)
            if not batch:
                continue
            started = time.monotonic()
            for job in batch:
                job.started_at = started
                self.metrics.queue_wait_seconds.observe(started - job.admitted_at)
            self.busy_since = started
            try:
                entries = await loop.run_in_executor(self._thread, self._forward, batch)
            except asyncio.CancelledError:
                for job in batch:
                    self._fail(job, EncodeFailed("the encoder shut down"))
                raise
            except Exception as e:
                log.exception("forward of %d images failed", len(batch))
                self.metrics.encode_failures.labels(type(e).__name__).inc(len(batch))
                err = EncodeFailed(f"encoding failed: {type(e).__name__}")
                for job in batch:
                    self._fail(job, err)
            else:
                elapsed = time.monotonic() - started
                self.metrics.forward_seconds.observe(elapsed)
                self.metrics.forwards.inc()
                self.metrics.batch_images.observe(len(batch))
                self.metrics.batch_tokens.observe(sum(j.cost for j in batch))
                self.metrics.encoded_images.inc(len(batch))
                self.metrics.encoded_tokens.inc(sum(e.rows for e in entries))
                for job, entry in zip(batch, entries):
                    job.forward_s = elapsed
                    self._complete(job, entry)
            finally:
                self.busy_since = None
                self.scheduler.done(batch)

    def _on_stream(self) -> AbstractContextManager[Any]:
        return torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()

    def _forward(self, batch: list[Job]) -> list[Entry]:
        """Device thread: one forward for the batch, then each image's rows into its stored value."""
        prepared = [job.prepared for job in batch]
        assert all(p is not None for p in prepared)
        with self._on_stream():
            outputs = self.tower.forward(prepared)  # type: ignore[arg-type]
        if len(outputs) != len(batch):
            raise RuntimeError(f"tower returned {len(outputs)} outputs for {len(batch)} images")
        entries = []
        for job, out in zip(batch, outputs):
            if tuple(out.shape) != (job.layout.num_tokens, self.tower.hidden_size):
                raise RuntimeError(
                    f"encoder produced {tuple(out.shape)}, expected ({job.layout.num_tokens}, "
                    f"{self.tower.hidden_size})"
                )
            entries.append(
                pack_entry(_raw_rows(out), dtype=self._dtype, grid_thw=job.layout.grid_thw,
                           fingerprint=self.tower.fingerprint, hash=job.image_hash)
            )
            job.prepared = None  # free the pixels now, not when the request ends
        return entries
