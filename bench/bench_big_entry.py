"""One big entry (default 64 MiB of rows) fetched through each transport, against its fair floor.

python bench/bench_big_entry.py [--mib 64] [--rounds 7]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "service"), str(ROOT / "clients"), str(ROOT / "bench")]

import _common as c
from harness.processes import redis_process, serve_process
from harness.waits import free_port

from visenc_client import Client, ImagePlacement, RowRange
from visenc_client._shm import SegmentHandles
from visenc_client.format import DATA_OFFSET, entry_key, image_hash, pack_entry

RAW_APP = """
import os
body = open(os.environ["VISENC_RAW_FILE"], "rb").read()
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    if scope["path"] == "/healthz":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
        return
    headers = [(b"content-type", b"application/octet-stream"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})
"""


@contextlib.contextmanager
def raw_server(payload: bytes, folder: Path) -> Iterator[str]:
    """A bare ASGI app on uvicorn that answers every GET with ``payload``."""
    (folder / "raw_app.py").write_text(RAW_APP)
    (folder / "payload.bin").write_bytes(payload)
    port = free_port()
    env = {**os.environ, "VISENC_RAW_FILE": str(folder / "payload.bin")}
    cmd = [sys.executable, "-m", "uvicorn", "raw_app:app", "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=folder, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        c.wait_ready(url, proc, timeout_s=30, path="/healthz")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    import httpx
    import redis

    with (
        redis_process() as (redis_url, _),
        serve_process("--shm-enabled", "true", "--redis-url", redis_url) as url,
        Client(url) as http,
        Client(url, shared_memory=True) as shm,
        contextlib.ExitStack() as stack,
    ):
        info = http.model()
        hidden = int(info["hidden_size"])
        rows = args.mib * (1 << 20) // (hidden * 4)
        data = np.random.default_rng(0).standard_normal((rows, hidden)).astype(np.float32)
        h = image_hash(b"a big entry %d" % args.mib)
        entry = pack_entry(data, dtype="float32", grid_thw=(1, 2, rows * 2), fingerprint=info["fingerprint"], hash=h)
        key = entry_key("default", info["fingerprint"], h)
        r = redis.Redis.from_url(redis_url)
        r.set(key, bytes(entry.blob))
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="visenc-big-")))
        raw_url = stack.enter_context(raw_server(bytes(entry.rows_view()), folder))
        raw = stack.enter_context(httpx.Client(timeout=60))
        out = np.empty((rows, hidden), np.float32)
        flat = out.reshape(-1).view(np.uint8)
        placement = [ImagePlacement(h, 0, rows)]
        nbytes = out.nbytes

        def forget() -> None:
            shm._segments = SegmentHandles()  # as a client that never read this image

        def getrange() -> None:
            value = r.getrange(key, DATA_OFFSET, DATA_OFFSET + nbytes - 1)
            flat[:] = np.frombuffer(value, np.uint8)

        runs: dict[str, Callable[[], object]] = {
            "memcpy": lambda: np.copyto(out, data),
            "shm fetch_chunk": lambda: shm.fetch_chunk(placement, 0, rows, out=out),
            "shm asks first": lambda: (forget(), shm.fetch_chunk(placement, 0, rows, out=out)),
            "shm views": lambda: shm.fetch_many([RowRange(h)]),
            "redis GETRANGE": getrange,
            "redis raw GET": lambda: r.get(key),
            "http fetch_chunk": lambda: http.fetch_chunk(placement, 0, rows, out=out),
            "http raw GET": lambda: raw.get(raw_url).content,
        }
        for call in runs.values():  # warm: L1 promotion, the shm segment, connections
            call()
        assert shm.fetch_chunk(placement, 0, rows).tobytes() == data.tobytes()
        assert http.fetch_chunk(placement, 0, rows).tobytes() == data.tobytes()
        times = timed(runs, args.rounds)
    report(times, rows, hidden, nbytes, args.rounds)


def timed(runs: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Seconds of each run per round, the order alternating round by round."""
    times: dict[str, list[float]] = {k: [] for k in runs}
    for rnd in range(rounds):
        for name in list(runs)[:: 1 if rnd % 2 == 0 else -1]:
            t0 = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def report(times: dict[str, list[float]], rows: int, hidden: int, nbytes: int, rounds: int) -> None:
    def ratio(a: str, b: str) -> list[float]:
        return [y / x for x, y in zip(times[a], times[b])]  # throughput a / throughput b

    print(f"one entry of {rows} rows x {hidden} float32 = {nbytes / 2**20:.0f} MiB, {rounds} rounds")
    for name, ts in times.items():
        print(f"  {name:18s} {nbytes / min(ts) / 1e9:6.2f} GB/s best")
    print(f"  shm fetch_chunk / memcpy     {c.spread(ratio('shm fetch_chunk', 'memcpy'))}   goal >= 0.8")
    print(f"  shm asks first / memcpy      {c.spread(ratio('shm asks first', 'memcpy'))}")
    print(f"  shm views / memcpy           {c.spread(ratio('shm views', 'memcpy'))}")
    print(f"  redis GETRANGE / raw GET     {c.spread(ratio('redis GETRANGE', 'redis raw GET'))}   goal >= 0.7")
    print(f"  http fetch_chunk / raw HTTP  {c.spread(ratio('http fetch_chunk', 'http raw GET'))}   goal >= 0.5")


if __name__ == "__main__":
    main()
