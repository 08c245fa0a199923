"""Kill-and-restart soak: two replicas share one Redis under a bounded Locust load of prefill-like users
(``loadtest/prefill_soak.py``: the connector's look-up, an encode that waits, the rows over HTTP and over
shared memory, every row compared with a run without faults). One replica is killed with SIGKILL at random
moments and started again at once, as a supervisor does: most kills land while it serves, under load (it
is ready, then a random moment later), the others while it starts. A request that meets the killed replica
gets a retryable error and is tried again on the other one. Afterwards the shared-memory folder, the
download folder and Redis' claim keys are back at their level before the load. Prints the counts.

    python bench/bench_kill_soak.py [--kills 20] [--clients 4] [--images 600] [--seed 0] [--gap-s 6]
        [--starting-share 0.15] [--max-s S] [--json PATH]

Run it as a script: the load's users are gevent greenlets, so the process is patched before anything
else is imported (importing this module, as the vLLM kill test does for ``Replica``, patches nothing).
"""

from __future__ import annotations

if __name__ == "__main__":
    from gevent import monkey

    monkey.patch_all()

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from harness.images import png_bytes
from harness.processes import redis_process
from harness.waits import free_port, wait_ready, wait_until

from visenc_client import Client

LEASE_S, CLAIM_TTL_MS = 3, 2000
#: the longest a (re)started replica may take to be ready
READY_S = 120.0
#: after the last kill, the restarted replica serves this long under load too
SERVE_AFTER_S = 2.0
#: a kill of a serving replica waits this long at most for a request on it
AIM_S = 1.0


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

    def ready(self) -> bool:
        import httpx

        try:
            return httpx.get(self.url + "/readyz", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> bool:
        """SIGKILL; returns whether it was ready then (else it was killed while it started)."""
        assert self.proc is not None
        ready = self.ready()
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        return ready

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=60)


def reference(url: str, images: list[bytes]) -> dict[int, np.ndarray]:
    """The rows of a run without faults, before any kill: in a namespace of its own, so that the soak's
    users find none of its entries and encode their images during the kills."""
    with Client(url, namespace="reference", timeout=120) as vc:
        handles = [h for at in range(0, len(images), 64) for h in vc.encode(images[at : at + 64])]
        return {i: vc.fetch(h) for i, h in enumerate(handles)}


def claim_keys(redis_url: str) -> int:
    import redis

    with redis.Redis.from_url(redis_url) as r:
        return sum(1 for _ in r.scan_iter("*:claim")) + sum(1 for _ in r.scan_iter("*:queued"))


@dataclass
class Kills:
    """``kills`` SIGKILLs of ``victim``, each followed at once by a new start (as a supervisor does). A
    share ``starting_share`` lands while it starts; the others once it is ready, a random moment (up to
    ``gap_s``) later, while it serves the load, with a request on it where one comes within ``AIM_S``."""

    victim: Replica
    kills: int
    rng: random.Random
    gap_s: float
    starting_share: float
    in_flight: Counter[str]
    counts: Counter[str]

    def run(self) -> None:
        for k in range(self.kills):
            if self.rng.random() < self.starting_share and k > 0:  # the first one has served since the start
                time.sleep(self.rng.uniform(0.2, 1.5))  # loading takes seconds
            else:
                wait_ready(self.victim.url, self.victim.proc, READY_S)
                time.sleep(self.rng.uniform(0.3, self.gap_s))
                with contextlib.suppress(TimeoutError):  # mid-request, when one comes soon
                    wait_until(lambda: self.in_flight[self.victim.url] > 0, AIM_S, interval_s=0.002)
            busy = self.in_flight[self.victim.url]
            serving = self.victim.kill()
            self.counts["killed while serving" if serving else "killed while starting"] += 1
            self.counts["killed while serving with requests on it"] += serving and busy > 0
            self.counts["requests on it at its kills"] += busy
            self.victim.start()
        wait_ready(self.victim.url, self.victim.proc, READY_S)
        time.sleep(SERVE_AFTER_S)


@contextlib.contextmanager
def folders() -> Iterator[Folders]:
    shm = Path(tempfile.mkdtemp(prefix="visenc-soak-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    downloads = Path(tempfile.mkdtemp(prefix="visenc-soak-downloads-"))
    try:
        yield Folders(shm, downloads)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(downloads, ignore_errors=True)


def serve_args(redis_url: str, where: Folders) -> list[str]:
    args = ["--redis-url", redis_url, "--shm-enabled", "true", "--shm-dir", str(where.shm), "--torch-threads", "1"]
    args += ["--shm-lease-s", str(LEASE_S), "--claim-ttl-ms", str(CLAIM_TTL_MS)]
    return [*args, "--download-dir", str(where.downloads), "--log-level", "warning"]


def soak(a: argparse.Namespace) -> dict[str, int]:
    """The soak, bounded by ``a.kills`` and ``a.max_s``; returns the counts (also printed)."""
    from gevent import monkey

    if not monkey.is_module_patched("socket"):
        raise RuntimeError("run the soak as a script (python bench/bench_kill_soak.py): its load is gevent's")
    from loadtest.prefill_soak import Soak, run_load

    rng = random.Random(a.seed)
    logs = a.logs or Path(tempfile.mkdtemp(prefix="visenc-soak-logs-"))
    pool = [png_bytes(1000 * a.seed + i, rng.randrange(48, 160, 8), rng.randrange(48, 128, 8)) for i in range(a.images)]
    with folders() as where, redis_process() as (redis_url, _):
        replicas = [Replica(n, serve_args(redis_url, where), logs / f"{n}.log") for n in ("a", "b")]
        try:
            for r in replicas:
                r.start()
            for r in replicas:
                wait_ready(r.url, r.proc, READY_S)
            want = reference(replicas[0].url, pool)
            wait_until(lambda: claim_keys(redis_url) == 0, 30, "the reference's claims lapse", interval_s=0.2)
            before, claims_before = where.level(), claim_keys(redis_url)
            load = Soak([r.url for r in replicas], pool, want, seed=a.seed)
            kills = Kills(replicas[1], a.kills, rng, a.gap_s, a.starting_share, load.in_flight, Counter())
            max_s = a.max_s or 60.0 + a.kills * (a.gap_s + 60.0)
            locust = run_load(load, a.clients, kills.run, max_s)
            counts = {**kills.counts, **load.counts, **locust, **settled(where, before, redis_url, claims_before)}
        finally:
            for r in replicas:
                r.stop()
    for name, n in counts.items():
        print(f"{name:52s} {n}")
    for kind, n in load.errors.most_common(8):
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--clients", type=int, default=4, help="Locust users (prefill workers)")
    parser.add_argument("--images", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gap-s", type=float, default=6.0, help="longest time from ready to the next kill")
    parser.add_argument("--starting-share", type=float, default=0.15, help="share of kills aimed at a start")
    parser.add_argument("--max-s", type=float, default=0.0, help="bound on the load (0: from --kills)")
    parser.add_argument("--logs", type=Path, help="folder of the replicas' logs (default: a new one)")
    parser.add_argument("--json", type=Path, help="also write the counts here")
    return parser.parse_args(argv)


def main() -> None:
    a = parse_args()
    started = time.monotonic()
    counts: dict[str, Any] = soak(a)
    print(f"{'seconds':52s} {time.monotonic() - started:.0f}")
    if a.json:
        a.json.write_text(json.dumps(counts, indent=1))


if __name__ == "__main__":
    main()
