"""Cache-hit encode throughput, measured side by side with the HTTP floor and cold encodes.

python bench/bench_cache_hit.py [--images 8] [--size 448x448] [--seconds 5] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import sys
import time
from pathlib import Path

import httpx
import msgpack

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "service"), str(ROOT / "clients")]

from harness.images import png_bytes
from harness.processes import serve_process

MSGPACK = {"content-type": "application/msgpack", "accept": "application/msgpack"}


async def rate(client: httpx.AsyncClient, make_request, seconds: float, concurrency: int) -> float:
    """Requests/s of ``make_request`` with ``concurrency`` workers for ``seconds``."""
    done = 0
    deadline = time.perf_counter() + seconds

    async def worker():
        nonlocal done
        while time.perf_counter() < deadline:
            r = await make_request(client)
            assert r.status_code == 200, r.text
            done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / (time.perf_counter() - t0)


async def run(url: str, n_images: int, size: tuple[int, int], seconds: float, concurrency: int) -> None:
    w, h = size
    warm = [png_bytes(1000 + i, w, h) for i in range(n_images)]
    hashes = [hashlib.sha256(d).hexdigest() for d in warm]
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        body = msgpack.packb({"items": [{"data": d} for d in warm]})
        assert (await client.post("/v1/encode", content=body, headers=MSGPACK)).status_code == 200
        hit_body = msgpack.packb({"items": [{"hash": x} for x in hashes]})

        async def floor(c):
            return await c.get("/healthz")

        async def hit(c):
            r = await c.post("/v1/encode", content=hit_body, headers=MSGPACK)
            assert all(it["status"] == "ready" for it in msgpack.unpackb(r.content)["items"])
            return r

        counter = iter(range(10**6))

        async def cold(c):
            d = png_bytes(5000 + next(counter), w, h)
            return await c.post("/v1/encode", content=msgpack.packb({"items": [{"data": d}]}), headers=MSGPACK)

        floor_rps = await rate(client, floor, seconds, concurrency)
        hit_rps = await rate(client, hit, seconds, concurrency)
        cold_ips = await rate(client, cold, seconds, concurrency)
    print(f"HTTP floor (/healthz):            {floor_rps:8.1f} req/s")
    print(f"hash-only hit, {n_images} images/request: {hit_rps:8.1f} req/s = {hit_rps * n_images:8.1f} images/s")
    print(f"cold encode {w}x{h}, 1/request:   {cold_ips:8.1f} images/s")
    print(f"ratio hit req/s / HTTP floor:     {hit_rps / floor_rps:8.2f}")
    print(f"ratio hit images/s / cold images/s: {hit_rps * n_images / cold_ips:8.1f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--size", default="448x448")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args()
    size = tuple(int(x) for x in args.size.split("x"))
    with serve_process() as url:
        asyncio.run(run(url, args.images, size, args.seconds, args.concurrency))  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
