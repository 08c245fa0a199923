"""Rows at a 7B model's size through every path that moves them, each against its floor, in one run.

python bench/bench_rows.py [--rounds 3] [--sizes 720p 1080p 1440p] [--json]

Each floor moves the same bytes from as many distinct buffers as its path serves images, each caller
dropping what it received, as a path's caller does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "service"), str(ROOT / "clients"), str(ROOT / "bench")]

import _common as c
import bench_gpu
from _rows_floors import RawReceiver, RawSender, Zmq, gathered_on, threaded
from harness.processes import redis_process

from visenc_client import AsyncClient, Client, Handle, ImagePlacement, RedisRows
from visenc_client.format import entry_key

SIZES = {"720p": (1280, 720), "1080p": (1920, 1080), "1440p": (2560, 1440)}
#: a tower with a 7B model's row width and next to no compute
WIDE = bench_gpu.TINY_VISION
TARGETS = {"http": 0.7, "rows": 0.9, "shm": 0.8, "redis": 0.7, "zmq": 0.7}


# --- the run -----------------------------------------------------------------------------------
class Paths:
    """Every path and floor for one set of handles, callable as (seconds for ``n`` transfers)."""

    def __init__(self, env: Env, handles: list[Handle], concurrency: int) -> None:
        self.env, self.handles, self.c = env, handles, concurrency
        self.nbytes = handles[0].num_tokens * handles[0].hidden_size * 2
        self.receivers = [RawReceiver(env.raw.port, self.nbytes) for _ in range(concurrency)]
        self.local = threading.local()

    def _each(self, n: int) -> list[Handle]:
        return [self.handles[i % len(self.handles)] for i in range(n)]

    def _buffer(self) -> np.ndarray:
        if not hasattr(self.local, "out"):
            h = self.handles[0]
            self.local.out = np.empty((h.num_tokens, h.hidden_size), np.uint16)
        return self.local.out

    def raw_socket(self, n: int) -> float:
        free = list(self.receivers)
        lock = threading.Lock()

        def one() -> None:
            with lock:
                receiver = free.pop()
            receiver.get(self.nbytes)
            with lock:
                free.append(receiver)

        return threaded(self.c, [one] * n)

    def http_sync(self, n: int) -> float:
        return threaded(self.c, [lambda h=h: self.env.http.fetch(h) for h in self._each(n)])

    def http_async(self, n: int) -> float:
        return self.env.on_loop(lambda vc: gathered_on(self.c, [lambda h=h: vc.fetch(h) for h in self._each(n)]))

    def include_rows(self, n: int) -> float:
        return threaded(
            self.c, [lambda h=h: self.env.http.lookup([h.hash], wait=True, include_rows=True) for h in self._each(n)]
        )

    def memcpy(self, n: int) -> float:
        sources = [self.env.arrays[h.hash] for h in self._each(n)]
        return threaded(self.c, [lambda s=s: np.copyto(self._buffer(), s) for s in sources])

    def shm(self, n: int) -> float:
        def one(h: Handle) -> None:
            self.env.shm.fetch_chunk([ImagePlacement.of(h, 0)], 0, h.num_tokens, out=self._buffer())

        return threaded(self.c, [lambda h=h: one(h) for h in self._each(n)])

    def redis_raw(self, n: int) -> float:
        return threaded(self.c, [lambda h=h: self.env.redis.redis.get(self.env.key(h)) for h in self._each(n)])

    def redis_rows(self, n: int) -> float:
        return threaded(self.c, [lambda h=h: self.env.redis.fetch(h) for h in self._each(n)])

    def zmq_raw(self, n: int) -> float:
        return self.env.zmq.raw(self.c, [self.env.arrays[h.hash] for h in self._each(n)])

    def zmq_visenc(self, n: int) -> float:
        return self.env.zmq.visenc(self.c, [self.env.images[h.hash] for h in self._each(n)])

    def connector(self, n: int) -> float:
        return threaded(self.c, [lambda h=h: self.env.connector(h) for h in self._each(n)])


#: (label, path, floor, target kind)
PAIRS = [
    ("HTTP Client.fetch", "http_sync", "raw_socket", "http"),
    ("HTTP AsyncClient.fetch", "http_async", "raw_socket", "http"),
    ("include_rows look-up", "include_rows", "raw_socket", "rows"),
    # the same client and bytes as a fetch: what the look-up itself costs, apart from the transport
    ("include_rows vs Client.fetch", "include_rows", "http_sync", ""),
    ("shm fetch_chunk", "shm", "memcpy", "shm"),
    ("Redis RedisRows.fetch", "redis_rows", "redis_raw", "redis"),
    ("SGLang /encode + ZMQ push", "zmq_visenc", "zmq_raw", "zmq"),
    ("VisencConnector (per image)", "connector", "raw_socket", ""),
]


class Env:
    """The servers, clients and images of one run."""

    def __init__(self, stack: contextlib.ExitStack, sizes: list[str], images_per_size: int) -> None:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="visenc-rows-")))
        checkpoint = c.write_qwen25_checkpoint(folder / "wide", WIDE)
        redis_url, _ = stack.enter_context(redis_process())
        self.url = c.serve_checkpoint(stack, checkpoint, "--ready-lease-s", "1", "--redis-url", redis_url)
        self.sglang_url = c.serve_checkpoint(stack, checkpoint, "--ready-lease-s", "1", "--image-loader", "sglang")
        self.http = stack.enter_context(Client(self.url))
        self.shm = stack.enter_context(Client(self.url, shared_memory=True))
        self.fingerprint = self.http.model()["fingerprint"]
        self.redis = RedisRows.from_url(redis_url, fingerprint=self.fingerprint)
        stack.callback(self.redis.close)
        self.images: dict[str, bytes] = {}
        self.handles: dict[str, list[Handle]] = {}
        self.arrays: dict[str, np.ndarray] = {}
        for label in sizes:
            pngs = [c.jpeg(1000 * list(SIZES).index(label) + i, *SIZES[label]) for i in range(images_per_size)]
            handles = self.http.encode(pngs)
            with Client(self.sglang_url) as sg:
                sg.encode(pngs)
            self.handles[label] = handles
            for data, h in zip(pngs, handles):
                self.images[h.hash] = data
                self.arrays[h.hash] = self.http.fetch(h)
                self.shm.fetch(h)  # the segment, known from now on
        largest = max(a.nbytes for a in self.arrays.values())
        self.raw = RawSender([bytes(largest) for _ in range(images_per_size)])
        self.zmq = Zmq(self.sglang_url)
        self.loop = asyncio.new_event_loop()
        self.async_client = AsyncClient(self.url)
        stack.callback(self.loop.close)
        stack.callback(lambda: self.loop.run_until_complete(self.async_client.aclose()))
        self.connector = make_connector(self.url, self.http.model(), checkpoint)

    def key(self, h: Handle) -> str:
        return entry_key("default", self.fingerprint, h.hash)

    def on_loop(self, make: Callable[[AsyncClient], Awaitable[float]]) -> float:
        return self.loop.run_until_complete(make(self.async_client))


def make_connector(url: str, model: dict[str, Any], checkpoint: Path) -> Callable[[Handle], Any] | None:
    """One image through ``VisencConnector``: its scheduler side's look-up (rows checked against what
    vLLM reads) and its worker side's load into an encoder cache (``None`` where vLLM is not installed)."""
    try:
        import torch

        from visenc_client.vllm import ConnectorStats, VisencConnector, VisencConnectorMetadata, Want
    except ImportError:
        return None
    from types import SimpleNamespace

    connector: Any = object.__new__(VisencConnector)  # its scheduler and worker halves, without a vLLM engine
    connector.stats = ConnectorStats()
    connector._hidden, connector._dtype, connector._device = int(model["hidden_size"]), torch.bfloat16, "cpu"
    connector._model, connector._checkpoint = str(checkpoint), (str(checkpoint), None, None)  # the weights vLLM loads
    options = {"url": url, "transport": "http"}
    connector._start_scheduler_side(SimpleNamespace(get_from_extra_config=lambda k, d: options.get(k, d)))

    bound = threading.local()  # each caller's thread loads its own metadata, as each vLLM worker does
    connector._get_connector_metadata = lambda: bound.meta

    def load(h: Handle) -> Any:
        rows = connector._obtain({h.hash: Want(h.num_tokens, None)}, True)[h.hash]
        bound.meta = VisencConnectorMetadata(items=[(h.hash, rows)])
        cache: dict[str, Any] = {}
        connector.start_load_caches(cache)
        return cache[h.hash]

    return load


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sizes", nargs="*", default=list(SIZES), choices=list(SIZES))
    p.add_argument("--concurrency", nargs="*", type=int, default=[1, 16])
    p.add_argument("--images", type=int, default=4, help="distinct screenshots per size")
    p.add_argument("--transfers", type=int, default=32, help="transfers per path per round")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    report: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        env = Env(stack, args.sizes, args.images)
        pairs = [pr for pr in PAIRS if pr[1] != "connector" or env.connector is not None]
        if env.connector is None:
            print("VisencConnector: vLLM is not installed here (run in .venv-vllm for its row)")
        for label in args.sizes:
            handles = env.handles[label]
            mb = handles[0].num_tokens * handles[0].hidden_size * 2 / 1e6
            for conc in args.concurrency:
                paths = Paths(env, handles, conc)
                n = max(args.transfers, conc)
                names = sorted({x for pr in pairs for x in pr[1:3]})
                for name in names:  # warm-up
                    getattr(paths, name)(conc)
                seconds: dict[str, list[float]] = {name: [] for name in names}
                for r in range(args.rounds):
                    for name in names if r % 2 == 0 else names[::-1]:
                        seconds[name].append(getattr(paths, name)(n))
                print(f"{label} ({mb:.1f} MB of rows an image), {conc} caller(s), {n} transfers a round:")
                for title, path, floor, kind in pairs:
                    ratios = [f / s for s, f in zip(seconds[path], seconds[floor])]
                    gbs = n * mb / 1e3 / statistics.median(seconds[path])
                    floor_gbs = n * mb / 1e3 / statistics.median(seconds[floor])
                    per_image = statistics.median(seconds[path]) / n * conc * 1e3
                    goal = f"  goal >= {TARGETS[kind]}" if kind else f"  {per_image:.1f} ms an image"
                    print(
                        f"  {title:30s} {gbs:6.2f} GB/s  ÷ {floor:10s} {floor_gbs:6.2f} GB/s: {c.spread(ratios)}{goal}"
                    )
                    report.append(
                        {"size": label, "callers": conc, "path": title, "gb_s": gbs, "floor": floor,
                         "floor_gb_s": floor_gbs, "ratio": statistics.median(ratios), "ms_per_image": per_image}
                    )  # fmt: skip
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
