"""Shared fixtures: one loaded tiny tower, the in-process app, a real Redis on a free port.

Fixtures only: the helpers they are built from live in ``tests/support`` and are imported from there."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from harness.processes import redis_process
from tests.support.api import running_app

from visenc.models.base import VisionTower

#: the most pixels ``small_tower`` resizes an image to
SMALL_PIXELS = 64 * 64


@pytest.fixture(scope="session")
def tiny_tower() -> VisionTower:
    from visenc.models.loading import load_tower

    return load_tower("tiny-qwen2-vl")


@pytest.fixture(scope="session")
def small_tower() -> VisionTower:
    """The tiny tower resizing images to at most 64x64 pixels (its video tubes keep the video processor's
    size): an L1 that holds its largest image, and not one tube."""
    from visenc.models.loading import load_tower

    return load_tower("tiny-qwen2-vl", max_pixels=SMALL_PIXELS)


@pytest.fixture
async def service(tiny_tower: VisionTower) -> AsyncIterator[httpx.AsyncClient]:
    async with running_app(tiny_tower) as client:
        yield client


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    with redis_process() as (url, _):
        yield url
