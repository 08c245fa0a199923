"""SGLang's encoder protocol against visenc's own API, on one ``visenc serve`` (tiny Qwen2-VL).

.venv/bin/python bench/bench_sglang.py [--parts 64] [--concurrency 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import msgpack
import zmq
import zmq.asyncio

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _common as c

from visenc_client import image_hash

LOADS = ("cold", "hit", "hit by hash")
PROTOCOLS = ("sglang", "v1")


class Rank:
    """A scheduler rank's receive socket: each arriving part resolves the future of its req_id."""

    def __init__(self, context: zmq.asyncio.Context) -> None:
        self.socket = context.socket(zmq.PULL)
        self.port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.waiting: dict[bytes, asyncio.Future[float]] = {}
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            frames = await self.socket.recv_multipart(copy=False)
            arrived = time.perf_counter()
            header = frames[0].bytes
            for rid, future in list(self.waiting.items()):
                if rid in header and not future.done():  # the part's req_id is in frame 0's text
                    future.set_result(arrived)
                    del self.waiting[rid]
                    break


def sglang_sender(base: str, rank: Rank, load: str, tag: str):
    counter = iter(range(1 << 30))

    async def send(session: aiohttp.ClientSession, data: bytes) -> float:
        rid = f"{tag}-{next(counter)}-{image_hash(data)[:12]}"
        arrived = asyncio.get_running_loop().create_future()
        rank.waiting[rid.encode()] = arrived
        item: object = "data:image/jpeg;base64," + base64.b64encode(data).decode()
        if load == "hit by hash":
            item = {"url": "http://images.invalid/x.jpg", "content_hash": "sha256:" + image_hash(data)}
        t0 = time.perf_counter()
        register = {"req_id": rid, "receive_count": 1, "receive_url": f"127.0.0.1:{rank.port}", "modality": "IMAGE"}
        encode = {"req_id": rid, "num_parts": 1, "part_idx": 0, "mm_items": [item], "modality": "IMAGE"}
        async with session.post(f"{base}/scheduler_receive_url", json=register, raise_for_status=True):
            pass
        async with session.post(f"{base}/encode", json=encode) as r:
            if r.status != 200:
                raise RuntimeError(await r.text())
        return await arrived - t0

    return send


def v1_sender(base: str, load: str):
    async def send(session: aiohttp.ClientSession, data: bytes) -> float:
        item = {"hash": image_hash(data)} if load == "hit by hash" else {"data": data}
        body = msgpack.packb({"items": [item], "wait": True, "include_rows": True})
        headers = {"Content-Type": "application/msgpack", "Accept": "application/msgpack"}
        t0 = time.perf_counter()
        async with session.post(f"{base}/v1/encode", data=body, headers=headers, raise_for_status=True) as r:
            answer = msgpack.unpackb(await r.read())["items"][0]
        if answer["status"] != "ready" or not answer.get("rows"):
            raise RuntimeError(f"visenc answered {answer}")
        return time.perf_counter() - t0

    return send


async def run_load(send, images: list[bytes], concurrency: int) -> tuple[float, list[float]]:
    """(images/s, per-image delivery latencies in s)."""
    latencies: list[float] = []

    async def one(session: aiohttp.ClientSession, data: bytes) -> None:
        latencies.append(await send(session, data))

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as session:
        t0 = time.perf_counter()
        await c.in_flight(images, concurrency, lambda data: one(session, data))
        return len(images) / (time.perf_counter() - t0), latencies


async def measure(base: str, parts: int, concurrency: int, rounds: int) -> dict:
    context = zmq.asyncio.Context()
    rank = Rank(context)
    results: dict = {(p, load): {"rate": [], "p50": [], "p99": []} for p in PROTOCOLS for load in LOADS}
    try:
        for r in range(rounds):
            order = PROTOCOLS if r % 2 == 0 else PROTOCOLS[::-1]
            for protocol in order:
                images = [c.jpeg(100_000 * r + 1000 * PROTOCOLS.index(protocol) + i) for i in range(parts)]
                for load in LOADS:  # cold first: the hits are of the same images
                    send = (
                        sglang_sender(base, rank, load, f"r{r}{load}")
                        if protocol == "sglang"
                        else v1_sender(base, load)
                    )
                    rate, latencies = await run_load(send, images, concurrency)
                    cell = results[(protocol, load)]
                    cell["rate"].append(rate)
                    cell["p50"].append(statistics.median(latencies))
                    cell["p99"].append(sorted(latencies)[max(0, int(0.99 * len(latencies)) - 1)])
    finally:
        rank.task.cancel()
        context.destroy(linger=0)
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    port = c.free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = c.visenc_cmd("tiny-qwen2-vl", port, "--image-loader", "sglang")
    with c.server(cmd, base + "/readyz", c.service_env()):
        asyncio.run(measure(base, args.concurrency, args.concurrency, 1))  # warm-up
        results = asyncio.run(measure(base, args.parts, args.concurrency, args.rounds))
    med = {k: {m: statistics.median(v) for m, v in cell.items()} for k, cell in results.items()}
    print(f"{args.parts} one-image parts (640x480 JPEG), {args.concurrency} at a time, {args.rounds} rounds; medians")
    print(f"  {'load':12s} {'protocol':10s} {'images/s':>9s} {'p50 ms':>8s} {'p99 ms':>8s}")
    for load in LOADS:
        for protocol in PROTOCOLS:
            m = med[(protocol, load)]
            print(f"  {load:12s} {protocol:10s} {m['rate']:9.1f} {m['p50'] * 1e3:8.1f} {m['p99'] * 1e3:8.1f}")
    for protocol in PROTOCOLS:
        for load in LOADS[1:]:
            ratios = [h / c_ for h, c_ in zip(results[(protocol, load)]["rate"], results[(protocol, "cold")]["rate"])]
            print(f"  {protocol}: {load} ÷ cold images/s: {c.spread(ratios)}")
    for load in LOADS:
        ratios = [s / v for s, v in zip(results[("sglang", load)]["rate"], results[("v1", load)]["rate"])]
        print(f"  {load}: SGLang protocol ÷ /v1/encode images/s: {c.spread(ratios)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
