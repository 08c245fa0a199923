"""A bounded Locust load of prefill-like users, for the kill-and-restart soak (``bench/bench_kill_soak.py``).

A task is a prefill worker's path for one image on one replica: the connector's look-up by hash (pinned;
rows over shared memory when ready), an encode that waits, the rows over HTTP, and over shared memory too
when the look-up had none. A retryable error sends the same steps to the other replica. Every row is
compared with the rows of a run without faults.

The visenc client drives every step, as the connector does. Importing Locust patches the process with
gevent first (its sockets, locks, threads and sleeps are cooperative), so the process that runs this load
must import nothing that opens a socket or makes a lock before it: ``bench_kill_soak.py`` patches first.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import gevent
import numpy as np
from loadtest.users import record
from locust import User, constant, task
from locust.env import Environment

from visenc_client import (
    Client,
    DeadlineError,
    Handle,
    OverloadedError,
    ProtocolError,
    TransportError,
    UnavailableError,
    VisencClientError,
)
from visenc_client.format import image_hash

T = TypeVar("T")
#: what a client meets when a replica is killed or starting: it tries again, on the other replica
RETRYABLE = (TransportError, UnavailableError, OverloadedError, DeadlineError, ProtocolError)
TRIES = 8
#: a new image this share of the time while any is left (it is encoded during the kills), else a hit
FRESH_SHARE = 0.25
#: seconds the users get to finish their request once the load stops
STOP_TIMEOUT_S = 60.0


@dataclass
class Soak:
    """What the users share: the replicas, the images, their rows from a run without faults, and the counts.
    The users are greenlets of one thread: nothing here is changed across a switch."""

    urls: list[str]
    images: list[bytes]
    want: dict[int, np.ndarray]
    seed: int = 0
    counts: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    #: requests now on each replica (a kill reads its victim's)
    in_flight: Counter[str] = field(default_factory=Counter)
    fresh: int = 0
    users: int = 0

    def pick(self, rng: random.Random) -> int:
        if self.fresh == 0 or (self.fresh < len(self.images) and rng.random() < FRESH_SHARE):
            self.fresh += 1
            return self.fresh - 1
        return rng.randrange(self.fresh)

    def add(self, what: str, error: BaseException | None = None) -> None:
        self.counts[what] += 1
        if error is not None:
            self.errors[f"{type(error).__name__}: {str(error)[:70]}"] += 1

    def answered(self, i: int, found: str, rows: list[np.ndarray], attempt: int) -> None:
        right = all(np.array_equal(r, self.want[i]) for r in rows)
        self.add("rows right" if right else "rows wrong")
        self.counts["row copies compared"] += len(rows)
        self.add(found)
        self.add("answered at once" if attempt == 0 else "answered on a retry")


class SoakUser(User):
    """One prefill worker: a client per replica over HTTP and one over shared memory."""

    abstract = True
    soak: ClassVar[Soak]
    wait_time = constant(0.02)

    def on_start(self) -> None:
        self.soak.users += 1
        self.rng = random.Random(self.soak.seed * 1000 + self.soak.users)
        self.clients = {
            url: (Client(url, timeout=30), Client(url, shared_memory=True, timeout=30)) for url in self.soak.urls
        }

    def on_stop(self) -> None:
        for pair in self.clients.values():
            for c in pair:
                c.close()

    @task
    def prefill(self) -> None:
        s = self.soak
        i = s.pick(self.rng)
        order = self.rng.sample(s.urls, len(s.urls))
        for attempt in range(TRIES):
            try:
                found, rows = self.one_image(order[attempt % len(order)], s.images[i])
            except RETRYABLE as e:
                s.add("retryable error", e)
                gevent.sleep(0.1 * (attempt + 1))  # then the other replica
                continue
            except VisencClientError as e:
                s.add("unclear error", e)
                return
            s.answered(i, found, rows, attempt)
            return
        s.add("no rows after retries")

    def one_image(self, url: str, data: bytes) -> tuple[str, list[np.ndarray]]:
        s = self.soak
        s.in_flight[url] += 1
        s.counts["most requests in flight at once"] = max(
            s.counts["most requests in flight at once"], s.in_flight.total()
        )
        try:
            return self.steps(*self.clients[url], data)
        finally:
            s.in_flight[url] -= 1

    def steps(self, vc: Client, shm: Client, data: bytes) -> tuple[str, list[np.ndarray]]:
        h = image_hash(data)
        looked = self.step("look-up", "connector", lambda: shm.lookup([h], include_rows=shm.rows.rows_with_lookup))
        known: Handle = looked[0]
        rows = []
        if known.status == "ready":
            rows.append(known.rows if known.rows is not None else self.step("fetch", "shm", lambda: shm.fetch(known)))
        (handle,) = self.step("encode", "wait", lambda: vc.encode([data]))
        rows.append(self.step("fetch", "http", lambda: vc.fetch(handle)))
        if known.status != "ready":
            rows.append(self.step("fetch", "shm", lambda: shm.fetch(handle)))
        return f"look-up found it {known.status}", rows

    def step(self, kind: str, name: str, call: Callable[[], T]) -> T:
        """One request, in Locust's statistics (a failure by its error)."""
        t0 = time.perf_counter()
        try:
            out = call()
        except VisencClientError as e:
            record(self.environment, kind, name, (time.perf_counter() - t0) * 1000.0, exception=e)
            raise
        record(self.environment, kind, name, (time.perf_counter() - t0) * 1000.0)
        return out


def run_load(soak: Soak, users: int, during: Callable[[], Any], max_s: float) -> dict[str, int]:
    """``users`` SoakUsers while ``during()`` runs (the kills), ``max_s`` at most; then the users finish
    their request and stop. Returns Locust's counts of requests and failures, by step."""
    user_class = type("SoakUser", (SoakUser,), {"soak": soak, "abstract": False})
    env = Environment(user_classes=[user_class], stop_timeout=STOP_TIMEOUT_S)
    runner = env.create_local_runner()
    runner.start(users, spawn_rate=users)
    bounded = gevent.Timeout(max_s)
    bounded.start()
    try:
        during()
    except gevent.Timeout as t:
        if t is not bounded:
            raise
        soak.counts["stopped by the time bound"] += 1
    finally:
        bounded.close()
        runner.quit()
    counts = {"users": runner.target_user_count, "user exceptions": sum(e["count"] for e in runner.exceptions.values())}
    for e in runner.exceptions.values():
        print(f"user exception {e['count']}x: {e['msg']}\n{e['traceback']}")
    for entry in sorted(env.stats.entries.values(), key=lambda e: (e.method, e.name)):
        counts[f"locust {entry.method} {entry.name}: requests"] = entry.num_requests
        counts[f"locust {entry.method} {entry.name}: failures"] = entry.num_failures
    return counts
