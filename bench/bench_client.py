"""What a client costs on the caller's side: CPU per request, side by side in one run.

python bench/bench_client.py --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import resource
import statistics
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "service"), str(ROOT / "clients"), str(ROOT / "bench")]

import _common as c
import httpx
import msgpack

from visenc_client import AsyncClient

Run = Callable[[str, list[bytes], int], Awaitable[None]]
NAMESPACE = "client"


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def with_aiohttp(base: str, images: list[bytes], concurrency: int) -> None:
    await c.clients_rate(images, c.visenc_sender(base, NAMESPACE), concurrency)


async def with_httpx(base: str, images: list[bytes], concurrency: int) -> None:
    async with httpx.AsyncClient(base_url=base, limits=httpx.Limits(max_connections=concurrency)) as client:

        async def send(data: bytes) -> None:
            body, headers = c.encode_request(data, NAMESPACE)
            r = await client.post("/v1/encode", content=body, headers=headers)
            r.raise_for_status()
            assert msgpack.unpackb(r.content)["items"][0]["rows"]

        await c.in_flight(images, concurrency, send)


async def with_visenc_client(base: str, images: list[bytes], concurrency: int) -> None:
    async with AsyncClient(base, namespace=NAMESPACE) as vc:

        async def send(data: bytes) -> None:
            (handle,) = await vc.encode([data], include_rows=True)
            assert handle.rows is not None

        await c.in_flight(images, concurrency, send)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=64)
    p.add_argument("--repeat", type=int, default=8, help="times each client sends every image per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--concurrency", type=int, default=8)
    args = p.parse_args()

    images = [c.jpeg(i) for i in range(args.images)]
    runs: dict[str, Run] = {"aiohttp": with_aiohttp, "httpx": with_httpx, "visenc_client": with_visenc_client}
    port = c.free_port()
    base = f"http://127.0.0.1:{port}"
    ms: dict[str, list[float]] = {k: [] for k in runs}
    with c.server(c.visenc_cmd("tiny-clip", port), f"{base}/readyz", c.service_env()):
        for run in runs.values():  # the images are encoded once; every later request is an index hit
            asyncio.run(run(base, images, args.concurrency))
        for r in range(args.rounds):
            order = list(runs) if r % 2 == 0 else list(reversed(runs))
            for name in order:
                t0 = cpu_s()
                asyncio.run(runs[name](base, images * args.repeat, args.concurrency))
                ms[name].append((cpu_s() - t0) / (len(images) * args.repeat) * 1e3)
            print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in ms.items()) + " ms CPU a request")
    note = "sniffio installed" if importlib.util.find_spec("sniffio") else "sniffio NOT installed"
    print(
        f"\nclient CPU per request ({note}), median: "
        + ", ".join(f"{k} {statistics.median(v):.2f} ms" for k, v in ms.items())
    )
    for name in ("httpx", "visenc_client"):
        print(f"  {name} / aiohttp {c.spread([a / b for a, b in zip(ms[name], ms['aiohttp'])])}")


if __name__ == "__main__":
    main()
