"""What the index keeps for a request, with small budgets, in-process with the real app:

- a video answered ready stays readable by its hash while pinned, however much other traffic passes
  through a small L1 (LRU or bimodal insertion), and its read to the last row releases every pin;
- an L1 smaller than one image of the model at its largest is refused before anything starts, naming
  the smallest setting that works (which then serves that image); a tube L1 cannot hold is an error,
  never answered ready;
- every shared-memory read of a video shares one segment, and its joined rows are counted;
- Redis misses are read in batches bounded in bytes (``INFO commandstats`` of a real Redis).
"""

from __future__ import annotations

import math
import os
import tracemalloc
from pathlib import Path
from typing import Any

import httpx
import msgpack
import numpy as np
import pytest
import redis
from harness.images import png_bytes
from harness.waits import metric
from tests.support.api import MSGPACK, running_app
from tests.support.l1 import L1

from visenc.bootstrap import create_app
from visenc.config import Settings
from visenc.models.base import VisionTower
from visenc.process_memory import BudgetTooSmall, largest_entry
from visenc_client.format import LEASE_HEADER

W, H = 120, 90


def frames(first: int, count: int) -> list[bytes]:
    return [png_bytes(3000 + i, W, H) for i in range(first, first + count)]


async def encode(client: httpx.AsyncClient, items: list[dict], lease: str | None = "id") -> list[dict]:
    headers = {**MSGPACK, **({LEASE_HEADER: lease} if lease else {})}
    r = await client.post("/v1/encode", content=msgpack.packb({"items": items, "wait": True}), headers=headers)
    assert r.status_code == 200, r.text
    return list(msgpack.unpackb(r.content)["items"])


async def index_health(client: httpx.AsyncClient) -> dict[str, Any]:
    return dict((await client.get("/readyz")).json()["index"])


@pytest.mark.parametrize("insertion", ["lru", "bimodal"])
async def test_a_video_answered_ready_stays_readable_while_pinned(tiny_tower: VisionTower, insertion: str) -> None:
    fillers = [png_bytes(3100 + i, 448, 448) for i in range(40)]  # 40 x 257 KiB through an L1 of 2 MB
    async with running_app(tiny_tower, cache_bytes=2_000_000) as service:
        L1(service, bimodal=insertion == "bimodal")
        for data in fillers[:10]:  # L1 full: a store now evicts
            (it,) = await encode(service, [{"data": data}], lease="none")
        (video,) = await encode(service, [{"frames": frames(0, 4)}])
        assert video["status"] == "ready" and video["lease"]
        for data in fillers[10:]:
            (it,) = await encode(service, [{"data": data}], lease="none")
            assert it["status"] == "ready"
        assert (await index_health(service))["pinned_bytes"] > 0
        r = await service.get(f"/v1/embeddings/{video['hash']}", params={"lease": video["lease"]})
        assert r.status_code == 200, r.text
        assert int(r.headers["x-visenc-total-rows"]) == video["num_tokens"]
        assert (await index_health(service))["pinned_bytes"] == 0  # read to its last row: tubes and manifest


async def test_an_l1_smaller_than_one_image_is_refused_naming_the_smallest(
    tiny_tower: VisionTower, tmp_path: Path
) -> None:
    rows, need = largest_entry(tiny_tower, Settings().max_image_pixels)
    with pytest.raises(BudgetTooSmall, match=f"the smallest that works: --cache-bytes {need}$"):
        create_app(Settings(cache_bytes=10_000), tower=tiny_tower)
    with pytest.raises(BudgetTooSmall, match=r"--process-memory-bytes \d+") as refused:
        create_app(Settings(process_memory_bytes=2 * need, shm_dir=str(tmp_path)), tower=tiny_tower)
    smallest = int(refused.value.args[0].split("--process-memory-bytes ")[1].split()[0])
    with pytest.raises(BudgetTooSmall):
        create_app(Settings(process_memory_bytes=smallest - 1, shm_dir=str(tmp_path)), tower=tiny_tower)
    # the most rows of this tower: an image aligned to its patches right at its resize ceiling
    most = tiny_tower.layout(896, 1120).num_tokens
    assert most == 1280 <= rows
    async with running_app(tiny_tower, process_memory_bytes=smallest, shm_dir=str(tmp_path)) as service:
        (it,) = await encode(service, [{"data": png_bytes(3200, 896, 1120)}])
        assert it["status"] == "ready" and it["num_tokens"] == most
        r = await service.get(f"/v1/embeddings/{it['hash']}", params={"lease": it["lease"]})
        assert r.status_code == 200, r.text


async def test_a_tube_l1_cannot_hold_is_an_error_not_ready(small_tower: VisionTower) -> None:
    """Start-up sizes L1 for images; a video's tube (its own processor's size) larger than L1 fails."""
    _, need = largest_entry(small_tower, Settings().max_image_pixels)
    async with running_app(small_tower, cache_bytes=4 * need) as service:
        (video,) = await encode(service, [{"frames": frames(10, 2)}])
        assert video["status"] == "error" and "cache_bytes" in video["error"], video
        assert (await service.get(f"/v1/embeddings/{video['hash']}")).status_code == 404  # nothing kept


async def test_shared_memory_reads_of_a_video_share_one_segment(tiny_tower: VisionTower, tmp_path: Path) -> None:
    async with running_app(tiny_tower, shm_dir=str(tmp_path), shm_max_bytes=400_000) as service:
        (video,) = await encode(service, [{"frames": frames(20, 4)}])
        rows = video["num_tokens"]
        chunks = [(i * rows // 4, (i + 1) * rows // 4) for i in range(4)]
        segments = set()
        for lo, hi in chunks:
            body = msgpack.packb({"ranges": [{"hash": video["hash"], "start": lo, "end": hi}]})
            r = await service.post("/v1/embeddings/shm", content=body, headers=MSGPACK)
            (item,) = msgpack.unpackb(r.content)["items"]
            assert "segment" in item, item  # not refused: the budget holds one copy of the video
            segments.add(item["segment"])
        assert len(segments) == 1 and len(os.listdir(tmp_path)) == 3  # the segment, the probe, the life's lock
        exposed = (await service.get("/metrics")).text
        joined = metric(exposed, "visenc_joined_rows_bytes")
        assert joined == metric(exposed, "visenc_shm_bytes") == 256 + rows * video["hidden_size"] * 4


async def test_a_video_over_the_joined_rows_bound_is_refused(tiny_tower: VisionTower) -> None:
    async with running_app(tiny_tower, joined_rows_bytes=100_000) as service:
        (video,) = await encode(service, [{"frames": frames(30, 4)}])
        r = await service.get(f"/v1/embeddings/{video['hash']}")
        assert r.status_code == 413 and "joined_rows_bytes" in r.text
        for tube in video["tubes"]:  # read by its tubes instead
            assert (await service.get(f"/v1/embeddings/{tube}")).status_code == 200


async def test_redis_misses_are_read_in_batches_bounded_in_bytes(tiny_tower: VisionTower, redis_url: str) -> None:
    _, largest = largest_entry(tiny_tower, Settings().max_image_pixels)
    pngs = [png_bytes(3300 + i, 64, 64) for i in range(11)]
    async with running_app(tiny_tower, redis_url=redis_url) as writer:
        written = await encode(writer, [{"data": d} for d in pngs], lease="none")
    server = redis.Redis.from_url(redis_url)
    async with running_app(tiny_tower, redis_url=redis_url, redis_batch_bytes=3 * largest + 1) as reader:
        server.config_resetstat()
        found = await encode(reader, [{"hash": it["hash"]} for it in written], lease="none")
        calls = server.info("commandstats").get("cmdstat_mget", {}).get("calls", 0)
        assert [it["status"] for it in found] == ["ready"] * len(pngs)
        assert calls == math.ceil(len(pngs) / 3)  # batches of 3 keys: 3 of the largest entries fit
        assert (await index_health(reader))["memory"]["entries"] == len(pngs)  # each batch went into L1
    np.testing.assert_array_equal([it["num_tokens"] for it in found], [it["num_tokens"] for it in written])


async def test_a_request_of_hashes_holds_at_most_l1_and_one_batch(tiny_tower: VisionTower, redis_url: str) -> None:
    """40 entries of 257 KiB in Redis looked up in one request through an L1 of 2 MB and batches of 3.9
    MB: the request holds what L1 keeps and one batch, not all 10 MB (traced Python allocations)."""
    _, largest = largest_entry(tiny_tower, Settings().max_image_pixels)
    pngs = [png_bytes(3400 + i, 448, 448) for i in range(40)]
    async with running_app(tiny_tower, redis_url=redis_url) as writer:
        written = await encode(writer, [{"data": d} for d in pngs], lease="none")
    total = sum(256 + it["num_tokens"] * it["hidden_size"] * 4 for it in written)
    limits = {"cache_bytes": 2_000_000, "pin_overflow_bytes": 0, "redis_batch_bytes": 3 * largest + 1}
    async with running_app(tiny_tower, redis_url=redis_url, **limits) as reader:
        tracemalloc.start()
        try:
            found = await encode(reader, [{"hash": it["hash"]} for it in written])
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert [it["status"] for it in found] == ["ready"] * len(pngs)
        assert peak < limits["cache_bytes"] + 2 * limits["redis_batch_bytes"] < total, (peak, total)
        for it in found:  # every one readable: from L1, or from Redis
            assert (await reader.get(f"/v1/embeddings/{it['hash']}")).status_code == 200


async def test_a_request_of_video_hashes_holds_its_joins_within_the_bound(tiny_tower: VisionTower) -> None:
    """Videos asked by their hash are answered from their tubes' fields: the request holds no more joined
    rows than ``joined_rows_bytes`` allows, however many videos it asks (traced Python allocations)."""
    async with running_app(tiny_tower) as sizer:
        (one,) = await encode(sizer, [{"frames": frames(40, 4)}], lease="none")
    size = 256 + one["num_tokens"] * one["hidden_size"] * 4  # each video: 4 frames of the same size
    async with running_app(tiny_tower, joined_rows_bytes=2 * size) as service:
        videos = [(await encode(service, [{"frames": frames(40 + 4 * i, 4)}], lease="none"))[0] for i in range(12)]
        tracemalloc.start()
        try:
            found = await encode(service, [{"hash": v["hash"]} for v in videos], lease="none")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert [it["status"] for it in found] == ["ready"] * len(videos)
        assert peak < 4 * size < len(videos) * size, (peak, size)


async def test_a_video_over_the_joined_rows_bound_reads_none_of_its_tubes(
    tiny_tower: VisionTower, redis_url: str
) -> None:
    """Refused by its manifest's grid, before its tubes come from Redis into memory for nothing."""
    async with running_app(tiny_tower, redis_url=redis_url) as writer:
        (video,) = await encode(writer, [{"frames": frames(90, 8)}], lease="none")
    async with running_app(tiny_tower, redis_url=redis_url, joined_rows_bytes=100_000) as reader:
        r = await reader.get(f"/v1/embeddings/{video['hash']}")
        assert r.status_code == 413 and "joined_rows_bytes" in r.text
        (it,) = await encode(reader, [{"hash": video["hash"]}], lease="none")
        assert it["status"] == "error" and "joined_rows_bytes" in it["error"], it
        assert (await index_health(reader))["memory"]["entries"] == 1  # its manifest alone
