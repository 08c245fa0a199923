"""1,000 mixed requests through a real ``visenc serve`` with a small memory budget and a real Redis:
images encoded and read, videos encoded and read by their hash, shared-memory reads of both (mapped,
copied and unmapped, as a client that hands its maps back), hash look-ups that miss L1 and are read
from Redis, and hashes nobody encoded. Sampled all along: what the service holds stays within each
part of its budget, and the tmpfs files within the shared-memory part. Once the leases lapse, pins,
shared-memory bytes and the tmpfs files are back where they started. A refused budget at start-up is
one line and exit 2."""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import random
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import msgpack
import pytest
from harness.images import png_bytes
from harness.paths import ROOT
from harness.processes import serve_subprocess
from harness.waits import metric, wait_until

from visenc_client.format import LEASE_HEADER

MiB = 1 << 20
PARTS = {"cache_bytes": 12 * MiB, "pin_overflow_bytes": 4 * MiB, "shm_max_bytes": 8 * MiB, "joined_rows_bytes": 2 * MiB}
BUDGET = 48 * MiB
MSGPACK = {"content-type": "application/msgpack", "accept": "application/msgpack"}
REQUESTS = 1000
#: what the process's resident memory may grow beyond its budget: the C heap's slack, responses in flight
RSS_SLACK = 128 * MiB

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs a Linux /dev/shm tmpfs")


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="visenc-soak-", dir="/dev/shm"))
    yield path
    for f in path.iterdir():
        f.unlink()
    path.rmdir()


def tmpfs_bytes(path: Path) -> int:
    """Bytes the files in ``path`` hold in the tmpfs (one the service unlinks meanwhile counts 0)."""
    total = 0
    for f in path.iterdir():
        with contextlib.suppress(FileNotFoundError):
            total += os.stat(f).st_blocks * 512
    return total


class Soak:
    """The request mix, run from a few threads against one service."""

    def __init__(self, url: str, shm_dir: Path) -> None:
        self.url, self.shm_dir, self.lock = url, shm_dir, threading.Lock()
        self.known: list[str] = []  # hashes encoded so far, images and videos
        self.videos: set[str] = set()
        self.clips = [[png_bytes(7000 + 10 * c + f, 120, 90) for f in range(4)] for c in range(6)]
        self.statuses: dict[int, int] = {}
        self.local = threading.local()
        self.clients: list[httpx.Client] = []

    def encode(self, http: httpx.Client, items: list[dict]) -> list[dict]:
        body = msgpack.packb({"items": items, "wait": True})
        r = http.post("/v1/encode", content=body, headers={**MSGPACK, LEASE_HEADER: "id"})
        self.count(r.status_code)
        return list(msgpack.unpackb(r.content)["items"]) if r.status_code == 200 else []

    def read(self, http: httpx.Client, item: dict) -> None:
        if item["status"] == "ready":
            r = http.get(f"/v1/embeddings/{item['hash']}", params={"lease": item["lease"]})
            self.count(r.status_code)
            with self.lock:
                self.known.append(item["hash"])
                if item.get("tubes"):
                    self.videos.add(item["hash"])

    def count(self, status: int) -> None:
        with self.lock:
            self.statuses[status] = self.statuses.get(status, 0) + 1

    def shm(self, http: httpx.Client, h: str) -> None:
        """Two chunks of ``h``, one request each, read from their segments: a video's share one."""
        segments = []
        for lo in (0, 2):
            body = msgpack.packb({"ranges": [{"hash": h, "start": lo, "end": lo + 2}]})
            r = http.post("/v1/embeddings/shm", content=body, headers=MSGPACK)
            self.count(r.status_code)
            (item,) = msgpack.unpackb(r.content)["items"]
            assert "segment" in item, item
            segments.append(item["segment"])
            with open(self.shm_dir / item["segment"], "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
                assert len(m[item["offset"] : item["offset"] + item["nbytes"]]) == item["nbytes"]
        if h in self.videos:
            assert segments[0] == segments[1], f"video {h}: a segment per read"

    def client(self) -> httpx.Client:
        """This thread's connection to the service."""
        if not hasattr(self.local, "http"):
            self.local.http = httpx.Client(base_url=self.url, timeout=60)
            with self.lock:
                self.clients.append(self.local.http)
        return self.local.http  # type: ignore[no-any-return]

    def one(self, i: int) -> None:
        rng, http = random.Random(i), self.client()
        match i % 5:
            case 0 | 1:
                side = rng.choice([48, 64, 96])  # at least 4 rows: two chunks of 2
                for it in self.encode(http, [{"data": png_bytes(8000 + i, side, side)}]):
                    self.read(http, it)
            case 2:
                for it in self.encode(http, [{"frames": rng.choice(self.clips)}]):
                    self.read(http, it)
            case 3:
                with self.lock:
                    h = rng.choice(self.known) if self.known else None
                if h is not None:
                    self.shm(http, h)
            case _:  # look-ups by hash: L1 misses read from Redis, and hashes nobody encoded
                with self.lock:
                    hashes = rng.sample(self.known, min(8, len(self.known)))
                hashes.append(hashlib.sha256(f"never {i}".encode()).hexdigest())
                body = msgpack.packb({"items": [{"hash": h} for h in hashes], "wait": False})
                self.count(http.post("/v1/encode", content=body, headers={**MSGPACK, LEASE_HEADER: "none"}).status_code)

    def close(self) -> None:
        for http in self.clients:
            http.close()


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def held(http: httpx.Client) -> dict[str, float]:
    memory = http.get("/readyz").json()["index"]["memory"]
    exposed = http.get("/metrics").text
    return {
        "l1": memory["bytes"],
        "pinned": memory["pinned_bytes"],
        "shm": metric(exposed, "visenc_shm_bytes"),
        "joined": metric(exposed, "visenc_joined_rows_bytes"),
    }


def test_a_thousand_mixed_requests_stay_within_the_budget_and_end_where_they_started(redis_url, shm_dir):
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in PARTS.items()]
    flags += [f"--process-memory-bytes={BUDGET}", "--max-batch-tokens=2048", f"--redis-url={redis_url}"]
    flags += [f"--shm-dir={shm_dir}", "--ready-lease-s=2", "--shm-lease-s=2", "--max-wait-ms=1"]
    with serve_subprocess(*flags) as (url, proc), httpx.Client(base_url=url, timeout=30) as http:
        start, start_tmpfs, start_rss = held(http), tmpfs_bytes(shm_dir), rss(proc.pid)
        soak, samples, done = Soak(url, shm_dir), [], threading.Event()

        def sample() -> None:
            with httpx.Client(base_url=url, timeout=30) as watcher:
                while not done.wait(0.05):
                    samples.append({**held(watcher), "tmpfs": tmpfs_bytes(shm_dir), "rss": rss(proc.pid) - start_rss})

        watcher = threading.Thread(target=sample)
        watcher.start()
        try:
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(soak.one, range(REQUESTS)))
        finally:
            soak.close()
            done.set()
            watcher.join()
        assert soak.statuses.get(200, 0) >= REQUESTS, soak.statuses
        assert set(soak.statuses) == {200}, soak.statuses
        assert len(samples) >= 10
        for s in samples:
            assert s["l1"] <= PARTS["cache_bytes"] + PARTS["pin_overflow_bytes"], s
            assert s["shm"] <= PARTS["shm_max_bytes"] and s["tmpfs"] <= PARTS["shm_max_bytes"] + start_tmpfs, s
            assert s["joined"] <= PARTS["joined_rows_bytes"], s
            assert s["l1"] + s["shm"] + s["joined"] <= BUDGET, s
        assert max(s["rss"] for s in samples) <= BUDGET + RSS_SLACK  # measured: 58 MiB
        assert max(s["shm"] for s in samples) > 0 and max(s["joined"] for s in samples) > 0  # both were used
        wait_until(
            lambda: (held(http)["pinned"], held(http)["shm"], tmpfs_bytes(shm_dir)) == (0, 0, start_tmpfs),
            timeout_s=30,
            what="pins, shared-memory bytes and tmpfs back at their start",
        )
        assert (start["pinned"], start["shm"]) == (0, 0)


def test_a_budget_too_small_for_one_image_is_one_line_and_exit_2():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "service"), str(ROOT / "clients"), str(ROOT)])}
    proc = subprocess.run(
        [sys.executable, "-m", "visenc", "serve", "--port", "0", "--cache-bytes", "10000"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("visenc:")]
    assert "L1 (cache_bytes=10000)" in line and "the smallest that works: --cache-bytes " in line
