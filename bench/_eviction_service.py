"""The in-process index's hit rates through the service's own request path (``bench_eviction.py --service``)."""

from __future__ import annotations

import base64
import contextlib
import itertools
import os
import random
import re
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _common as c
import bench_gpu
import httpx

from visenc_client.format import DATA_OFFSET, LEASE_HEADER, image_hash

SIZES = {"720p": (1280, 720), "1080p": (1920, 1080)}
#: the resize ceiling of the served tower: twice 1080p, so every size above keeps its rows
MAX_PIXELS = 2 * 1920 * 1080
#: how often a shm caller reads a segment it already knows, after its first read
SHM_REREADS = 2


@dataclass
class Image:
    data: bytes
    hash: str
    nbytes: int = 0  # its stored entry's size, once known


@dataclass
class Run:
    """One workload through one caller mix: the references in order and which of them hit."""

    refs: list[tuple[Image, str]]  # (image, caller) in order
    counted_from: int  # references before this one are warm-up
    hits: list[bool] = field(default_factory=list)


class Service:
    """One ``visenc serve`` of ``tree`` (a source tree) with ``cache_bytes`` of L1."""

    def __init__(self, stack: contextlib.ExitStack, tree: Path, checkpoint: Path, cache_bytes: int, lease_s: float):
        port = c.free_port()
        env = {"PYTHONPATH": os.pathsep.join([str(tree / "service"), str(tree / "clients")])}
        flags = ("--dtype", "bfloat16", "--cache-bytes", str(cache_bytes), "--ready-lease-s", str(lease_s))
        flags += ("--max-pixels", str(MAX_PIXELS))  # an L1 of a few screenshots holds the largest image
        stack.enter_context(
            c.server(c.visenc_cmd(str(checkpoint), port, *flags), f"http://127.0.0.1:{port}/readyz", env)
        )
        self.url = f"http://127.0.0.1:{port}"
        self._local = threading.local()

    @property
    def http(self) -> httpx.Client:
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = httpx.Client(base_url=self.url, timeout=300.0)
        return client

    def encode(self, items: list[dict[str, Any]], *, keep: bool = True, **body: Any) -> list[dict[str, Any]]:
        """``keep`` false: the request asks the service to keep nothing for it (the proxy's header)."""
        headers = {} if keep else {LEASE_HEADER: "none"}
        answer = self.http.post("/v1/encode", json={"items": items, **body}, headers=headers)
        answer.raise_for_status()
        return list(answer.json()["items"])

    def look_up(self, image: Image, *, wait: bool, keep: bool = True) -> bool:
        """Hash first, the bytes on ``missing``: whether the hash alone answered ready."""
        (first,) = self.encode([{"hash": image.hash}], wait=wait, keep=keep)
        if first["status"] == "missing":
            data = base64.b64encode(image.data).decode()
            (first,) = self.encode([{"hash": image.hash, "data": data}], wait=wait, keep=keep)
            assert first["status"] in ("ready", "pending"), first
            return False
        assert first["status"] in ("ready", "pending"), first
        return first["status"] == "ready"

    def http_reader(self, image: Image) -> bool:
        hit = self.look_up(image, wait=True)
        rows = self.http.get(f"/v1/embeddings/{image.hash}")
        rows.raise_for_status()
        image.nbytes = image.nbytes or len(rows.content)
        return hit

    def proxy_then_connector(self, image: Image) -> bool:
        hit = self.look_up(image, wait=False, keep=False)  # the proxy: never reads, and says so
        (handle,) = self.encode([{"hash": image.hash}], wait=True, include_rows=True)  # the connector
        assert handle["status"] == "ready" and handle.get("rows"), handle["status"]
        image.nbytes = image.nbytes or len(base64.b64decode(handle["rows"]))
        return hit

    def shm_reader(self, image: Image) -> bool:
        hit = self.look_up(image, wait=True)
        answer = self.http.post("/v1/embeddings/shm", json={"ranges": [{"hash": image.hash}]})
        answer.raise_for_status()
        body = answer.json()
        (item,) = body["items"]
        if "segment" not in item:  # the shm budget is full: read over HTTP, as the client does
            rows = self.http.get(f"/v1/embeddings/{image.hash}")
            rows.raise_for_status()
            image.nbytes = image.nbytes or len(rows.content)
            return hit
        path = Path(body["dir"]) / item["segment"]
        for _ in range(1 + SHM_REREADS):  # the first read, then re-reads of a segment it knows
            with open(path, "rb") as f:
                f.seek(item["offset"])
                image.nbytes = image.nbytes or len(f.read(item["nbytes"]))
        return hit

    def callers(self) -> dict[str, Callable[[Image], bool]]:
        return {"http": self.http_reader, "proxy+connector": self.proxy_then_connector, "shm": self.shm_reader}


def lru_hits(refs: list[tuple[Image, str]], max_bytes: int) -> list[bool]:
    """LRU on the same references, each entry by its size in the service (rows and header, as L1
    counts them: at 1x the working set, 256 bytes an entry decide whether the last screenshot fits)."""
    held: OrderedDict[str, int] = OrderedDict()
    total, hits = 0, []
    for image, _ in refs:
        hit = image.hash in held
        hits.append(hit)
        if hit:
            held.move_to_end(image.hash)
            continue
        held[image.hash] = image.nbytes + DATA_OFFSET
        total += image.nbytes + DATA_OFFSET
        while total > max_bytes:
            total -= held.popitem(last=False)[1]
    return hits


def drive(service: Service, run: Run, concurrency: int, pause_every: int = 0, pause_s: float = 0.0) -> None:
    """The references in order, through ``concurrency`` callers taking the next one as they are free;
    with ``pause_every``, a pause of ``pause_s`` after every that many (leases lapse meanwhile)."""
    callers = service.callers()
    run.hits = [False] * len(run.refs)
    blocks = (
        [run.refs] if not pause_every else [run.refs[i : i + pause_every] for i in range(0, len(run.refs), pause_every)]
    )
    done = 0
    with ThreadPoolExecutor(concurrency) as pool:
        for block in blocks:
            results = pool.map(lambda ref: callers[ref[1]](ref[0]), block)
            for i, hit in enumerate(results, done):
                run.hits[i] = hit
            done += len(block)
            if pause_s and done < len(run.refs):
                time.sleep(pause_s)


def images(count: int, size: str, seed: int) -> list[Image]:
    out = []
    for i in range(count):
        data = c.jpeg(seed + i, *SIZES[size])
        out.append(Image(data, image_hash(data)))
    return out


def cyclic(slots: int, caller: str, passes: int) -> Run:
    """1.5x the cache's 720p screenshots, in the same order, pass after pass; the first pass is warm-up."""
    shots = images(slots * 3 // 2, "720p", 100)
    return Run([(im, caller) for im in shots] * passes, len(shots))


def agent(sessions: int, history: int, rounds: int, caller: str) -> Run:
    """Each turn of a conversation resends its last ``history`` screenshots and one new one (720p or
    1080p); conversations take turns in a random order; the first quarter is warm-up."""
    rng = random.Random(0)
    counter = itertools.count(10_000)
    recent: list[list[Image]] = [[] for _ in range(sessions)]
    refs: list[tuple[Image, str]] = []
    for _ in range(rounds):
        for s in rng.sample(range(sessions), sessions):
            n = next(counter)
            recent[s] = [*recent[s], *images(1, rng.choice(list(SIZES)), n)][-(history + 1) :]
            refs += [(im, caller) for im in recent[s]]
    return Run(refs, len(refs) // 4)


def hot_and_once(slots: int, hot: int, once: int, rounds: int) -> tuple[Run, set[str]]:
    """Each round, ``hot`` screenshots handed over by the proxy and read by the connector, then ``once``
    new ones read once over HTTP; the hot ones plus a round of new ones fit in the cache."""
    assert hot + once < slots
    hot_shots = images(hot, "720p", 200)
    refs: list[tuple[Image, str]] = []
    for r in range(rounds):
        refs += [(im, "proxy+connector") for im in hot_shots]
        refs += [(im, "http") for im in images(once, "720p", 1000 + r * once)]
    return Run(refs, hot + once), {im.hash for im in hot_shots}


@contextlib.contextmanager
def checkpoint() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="visenc-eviction-") as folder:
        yield c.write_qwen25_checkpoint(Path(folder) / "wide", bench_gpu.TINY_VISION)


def rate(
    hits: list[bool], start: int, only: set[str] | None = None, refs: list[tuple[Image, str]] | None = None
) -> float:
    picked = [h for i, h in enumerate(hits) if i >= start and (only is None or refs is None or refs[i][0].hash in only)]
    return sum(picked) / max(1, len(picked))


def row_bytes(tree: Path, model: Path) -> dict[str, int]:
    """The bytes of one screenshot's rows in the service, by size."""
    with contextlib.ExitStack() as stack:
        service = Service(stack, tree, model, 1 << 30, 30.0)
        out = {}
        for size in SIZES:
            (shot,) = images(1, size, 7)
            service.http_reader(shot)
            out[size] = shot.nbytes
        return out


@dataclass
class Workload:
    label: str
    make: Callable[[], tuple[Run, set[str] | None]]
    cache_bytes: int
    lease_s: float = 30.0
    concurrency: int = 1
    pause_every: int = 0
    target: str = ""  # what the row must reach, as a rule on (lru, visenc)


def workloads(rows: dict[str, int], slots: int, passes: int, rounds: int) -> list[Workload]:
    cache = slots * rows["720p"]
    mean = sum(rows.values()) / len(rows)
    sessions, history = 4, 3
    hot, once = max(2, slots // 5), slots // 2
    out = [
        Workload(
            f"cyclic pass over 1.5x L1 ({slots * 3 // 2} 720p), {caller}{' x16' if n > 1 else ''}",
            lambda caller=caller: (cyclic(slots, caller, passes), None),
            cache,
            concurrency=n,
            target=">= 0.5",
        )
        for caller, n in (("http", 1), ("http", 16), ("proxy+connector", 1), ("shm", 1))
    ]
    out += [
        Workload(
            f"agent {sessions}x{history + 1} (720p/1080p), cache 1x working set, {caller}{' x16' if n > 1 else ''}",
            lambda caller=caller: (agent(sessions, history, rounds, caller), None),
            int(sessions * (history + 1) * mean),
            concurrency=n,
            target="LRU - 0.02",
        )
        for caller, n in (("http", 1), ("http", 16), ("proxy+connector", 1))
    ]
    out.append(
        Workload(
            f"hot ({hot}, proxy+connector) and read once ({once}, http), 1 s lease lapsing: hot only",
            lambda: hot_and_once(slots, hot, once, rounds // 2),
            cache,
            lease_s=1.0,
            pause_every=hot + once,
            target="1.0",
        )
    )
    return out


class PeakBytes:
    """The most bytes the service's L1 held (``/readyz``), sampled every 20 ms while a run lasts."""

    def __init__(self, url: str) -> None:
        self.url, self.peak, self._stop = url, 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30.0) as client:
            while not self._stop.wait(0.02):
                index = client.get("/readyz").json()["index"]
                self.peak = max(self.peak, int(index.get("memory", index)["bytes"]))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def measure(tree: Path, model: Path, w: Workload, run: Run, only: set[str] | None) -> tuple[float, float]:
    """The hit rate of ``run`` through ``tree``'s service, and the most its L1 held ÷ its budget."""
    with contextlib.ExitStack() as stack:
        service = Service(stack, tree, model, w.cache_bytes, w.lease_s)
        peak = PeakBytes(service.url)
        try:
            drive(service, run, w.concurrency, w.pause_every, w.lease_s + 0.5 if w.pause_every else 0.0)
        finally:
            held = peak.stop()
    return rate(run.hits, run.counted_from, only, run.refs), held / w.cache_bytes


def main_service(trees: dict[str, Path], slots: int, passes: int, rounds: int, only: str | None) -> dict[str, Any]:
    """Every workload through every tree's service; prints and returns the table."""
    table: dict[str, dict[str, Any]] = {}
    with checkpoint() as model:
        rows = row_bytes(next(iter(trees.values())), model)
        for w in workloads(rows, slots, passes, rounds):
            if only and not re.search(only, w.label):
                continue
            run, hot = w.make()
            result: dict[str, Any] = {}
            for name, tree in trees.items():
                result[name], result[f"{name} L1 peak"] = measure(tree, model, w, run, hot)
            result["LRU"] = rate(lru_hits(run.refs, w.cache_bytes), run.counted_from, hot, run.refs)
            result["target"] = w.target
            table[w.label] = result
            print_row(w.label, result, list(trees))
    return table


def print_row(label: str, result: dict[str, Any], trees: list[str]) -> None:
    cells = "  ".join(f"{name} {result[name]:.3f}" for name in ["LRU", *trees])
    cells += "  (L1 peak ÷ budget: " + ", ".join(f"{name} {result[f'{name} L1 peak']:.2f}" for name in trees) + ")"
    print(f"{label}: {cells}  target {result['target']}", flush=True)
