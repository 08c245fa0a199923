"""Fetch throughput per transport, each as a ratio of a plain memcpy of the same bytes.

python bench/bench_fetch.py [--images 8] [--size 448x448] [--reps 30]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "service"), str(ROOT / "clients")]

from harness.images import png_bytes
from harness.processes import redis_process, serve_process

from visenc_client import Client, ImagePlacement, RowRange

HAS_REDIS_INDEX = importlib.util.find_spec("visenc.index.redis") is not None


def seconds(call: Callable[[], object], reps: int) -> float:
    call()  # warm
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@contextlib.contextmanager
def service(redis: bool) -> Iterator[tuple[str, str | None]]:
    if not redis:
        with serve_process("--shm-enabled", "true") as url:
            yield url, None
        return
    with redis_process() as (redis_url, _), serve_process("--shm-enabled", "true", "--redis-url", redis_url) as url:
        yield url, redis_url


def redis_getrange(
    redis_url: str, fingerprint: str, placements: list[ImagePlacement], out: np.ndarray
) -> Callable[[], None]:
    """One pipelined round trip of GETRANGEs, each image's rows copied into ``out``."""
    import redis

    from visenc_client.format import DATA_OFFSET, entry_key

    client = redis.Redis.from_url(redis_url)
    row_bytes = out.shape[1] * out.itemsize
    keys = [entry_key("default", fingerprint, p.hash) for p in placements]
    flat = out.reshape(-1).view(np.uint8)

    def fetch() -> None:
        pipe = client.pipeline(transaction=False)
        for key, p in zip(keys, placements):
            pipe.getrange(key, DATA_OFFSET, DATA_OFFSET + p.num_tokens * row_bytes - 1)
        at = 0
        for p, value in zip(placements, pipe.execute()):
            if len(value) != p.num_tokens * row_bytes:
                raise RuntimeError(f"{p.hash}: not in Redis (got {len(value)} bytes)")
            flat[at : at + len(value)] = np.frombuffer(value, np.uint8)
            at += len(value)

    return fetch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--size", default="448x448", help="WxH of every image")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    width, height = (int(x) for x in args.size.split("x"))

    with service(HAS_REDIS_INDEX) as (url, redis_url), Client(url) as http, Client(url, shared_memory=True) as shm:
        handles = http.encode([png_bytes(40_000 + i, width, height) for i in range(args.images)])
        placements, at = [], 0
        for h in handles:
            placements.append(ImagePlacement.of(h, at))
            at += h.num_tokens
        out = np.empty((at, handles[0].hidden_size), np.float32)
        src = np.random.default_rng(0).standard_normal(out.shape).astype(np.float32)
        ranges = [RowRange(h.hash) for h in handles]
        runs: dict[str, Callable[[], object]] = {
            "memcpy": lambda: np.copyto(out, src),
            "http (fetch_chunk into buffer)": lambda: http.fetch_chunk(placements, 0, at, out=out),
            "http (fetch_many, views of body)": lambda: http.fetch_many(ranges),
            "shm (fetch_chunk into buffer)": lambda: shm.fetch_chunk(placements, 0, at, out=out),
            "shm (fetch_many, mapped views)": lambda: shm.fetch_many(ranges),
        }
        if redis_url is not None:
            fingerprint = http.model()["fingerprint"]
            runs["redis GETRANGE (into buffer)"] = redis_getrange(redis_url, fingerprint, placements, out)
        # every transport hands back exactly the same bytes
        reference = http.fetch_chunk(placements, 0, at).tobytes()
        assert shm.fetch_chunk(placements, 0, at).tobytes() == reference
        timed = {name: seconds(call, args.reps) for name, call in runs.items()}
        if redis_url is not None:
            assert out.tobytes() == reference

    nbytes = out.nbytes
    print(
        f"{args.images} images {args.size}, {at} rows x {out.shape[1]} float32 = {nbytes / 2**20:.2f} MiB per fetch; "
        f"median of {args.reps}"
    )
    print(f"{'transport':36} {'GB/s':>8} {'vs memcpy':>10}")
    for name, s in timed.items():
        print(f"{name:36} {nbytes / s / 1e9:8.2f} {timed['memcpy'] / s:10.3f}")
    if redis_url is None:
        print("redis GETRANGE: skipped -- this checkout has no Redis index (visenc.index.redis)")


if __name__ == "__main__":
    main()
