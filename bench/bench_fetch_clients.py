"""``Client.fetch`` of a 7B model's rows against a plain aiohttp ``GET`` of the same answer.

python bench/bench_fetch_clients.py [--size 1920x1080] [--rounds 5] [--before /tmp/visenc-before]
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import _common as c
import bench_gpu

#: run in a fresh process per reader: argv = clients folder, reader, url, reads, images file
READER = r"""
import asyncio, base64, json, sys, time
sys.path.insert(0, sys.argv[1])
reader, url, reads = sys.argv[2], sys.argv[3], int(sys.argv[4])
images = [base64.b64decode(x) for x in json.load(open(sys.argv[5]))]
from visenc_client import Client

with Client(url) as client:
    handles = client.encode(images)  # index hits: the handles only
    if reader == "aiohttp":
        import aiohttp

        async def run() -> float:
            async with aiohttp.ClientSession() as session:
                async def get(h) -> int:
                    async with session.get(f"{url}/v1/embeddings/{h.hash}") as r:
                        r.raise_for_status()
                        return len(await r.read())
                await get(handles[0])
                t0, total = time.perf_counter(), 0
                for i in range(reads):
                    total += await get(handles[i % len(handles)])
                return total / (time.perf_counter() - t0)
        print(asyncio.run(run()))
    else:
        client.fetch(handles[0])
        t0, total = time.perf_counter(), 0
        for i in range(reads):
            total += client.fetch(handles[i % len(handles)]).nbytes
        print(total / (time.perf_counter() - t0))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1920x1080", help="WxH of every screenshot")
    ap.add_argument("--images", type=int, default=4)
    ap.add_argument("--reads", type=int, default=24, help="fetches per reader a round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--before", help="another source tree whose client is measured too")
    args = ap.parse_args()
    w, h = (int(v) for v in args.size.split("x"))
    readers = {"aiohttp": ROOT / "clients", "client": ROOT / "clients"}
    if args.before:
        readers["before"] = Path(args.before) / "clients"

    with contextlib.ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="visenc-fetch-")))
        checkpoint = c.write_qwen25_checkpoint(folder / "wide", bench_gpu.TINY_VISION)
        url = c.serve_checkpoint(stack, checkpoint)
        images = folder / "images.json"
        images.write_text(json.dumps([base64.b64encode(c.jpeg(7000 + i, w, h)).decode() for i in range(args.images)]))
        script = folder / "reader.py"
        script.write_text(READER)

        rates: dict[str, list[float]] = {k: [] for k in readers}
        for r in range(args.rounds):
            for name in list(readers) if r % 2 == 0 else list(reversed(readers)):
                reader = "aiohttp" if name == "aiohttp" else "client"
                argv = [c.PYTHON, str(script), str(readers[name]), reader, url, str(args.reads), str(images)]
                out = subprocess.run(argv, capture_output=True, text=True, check=True)
                rates[name].append(float(out.stdout.split()[-1]) / 1e9)
            print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in rates.items()) + " GB/s")

    print(f"\n{args.size}, {args.images} screenshots, {args.reads} fetches a reader a round, {args.rounds} rounds")
    for name in readers:
        ratios = [a / b for a, b in zip(rates[name], rates["aiohttp"])]
        print(f"  {name:8s} {statistics.median(rates[name]):5.2f} GB/s  ÷ aiohttp GET: {c.spread(ratios)}")


if __name__ == "__main__":
    main()
