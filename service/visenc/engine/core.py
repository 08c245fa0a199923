"""The engine: builds its stages, starts and stops them, and is what the API talks to (``interface.EngineAPI``)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from visenc.config import Settings
from visenc.engine.budget import device_memory_budget, plan_budget
from visenc.engine.claims import Claims
from visenc.engine.coordination import Coordination, LocalCoordination, SharedCoordination
from visenc.engine.entries import EntryCheck
from visenc.engine.fetch import Fetch
from visenc.engine.inflight import InFlight
from visenc.engine.intake import FrontStages, Intake, IntakeConfig
from visenc.engine.locator import Locator
from visenc.engine.outputs import Outputs
from visenc.engine.pins import Pins
from visenc.engine.policy import SchedulerConfig
from visenc.engine.prepare import ImagePrep
from visenc.engine.scheduler import Scheduler
from visenc.engine.tenants import Tenants, export_backlog
from visenc.engine.threads import default_preprocess_workers
from visenc.engine.videos import Joins, Videos
from visenc.engine.worker import DeviceWorker
from visenc.errors import NotReady, VisencError
from visenc.index.redis_claims import RedisClaims
from visenc.index.tiered import Index
from visenc.metrics import Metrics
from visenc.models.base import VisionTower, compact
from visenc.tenancy import TenantPolicy, load_tenants
from visenc_client.format import Entry

log = logging.getLogger(__name__)


class Engine:
    """Built, started and stopped on the event loop, where the API calls it; ``stopping`` is its own flag."""

    def __init__(
        self,
        tower: VisionTower,
        index: Index,
        settings: Settings,
        metrics: Metrics,
        claim_store: RedisClaims | None = None,
    ) -> None:
        if tower.image_loader != settings.image_loader:
            raise ValueError(
                f"the tower's inputs follow the {tower.image_loader!r} image loader, the settings say "
                f"{settings.image_loader!r}: load it with image_loader={settings.image_loader!r}"
            )
        self.tower = tower
        self.index = index
        self.settings = settings
        self.metrics = metrics
        self.fingerprint = tower.fingerprint
        #: set once, by ``stop``: the engine takes no new work
        self.stopping = False
        workers = settings.preprocess_workers or default_preprocess_workers(tower.device)
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="visenc-pre")
        self.budget = plan_budget(
            tower,
            settings.memory_budget_bytes or device_memory_budget(tower.runtime, settings.memory_fraction),
            max_batch_tokens=settings.max_batch_tokens,
            prefetch_tokens=settings.prefetch_tokens,
            workers=workers,
        )
        log.debug("batch budget: %s", self.budget)  # bootstrap logs it as applied
        self._build_stages(
            ImagePrep(
                tower,
                max_image_bytes=settings.max_image_bytes,
                max_image_pixels=settings.max_image_pixels,
                max_video_frames=settings.max_video_frames,
                max_video_pixels=settings.max_video_pixels,
            ),
            claim_store,
        )

    def _build_stages(self, prep: ImagePrep, claim_store: RedisClaims | None) -> None:
        tower, index, settings, metrics = self.tower, self.index, self.settings, self.metrics
        self.coordination: Coordination = (
            LocalCoordination()
            if claim_store is None
            else SharedCoordination(
                Claims(claim_store, ttl_ms=settings.claim_ttl_ms, metrics=metrics),
                poll_max_s=settings.claim_poll_ms / 1000,
                wait_s=settings.claim_wait_s,
                metrics=metrics,
            )
        )
        self.outputs = Outputs(
            index=index,
            metrics=metrics,
            fingerprint=tower.fingerprint,
            hidden_size=tower.hidden_size,
            runtime=tower.runtime,
            coordination=self.coordination,
            max_held_bytes=self.budget.max_output_bytes,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_batch_tokens=self.budget.max_batch_tokens,
                max_batch_images=settings.max_batch_images,
                packable=tower.packable,
                prefetch_tokens=self.budget.prefetch_tokens,
                max_batch_bytes=self.budget.max_batch_bytes,
                batch_floor=settings.batch_floor,
            ),
            preprocess=lambda data: tower.stage(prep.preprocess(data)),
            pool=self.pool,
            outputs=self.outputs,
            coordination=self.coordination,
            metrics=metrics,
            batch_bytes=tower.forward_bytes,
            on_prepared=lambda job, s: metrics.preprocess_seconds.observe(s),
        )
        self.tenants = Tenants(
            load_tenants(settings, settings.api_keys_file),
            TenantPolicy(max_images=settings.tenant_max_images, max_queued_tokens=settings.tenant_max_queued_tokens),
            settings.max_queue_images,
            metrics,
            settings.busy_window_s,
        )
        self.worker = DeviceWorker(
            tower,
            self.scheduler,
            self.outputs,
            metrics=metrics,
            max_wait_s=settings.max_wait_ms / 1000,
            stall_timeout_s=settings.stall_timeout_s,
            restart_attempts=settings.worker_restart_attempts,
            heap_idle_s=settings.heap_idle_s,
            warm_up_timeout_s=settings.warm_up_timeout_s,
        )
        self._build_front(prep)

    def _build_front(self, prep: ImagePrep) -> None:
        tower, index, settings, metrics = self.tower, self.index, self.settings, self.metrics
        self.inflight = InFlight(self.scheduler, metrics)
        self.locator = Locator(index, EntryCheck(index, tower, metrics), self.inflight, self.coordination)
        tube_rows = tower.video.tube_tokens if tower.video is not None else (lambda grid: 0)
        joins = Joins(settings.joined_rows_bytes or 0, metrics, tube_rows, tower.hidden_size * tower.dtype.itemsize)
        self.videos = Videos(prep, self.pool, index, metrics, joins, self.locator)
        self.fetch = Fetch(self.locator, self.inflight, self.scheduler, self.videos, settings.fetch_timeout_s, metrics)
        self.pins = Pins(index, tower.fingerprint, self.videos)
        stages = FrontStages(
            self.locator,
            self.inflight,
            self.scheduler,
            self.fetch,
            self.videos,
            self.pins,
            self.tenants,
            self.not_ready_reason,
        )
        self.intake = Intake(IntakeConfig.of(settings), prep, self.pool, metrics, stages)
        self.encode = self.intake.encode

    async def start(self, on_fatal: Callable[[str], None] | None = None) -> None:
        """Start every stage; ``on_fatal(reason)`` is called if the device cannot be restarted."""
        self.worker.on_fatal = on_fatal
        self.outputs.start()
        self.worker.start()
        self.coordination.start()
        self.metrics.queue_capacity.set(self.settings.max_queue_images)
        self.export_gauges()

    async def stop(self) -> None:
        """Drain within ``shutdown_timeout_s``; never hangs on a stalled device."""
        timeout_s = self.settings.shutdown_timeout_s
        self.stopping = True
        self.intake.close()
        self.scheduler.cancel_all(NotReady("the service is shutting down"))
        await self.worker.stop(timeout_s)
        await self.coordination.stop_waits()
        await self.outputs.stop(timeout_s)
        await self.coordination.stop()
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def lookup(self, image_hash: str, namespace: str, *, timeout_s: float | None = None) -> Entry:
        return await self.fetch.lookup(image_hash, namespace, timeout_s=timeout_s)

    async def lookup_many(
        self, hashes: Sequence[str], namespace: str, *, timeout_s: float | None = None
    ) -> list[Entry | VisencError]:
        return await self.fetch.lookup_many(hashes, namespace, timeout_s=timeout_s)

    def precheck(self, namespace: str) -> None:
        self.tenants.precheck(namespace)

    def read(self, image_hash: str, namespace: str, lease: str | None, *, last: bool) -> None:
        self.pins.read(image_hash, namespace, lease, last=last)

    def not_ready_reason(self) -> str | None:
        if self.stopping:
            return "the service is shutting down"
        if not self.worker.healthy:
            return self.worker.reason or "the device worker is not running"
        return None

    def describe(self) -> dict[str, Any]:
        return self.tower.describe()

    def layout(self, width: int, height: int) -> dict[str, Any]:
        lay = self.tower.layout(width, height)
        return {
            "width": width,
            "height": height,
            "num_tokens": lay.num_tokens,
            "grid_thw": list(lay.grid_thw),
            "hidden_size": self.tower.hidden_size,
            "row_layout": self.tower.row_layout(),
            "span": compact(self.tower.span(width, height)),
        }

    def health(self) -> dict[str, Any]:
        return {
            "index": self.index.health(),
            "queue_depth": self.scheduler.depth,
            "compile": self.tower.compilation.describe(),
        }

    def export_gauges(self) -> None:
        self.metrics.queue_depth.set(self.scheduler.depth)
        backlog = [(job.priority, job.cost, job.admitted_at) for job in self.scheduler.backlog()]
        export_backlog(self.metrics, backlog, self.tenants.clock)
        self.metrics.worker_alive.set(1 if self.not_ready_reason() is None else 0)
        self.metrics.export_index_health(self.index.health())
