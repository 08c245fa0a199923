"""Kill-and-restart soak: two replicas share one Redis under bounded prefill-like load; one of them is
killed with SIGKILL at random moments and started again at once, as a supervisor does.

Each client request is a prefill worker's path for one image: the connector's look-up by hash, an encode
that waits, the rows over HTTP and over shared memory. A request that meets a killed replica gets a
retryable error and is tried again on the other one. Every row is compared with the rows of a run
without faults (before the first kill, in a namespace of its own). Afterwards the shared-memory folder,
the download folder and Redis' claim keys are back at their level before the load. Prints the counts.

    python bench/bench_kill_soak.py [--kills 20] [--clients 4] [--images 600] [--seed 0] [--gap-s 9]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from harness.images import png_bytes
from harness.processes import redis_process
from harness.waits import free_port, wait_ready, wait_until

from visenc_client import (
    Client,
    DeadlineError,
    OverloadedError,
    ProtocolError,
    TransportError,
    UnavailableError,
    VisencClientError,
)
from visenc_client.format import image_hash

#: what a client meets when a replica is killed or starting: it tries again, on the other replica
RETRYABLE = (TransportError, UnavailableError, OverloadedError, DeadlineError, ProtocolError)
TRIES = 8
FRESH_SHARE = 0.25
LEASE_S, CLAIM_TTL_MS = 3, 2000


@dataclass
class Folders:
    shm: Path
    downloads: Path

    def level(self) -> tuple[int, int]:
        """(files, bytes) in both folders together."""
        files = [p for d in (self.shm, self.downloads) for p in d.rglob("*") if p.is_file()]
        return len(files), sum(p.stat().st_size for p in files)


class Replica:
    """``visenc serve`` on a fixed port, killed and started again in place."""

    def __init__(self, name: str, args: list[str], log: Path) -> None:
        self.name, self.port, self.args, self.log = name, free_port(), args, log
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("service", "clients", "."))}
        argv = [sys.executable, "-m", "visenc", "serve", "--host", "127.0.0.1", "--port", str(self.port), *self.args]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=out, cwd=ROOT)

    def kill(self) -> bool:
        """SIGKILL; returns whether it was ready then (else it was killed while it started)."""
        import httpx

        assert self.proc is not None
        try:
            ready = httpx.get(self.url + "/readyz", timeout=0.5).status_code == 200
        except httpx.HTTPError:
            ready = False
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        return ready

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=60)


@dataclass
class Tally:
    counts: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)
    fresh: int = 0  #: images asked for so far (the next one is new to the service)

    def pick(self, rng: random.Random, images: int) -> int:
        """A new image a quarter of the time while any is left (it is encoded during the kills), else one
        asked for before (a hit)."""
        with self.lock:
            if self.fresh == 0 or (self.fresh < images and rng.random() < FRESH_SHARE):
                self.fresh += 1
                return self.fresh - 1
            return rng.randrange(self.fresh)

    def add(self, what: str, error: BaseException | None = None) -> None:
        with self.lock:
            self.counts[what] += 1
            if error is not None:
                self.errors[f"{type(error).__name__}: {str(error)[:70]}"] += 1


def prefill(vc: Client, shm: Client, data: bytes) -> tuple[str, list[np.ndarray]]:
    """One image as a prefill worker takes it: look-up by hash, encode with wait, rows over HTTP and shm."""
    (known,) = vc.lookup([image_hash(data)], pin=False)
    (h,) = vc.encode([data])
    return f"look-up found it {known.status}", [vc.fetch(h), shm.fetch(h)]


def client_loop(replicas: list[Replica], images: list[bytes], want: dict[int, np.ndarray], tally: Tally, stop) -> None:
    rng = random.Random(threading.get_ident())
    clients = {r.url: (Client(r.url, timeout=30), Client(r.url, shared_memory=True, timeout=30)) for r in replicas}
    try:
        while not stop.is_set():
            i = tally.pick(rng, len(images))
            order = rng.sample(replicas, len(replicas))
            for attempt in range(TRIES):
                vc, shm = clients[order[attempt % len(order)].url]
                try:
                    found, rows = prefill(vc, shm, images[i])
                except RETRYABLE as e:
                    tally.add("retryable error", e)
                    time.sleep(0.2 * (attempt + 1))
                    continue
                except VisencClientError as e:
                    tally.add("unclear error", e)
                    break
                right = all(np.array_equal(r, want[i]) for r in rows)
                tally.add("rows right" if right else "rows wrong")
                tally.add(found)
                tally.add("answered at once" if attempt == 0 else "answered on a retry")
                break
            else:
                tally.add("no rows after retries")
            time.sleep(0.02)
    finally:
        for pair in clients.values():
            for c in pair:
                c.close()


def reference(url: str, images: list[bytes]) -> dict[int, np.ndarray]:
    """The rows of a run without faults, before any kill: in a namespace of its own, so that the soak's
    clients find none of its entries and encode their images during the kills."""
    with Client(url, namespace="reference", timeout=120) as vc:
        handles = [h for at in range(0, len(images), 64) for h in vc.encode(images[at : at + 64])]
        return {i: vc.fetch(h) for i, h in enumerate(handles)}


def claim_keys(redis_url: str) -> int:
    import redis

    with redis.Redis.from_url(redis_url) as r:
        return sum(1 for _ in r.scan_iter("*:claim")) + sum(1 for _ in r.scan_iter("*:queued"))


def killer(victim: Replica, kills: int, rng: random.Random, kinds: Counter[str], gap_s: float) -> None:
    """``kills`` SIGKILLs at random moments, each followed at once by a new start (as a supervisor does)."""
    for _ in range(kills):
        time.sleep(rng.uniform(0.5, gap_s))  # some land while it starts (loading takes seconds)
        kinds["killed while serving" if victim.kill() else "killed while starting"] += 1
        victim.start()


@contextlib.contextmanager
def folders() -> Iterator[Folders]:
    shm = Path(tempfile.mkdtemp(prefix="visenc-soak-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    downloads = Path(tempfile.mkdtemp(prefix="visenc-soak-downloads-"))
    try:
        yield Folders(shm, downloads)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(downloads, ignore_errors=True)


def soak(
    kills: int, clients: int = 3, images: int = 200, seed: int = 0, logs: Path | None = None, gap_s: float = 9.0
) -> dict[str, int]:
    """The soak, bounded by ``kills`` (each at most ``gap_s`` after the last start); returns the counts (also
    printed)."""
    rng = random.Random(seed)
    logs = logs or Path(tempfile.mkdtemp(prefix="visenc-soak-logs-"))
    pool = [png_bytes(1000 * seed + i, rng.randrange(48, 160, 8), rng.randrange(48, 128, 8)) for i in range(images)]
    with folders() as where, redis_process() as (redis_url, _):
        args = ["--redis-url", redis_url, "--shm-enabled", "true", "--shm-dir", str(where.shm), "--torch-threads", "1"]
        args += [
            "--shm-lease-s",
            str(LEASE_S),
            "--claim-ttl-ms",
            str(CLAIM_TTL_MS),
            "--download-dir",
            str(where.downloads),
        ]
        replicas = [Replica(n, args, logs / f"{n}.log") for n in ("a", "b")]
        try:
            for r in replicas:
                r.start()
            for r in replicas:
                wait_ready(r.url, r.proc)
            want = reference(replicas[0].url, pool)
            wait_until(lambda: claim_keys(redis_url) == 0, 30, "the reference's claims lapse", interval_s=0.2)
            before, claims_before = where.level(), claim_keys(redis_url)
            tally, kinds, stop = Tally(), Counter[str](), threading.Event()
            threads = [
                threading.Thread(target=client_loop, args=(replicas, pool, want, tally, stop)) for _ in range(clients)
            ]
            for t in threads:
                t.start()
            try:
                killer(replicas[1], kills, rng, kinds, gap_s)
                wait_ready(replicas[1].url, replicas[1].proc)
                time.sleep(2.0)  # the restarted one serves a while too
            finally:
                stop.set()
                for t in threads:
                    t.join(timeout=120)
            counts = {**kinds, **tally.counts, **settled(where, before, redis_url, claims_before)}
        finally:
            for r in replicas:
                r.stop()
    for name, n in counts.items():
        print(f"{name:44s} {n}")
    for kind, n in tally.errors.most_common(8):
        print(f"  error seen {n}x: {kind}")
    return counts


def settled(where: Folders, before: tuple[int, int], redis_url: str, claims_before: int) -> dict[str, int]:
    """Once the last leases and claims have lapsed: the folders' and Redis' levels against those before."""
    with contextlib.suppress(TimeoutError):
        wait_until(
            lambda: where.level() == before and claim_keys(redis_url) == claims_before,
            LEASE_S + CLAIM_TTL_MS / 1000 + 30,
            interval_s=0.5,
        )
    files, nbytes = where.level()
    return {
        "shm+download files after - before": files - before[0],
        "shm+download bytes after - before": nbytes - before[1],
        "claim keys after - before": claim_keys(redis_url) - claims_before,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--images", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gap-s", type=float, default=9.0, help="longest time from a start to the next kill")
    a = parser.parse_args()
    started = time.monotonic()
    soak(a.kills, a.clients, a.images, a.seed, gap_s=a.gap_s)
    print(f"{'seconds':40s} {time.monotonic() - started:.0f}")


if __name__ == "__main__":
    main()
