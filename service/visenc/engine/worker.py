"""The device worker: starts, watches and restarts the device loop (``device.py``); ``docs/design.md``, "Failure
semantics"."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Callable
from typing import Any

from PIL import Image

from visenc.engine.device import DeviceLoop, Failure
from visenc.engine.job import Job
from visenc.engine.outputs import Outputs
from visenc.engine.scheduler import Scheduler
from visenc.engine.threads import DaemonThread
from visenc.errors import NotReady
from visenc.metrics import Metrics
from visenc.models import compiled
from visenc.models.base import VisionTower
from visenc.tasks import spawn

log = logging.getLogger(__name__)

#: the probe image a restart runs: the smallest every tower accepts (Qwen's processors refuse less than 56x56)
PROBE_SIZE = (56, 56)


class WorkerState(enum.Enum):
    #: a compiled tower's first forwards (its graphs are built): misses get 503, hits are answered
    WARMING = "warming"
    HEALTHY = "healthy"
    RESTARTING = "restarting"
    DEAD = "dead"
    STOPPED = "stopped"


class DeviceWorker:
    """On the event loop; its device loop on one daemon thread; ``state`` moves along ``WorkerState``."""

    def __init__(
        self,
        tower: VisionTower,
        scheduler: Scheduler,
        outputs: Outputs,
        *,
        metrics: Metrics,
        max_wait_s: float,
        stall_timeout_s: float,
        restart_attempts: int = 2,
        heap_idle_s: float = 2.0,
        warm_up_timeout_s: float | None = None,
    ) -> None:
        self.tower = tower
        self.scheduler = scheduler
        self.outputs = outputs
        self.metrics = metrics
        self.max_wait_s = max_wait_s
        self.stall_timeout_s = stall_timeout_s
        self.restart_attempts = restart_attempts
        self.warm_up_timeout_s = warm_up_timeout_s
        self.device = DeviceLoop(tower, scheduler, outputs, metrics=metrics, max_wait_s=max_wait_s)
        self.device.heap_idle_s = heap_idle_s
        self._thread = _device_thread()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.state = WorkerState.HEALTHY
        self.reason: str | None = None
        self.on_fatal: Callable[[str], None] | None = None

    def start(self) -> None:
        status = self.tower.compilation
        if status.state == "warming":
            limit = self.warm_up_limit_s()
            self.state = WorkerState.WARMING
            self.reason = f"warming up: compiling the tower ({status.detail}; up to {limit:.0f} s)"
        else:
            self.metrics.worker_alive.set(1)
        self._report_compile()
        self._task = spawn(self._run(), "device-worker", self.metrics)

    def warm_up_limit_s(self) -> float:
        return self.warm_up_timeout_s or compiled.warm_up_limit_s(self.tower.compiled_blocks)

    def _report_compile(self) -> None:
        status = self.tower.compilation
        self.metrics.set_compile_state(status.state, status.cause)
        self.metrics.compiled_graphs.set(status.graphs)
        eager_by_choice = status.state != "eager" or status.cause == "setting"
        log.log(logging.INFO if eager_by_choice else logging.WARNING, "%s", status.sentence())

    @property
    def heap_idle_s(self) -> float:
        return self.device.heap_idle_s

    @heap_idle_s.setter
    def heap_idle_s(self, seconds: float) -> None:
        self.device.heap_idle_s = seconds

    @property
    def busy_since(self) -> float | None:
        return self.device.busy_since

    @property
    def healthy(self) -> bool:
        return self.state is WorkerState.HEALTHY and self._task is not None and not self._task.done()

    async def stop(self, timeout_s: float) -> None:
        """Let the forward in progress finish (up to ``timeout_s``), then stop; never hangs."""
        self._stopping = True
        self.device.retire()
        deadline = time.monotonic() + timeout_s
        if self._task is not None and not self._task.done():
            await asyncio.wait({self._task}, timeout=timeout_s)
            if not self._task.done():
                log.warning("device worker did not finish its forward within %.1f s; abandoning it", timeout_s)
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
        self._thread.shutdown(wait=False)
        # a thread still inside torch when the interpreter exits aborts it: join it unless it is stuck
        await asyncio.to_thread(self._thread.join, max(0.0, deadline - time.monotonic()))
        self.state = WorkerState.STOPPED
        self.metrics.worker_alive.set(0)

    async def _warm_up(self) -> None:
        """Build a compiled tower's graphs within ``warm_up_limit_s``; past it, or on failure, run eagerly."""
        started, limit = time.monotonic(), self.warm_up_limit_s()
        try:
            with compiled.backend_failures() as failures:
                await self._device_call(self._warm_forwards, limit)
        except _Stalled:
            detail = f"the warm-up ran past warm_up_timeout_s={limit:g} (a compile that slow is abandoned)"
            await self._eager_after_warm_up(compiled.Status("eager", "warm_up_timeout", detail))
            return
        except Exception as error:
            log.error("warm-up of the compiled tower failed", exc_info=error)
            detail = f"the warm-up forward failed: {type(error).__name__}: {error}"
            await self._eager_after_warm_up(compiled.Status("eager", "warm_up_error", detail[:300]))
            return
        log.info("compiled tower warmed up in %.1f s", time.monotonic() - started)
        status = compiled.after_warm_up(failures)
        if status.state == "compiled":
            self.tower.compiled_ready(status.graphs)
        else:
            self.tower.run_eagerly(status)
        self._report_compile()
        self.state, self.reason = WorkerState.HEALTHY, None
        self.metrics.worker_alive.set(1)

    async def _eager_after_warm_up(self, status: compiled.Status) -> None:
        self.tower.run_eagerly(status)
        self._report_compile()
        await self._failed([], status.detail)

    def _warm_forwards(self) -> None:
        with self.device.on_stream():
            self.tower.warm_up()

    async def _device_call(self, fn: Callable[[], Any], timeout_s: float | None = None) -> Any:
        """``fn`` on the device thread within ``timeout_s``; past it the thread is abandoned."""
        call = asyncio.get_running_loop().run_in_executor(self._thread, fn)
        done, _ = await asyncio.wait({call}, timeout=self.stall_timeout_s if timeout_s is None else timeout_s)
        if not done:
            call.add_done_callback(_ignore_result)  # the late result of a stalled call is not used
            self._thread.shutdown(wait=False)  # abandoned: a daemon, stuck in the call
            self._thread = _device_thread()
            raise _Stalled
        return call.result()

    async def _run(self) -> None:
        if self.state is WorkerState.WARMING:
            await self._warm_up()
        while not self._stopping and self.state is not WorkerState.DEAD:
            failure = await self._feed()
            if failure is not None:
                await self._failed(failure.batch, failure.reason)
                self.scheduler.dispatch()

    async def _feed(self) -> Failure | None:
        loop = asyncio.get_running_loop()
        run = loop.run_in_executor(self._thread, self.device.run, self.device.bind(loop))
        watch_s = min(0.25, self.stall_timeout_s / 4)
        try:
            while True:
                done, _ = await asyncio.wait({run}, timeout=watch_s)
                if done:
                    failure = run.result() if run.exception() is None else self._loop_failed(run.exception())
                    if failure is not None:
                        self.metrics.encode_failures.labels("forward").inc(len(failure.batch))
                    return failure
                since = self.device.stalled_since()
                if since is not None and time.monotonic() - since > self.stall_timeout_s:
                    return self._stalled(run)
        except asyncio.CancelledError:
            self.device.retire()
            self.outputs.fail(self.device.not_forwarded(), NotReady("the service is shutting down"))
            raise

    def _loop_failed(self, error: BaseException | None) -> Failure:
        log.error("device worker loop failed", exc_info=error)
        return Failure(self.device.not_forwarded(), f"the device worker failed: {type(error).__name__}", error)

    def _stalled(self, run: asyncio.Future[Any]) -> Failure:
        self.device.retire()
        run.add_done_callback(_ignore_result)  # the late result of a stalled call is not used
        self._thread.shutdown(wait=False)  # abandoned: a daemon, stuck in the call
        self._thread = _device_thread()
        batch = self.device.unfinished()
        self.metrics.worker_stalls.inc()
        self.metrics.encode_failures.labels("stall").inc(len(batch))
        reason = f"the device worker stalled: a forward ran longer than stall_timeout_s={self.stall_timeout_s}"
        return Failure(batch, reason)

    async def _failed(self, batch: list[Job], reason: str) -> None:
        log.error("%s; restarting it", reason)
        self.outputs.fail(batch, NotReady(f"{reason}; retry"))
        self.state, self.reason = WorkerState.RESTARTING, reason
        self.metrics.worker_alive.set(0)
        for attempt in range(1, self.restart_attempts + 1):
            self.metrics.worker_restarts.inc()
            problem = await self._probe()
            if problem is None:
                log.warning("device worker restarted (attempt %d) after: %s", attempt, reason)
                self.state, self.reason = WorkerState.HEALTHY, None
                self.metrics.worker_alive.set(1)
                return
            log.error("device worker restart %d/%d failed: %s", attempt, self.restart_attempts, problem)
            reason = f"{reason}; the restart failed: {problem}"
        self.state, self.reason = WorkerState.DEAD, reason
        self.scheduler.cancel_all(NotReady(f"the device cannot be used: {reason}"))
        log.critical("device worker cannot be restarted: %s", reason)
        if self.on_fatal is not None:
            self.on_fatal(reason)

    async def _probe(self) -> str | None:
        image = Image.new("RGB", PROBE_SIZE, (127, 127, 127))
        try:
            await self._device_call(lambda: self._probe_forward(image))
        except _Stalled:
            return f"the probe forward ran longer than stall_timeout_s={self.stall_timeout_s}"
        except Exception as error:
            return f"{type(error).__name__}: {error}"
        return None

    def _probe_forward(self, image: Image.Image) -> None:
        prepared = self.tower.preprocess(image)
        launch = self.device.forward([prepared])
        launch.end.synchronize()
        (out,) = launch.outputs
        if out.shape[0] != prepared.layout.num_tokens:
            raise RuntimeError(f"probe produced {out.shape[0]} rows, expected {prepared.layout.num_tokens}")


class _Stalled(Exception):
    """A device call ran past its time limit (``stall_timeout_s``; the warm-up has its own)."""


def _ignore_result(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()  # retrieved: a late failure is not logged as "never retrieved"


def _device_thread() -> DaemonThread:
    return DaemonThread("visenc-device", compiled.configure)
