"""Redis tier: fetch throughput against a raw redis-py GET, and hit-path encode latency.

python bench/bench_redis.py [--rounds 7] [--tokens 1196 --hidden 3584]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hashlib
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "service"), str(ROOT / "clients"), str(ROOT)]

import httpx
import numpy as np
import redis
import redis.asyncio as aioredis
from harness.processes import redis_process
from redis.utils import HIREDIS_AVAILABLE

from visenc.bootstrap import build_index, create_app
from visenc.config import Settings
from visenc.index.redis_conn import RedisConnection
from visenc.index.redis_store import RedisStore
from visenc.metrics import Metrics
from visenc_client import Handle, RedisRows
from visenc_client.format import entry_key, pack_entry


async def median_s(fn: Callable[[], Awaitable[object]], n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def median_sync_s(fn: Callable[[], object], n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def fetch_throughput(url: str, tokens: int, hidden: int, rounds: int, reps: int) -> None:
    rows = np.random.default_rng(0).integers(0, 1 << 16, (tokens, hidden), dtype=np.uint16)
    h, fp = "ab" * 32, "cd" * 16
    entry = pack_entry(rows, dtype="bfloat16", grid_thw=(1, 2 * 26, 2 * 46), fingerprint=fp, hash=h)
    key = entry_key("default", fp, h)
    raw = aioredis.Redis.from_url(url)
    await raw.set(key, bytes(entry.blob))
    tier = RedisStore(RedisConnection.from_settings(Settings(redis_url=url), Metrics()), ttl_s=3600)
    sync_raw = redis.Redis.from_url(url)
    direct = RedisRows(redis.Redis.from_url(url), fingerprint=fp)
    handle = Handle(h, "ready", tokens, hidden, "bfloat16")
    assert direct.fetch_bytes(handle) == bytes(entry.rows_view())
    assert bytes((await tier.get_many([key]))[0].blob) == bytes(entry.blob)

    res: dict[str, list[float]] = {k: [] for k in ("raw", "tier", "sync_raw", "direct")}
    for _ in range(rounds):  # alternate, so drift on a shared machine hits all alike
        res["raw"].append(await median_s(lambda: raw.get(key), reps))
        res["tier"].append(await median_s(lambda: tier.get_many([key]), reps))
        res["sync_raw"].append(median_sync_s(lambda: sync_raw.get(key), reps))
        res["direct"].append(median_sync_s(lambda: direct.fetch_bytes(handle), reps))
    med = {k: statistics.median(v) for k, v in res.items()}
    mb = entry.nbytes / 1e6
    print(
        f"\n1. fetch of one entry: {tokens} tokens x {hidden} hidden bf16 = {mb:.2f} MB "
        f"(hiredis: {HIREDIS_AVAILABLE}; {rounds} rounds x {reps})"
    )
    print(f"   raw redis.asyncio GET          {med['raw'] * 1e3:7.2f} ms  {mb / med['raw']:8.0f} MB/s")
    print(
        f"   RedisStore.get_many (service)  {med['tier'] * 1e3:7.2f} ms  {mb / med['tier']:8.0f} MB/s  "
        f"ratio to raw GET: {med['raw'] / med['tier']:.2f}"
    )
    print(f"   raw redis GET (sync)           {med['sync_raw'] * 1e3:7.2f} ms  {mb / med['sync_raw']:8.0f} MB/s")
    print(
        f"   RedisRows.fetch_bytes (client) {med['direct'] * 1e3:7.2f} ms  {mb / med['direct']:8.0f} MB/s  "
        f"ratio to raw GET: {med['sync_raw'] / med['direct']:.2f}"
    )
    await raw.flushdb()
    await raw.aclose()
    await tier.conn.close()
    sync_raw.close()
    direct.close()


async def hit_latency(url: str, rounds: int, reps: int) -> None:
    from visenc.models.loading import load_tower

    sys.path.insert(0, str(ROOT / "tests"))
    from harness.images import png_bytes

    tower = load_tower("tiny-qwen2-vl")
    image = png_bytes(1, 224, 224)
    variants = {
        "in-process only": Settings(max_wait_ms=1.0),
        "redis, L1 hit": Settings(max_wait_ms=1.0, redis_url=url),
        "redis, L2 hit (no L1)": Settings(max_wait_ms=1.0, redis_url=url),
    }

    def no_l1(settings: Settings, metrics: Metrics) -> Any:  # an L1 of 0 bytes: start-up refuses it as a setting
        return build_index(settings.model_copy(update={"cache_bytes": 0}), metrics)

    async with contextlib.AsyncExitStack() as stack:
        clients = {}
        for name, settings in variants.items():
            app = create_app(settings, tower=tower, **({"index": no_l1} if "no L1" in name else {}))
            await stack.enter_async_context(app.router.lifespan_context(app))
            c = await stack.enter_async_context(
                httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://visenc")
            )
            if "no L1" in name:  # it keeps nothing: it reads what the others wrote through
                clients[name] = (c, hashlib.sha256(image).hexdigest())
                continue
            r = await c.post("/v1/encode", json={"items": [{"data": base64.b64encode(image).decode()}]})
            assert r.json()["items"][0]["status"] == "ready", r.text
            clients[name] = (c, r.json()["items"][0]["hash"])
        await asyncio.sleep(0.1)  # write-through done

        async def hit(c: httpx.AsyncClient, h: str) -> None:
            r = await c.post("/v1/encode", json={"items": [{"hash": h}]})
            assert r.json()["items"][0]["status"] == "ready"

        res: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(rounds):
            for name, (c, h) in clients.items():
                res[name].append(await median_s(lambda c=c, h=h: hit(c, h), reps))
    base = statistics.median(res["in-process only"])
    print(
        f"\n2. hit-path encode latency, POST /v1/encode with one known hash, in-process ASGI ({rounds} rounds x {reps})"
    )
    for name, v in res.items():
        m = statistics.median(v)
        print(f"   {name:24s} {m * 1e3:7.3f} ms   x{m / base:.2f} of in-process only")


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--tokens", type=int, default=1196, help="tokens of the fetched entry (1280x720 in Qwen2.5-VL)")
    p.add_argument("--hidden", type=int, default=3584, help="hidden size of the fetched entry (Qwen2.5-VL-7B)")
    args = p.parse_args()
    with redis_process() as (url, _):
        await fetch_throughput(url, args.tokens, args.hidden, args.rounds, args.reps)
        await hit_latency(url, args.rounds, args.reps * 4)


if __name__ == "__main__":
    asyncio.run(main())
