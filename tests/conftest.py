"""Shared fixtures: one loaded tiny tower, in-process apps, real servers on free ports."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.support.waits import free_port, listening, wait_ready, wait_until

from visenc.bootstrap import create_app
from visenc.config import Settings
from visenc.models.base import VisionTower

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tiny_tower() -> VisionTower:
    from visenc.models.loading import load_tower

    return load_tower("tiny-qwen2-vl")


@contextlib.asynccontextmanager
async def running_app(
    tower: VisionTower, *, index: Callable[..., Any] | None = None, **overrides: object
) -> AsyncIterator[httpx.AsyncClient]:
    """The real app (engine, index, tower) in-process, lifespan included, behind an httpx client.
    ``index`` replaces the index builder (``tests.support.faults.faulty_index``)."""
    settings = Settings(**{"max_wait_ms": 1.0, **overrides})  # type: ignore[arg-type]
    app = create_app(settings, tower=tower) if index is None else create_app(settings, tower=tower, index=index)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://visenc") as client:
            client.app = app  # type: ignore[attr-defined]
            yield client


@pytest.fixture
async def service(tiny_tower: VisionTower) -> AsyncIterator[httpx.AsyncClient]:
    async with running_app(tiny_tower) as client:
        yield client


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 20.0) -> None:
    """Terminate a process we started, then kill it if it does not exit in time."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def serve_subprocess(
    *args: str, env: dict[str, str] | None = None, log: Path | None = None, faults: tuple[str, ...] = ()
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A real ``visenc serve`` subprocess on a free loopback port, ready; yields (url, process);
    terminated (then killed) after, unless it already exited. ``faults`` are options of
    ``tests.support.serve_faulty`` (the same CLI with a faulty tower), e.g. ``("--forward-delay-s", "2")``."""
    port = free_port()
    out = open(log, "wb") if log else subprocess.DEVNULL
    launcher = ["-m", "tests.support.serve_faulty", *faults, "--"] if faults else ["-m", "visenc", "serve"]
    proc = subprocess.Popen(
        [sys.executable, *launcher, "--host", "127.0.0.1", "--port", str(port), *args],
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT / "service"), str(ROOT / "clients"), str(ROOT)]),
            **(env or {}),
        },
        cwd=ROOT,
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        yield url, proc
    finally:
        stop_process(proc)
        if log:
            out.close()  # type: ignore[union-attr]


@contextlib.contextmanager
def serve_process(*args: str, env: dict[str, str] | None = None, log: Path | None = None) -> Iterator[str]:
    """``serve_subprocess`` when only the URL is needed."""
    with serve_subprocess(*args, env=env, log=log) as (url, _):
        yield url


@contextlib.contextmanager
def redis_process(port: int | None = None, *extra: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A real redis-server on a free loopback port, no persistence."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed (make test installs it)")
    port = port or free_port()
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    wait_until(lambda: listening(port), 10, f"redis-server on port {port}", interval_s=0.05)
    try:
        yield f"redis://127.0.0.1:{port}/0", proc
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    with redis_process() as (url, _):
        yield url
