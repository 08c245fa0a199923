"""How the CPU cores are shared by the forward and the preprocessing pool (measured: ``docs/internals.md``)."""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

import torch

from visenc import devices
from visenc.engine.host import usable_cores

T = TypeVar("T")


def available_cores() -> int:
    """Cores this process may run on: CPU affinity, capped by the container's CPU quota."""
    return usable_cores()


def default_preprocess_workers(device: torch.device, cores: int | None = None) -> int:
    cores = cores or available_cores()
    return cores


def default_torch_threads(device: torch.device, cores: int | None = None) -> int:
    return devices.for_device(device).torch_threads(cores or available_cores())


class DaemonThread(Executor):
    """A one-thread executor whose thread is a daemon: a stalled forward never holds up the exit.
    ``submit`` from any thread (a queue); its one thread runs until ``shutdown``."""

    def __init__(self, name: str, initializer: Callable[[], object] | None = None) -> None:
        self._initializer = initializer
        self._work: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        if self._initializer is not None:
            self._initializer()
        while (item := self._work.get()) is not None:
            fut, fn, args = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as e:
                    fut.set_exception(e)

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        fut: Future[T] = Future()
        self._work.put((fut, functools.partial(fn, **kwargs) if kwargs else fn, args))
        return fut

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._work.put(None)
        if wait:
            self._thread.join()

    def join(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the thread to end (after ``shutdown``); whether it did."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()
