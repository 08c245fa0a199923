"""Locust scenarios that look like prefill-worker traffic against visenc."""

from __future__ import annotations

import logging
import random
import sys
import time
import uuid
from pathlib import Path
from typing import Any, ClassVar

from locust import FastHttpUser, events, tag, task

if __package__ in (None, ""):  # run by `locust -f loadtest/locustfile.py`: make `loadtest.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loadtest.payloads import (
    DEFAULT_STAGES,
    MSGPACK,
    PayloadError,
    RowLedger,
    check_handles,
    check_rows_body,
    check_rows_get,
    derive_seed,
    encode_body,
    fetch_body,
    image_hash,
    parse_size,
    plan_chunks,
    screenshot_png,
    timing_headers,
)
from loadtest.tenants import FloodTenantUser, InteractiveTenantUser  # noqa: F401  (the tenants scenario)

SCENARIOS = ("agent", "probe", "cold", "hot", "mixed", "tenants")
HEADERS = {"content-type": MSGPACK, "accept": MSGPACK}
#: every row read in this process, checked against its first read (wrong answers fail the request)
LEDGER = RowLedger()
log = logging.getLogger("visenc.loadtest")


@events.init_command_line_parser.add_listener
def _add_arguments(parser: Any) -> None:
    parser.add_argument(
        "--scenario",
        choices=SCENARIOS,
        default=None,
        include_in_web_ui=True,
        help="User class to run (default: every class left after --tags / class names).",
    )
    parser.add_argument(
        "--image-size",
        default="1280x720",
        include_in_web_ui=True,
        help="WIDTHxHEIGHT of generated screenshots (CPU runs: e.g. 320x180).",
    )
    parser.add_argument(
        "--chunk-tokens",
        type=int,
        default=512,
        include_in_web_ui=True,
        help="Token rows per prefill chunk (one fetch request each).",
    )
    parser.add_argument(
        "--fetch-mode",
        choices=("batch", "get"),
        default="batch",
        include_in_web_ui=True,
        help="Fetch a chunk with one POST /v1/embeddings/fetch, or one GET per image range.",
    )
    parser.add_argument(
        "--agent-turns",
        type=int,
        default=8,
        include_in_web_ui=True,
        help="Turns of one agent conversation before it starts a new one.",
    )
    parser.add_argument(
        "--agent-fetch",
        choices=("all", "new"),
        default="all",
        include_in_web_ui=True,
        help="Fetch every image's rows each turn (no prefix cache) or only the new image's.",
    )
    parser.add_argument(
        "--probe-max",
        type=int,
        default=8,
        include_in_web_ui=True,
        help="The probe cycles through requests of 1..N images.",
    )
    parser.add_argument(
        "--images-per-request",
        type=int,
        default=4,
        include_in_web_ui=True,
        help="Images per request of the cold, hot and mixed scenarios.",
    )
    parser.add_argument(
        "--hit-ratio",
        type=float,
        default=0.5,
        include_in_web_ui=True,
        help="mixed: probability that an image comes from the cached pool.",
    )
    parser.add_argument(
        "--hot-pool",
        type=int,
        default=16,
        include_in_web_ui=True,
        help="Images in the shared pool that hot and mixed warm at start.",
    )
    parser.add_argument(
        "--upload",
        choices=("hash-first", "bytes"),
        default="hash-first",
        include_in_web_ui=True,
        help="Send hashes first, or bytes with every item.",
    )
    parser.add_argument(
        "--encode-wait",
        action="store_true",
        default=False,
        help="Encode with wait=true (the answer comes when every image is encoded).",
    )
    parser.add_argument(
        "--think-time",
        type=float,
        default=0.2,
        include_in_web_ui=True,
        help="Seconds a user pauses between requests (turns).",
    )
    parser.add_argument(
        "--run-id",
        default=uuid.uuid4().hex[:12],
        help="Salt of every generated image: the same id regenerates the same images.",
    )
    parser.add_argument(
        "--stages",
        default=DEFAULT_STAGES,
        help="StagedShape (loadtest/shapes.py): END_S:USERS:SPAWN_RATE, comma-separated.",
    )


@events.init.add_listener
def _select_users(environment: Any, **_: Any) -> None:
    """Keep the user class ``--scenario`` names, else those ``--tags`` / ``--exclude-tags`` select
    (Locust filters by tag only later, and would start users left without a task)."""
    options = environment.parsed_options
    if options is None:
        return
    scenario = getattr(options, "scenario", None)
    tags, excluded = set(options.tags or ()), set(options.exclude_tags or ())
    keep = [
        u
        for u in environment.user_classes
        if (u.scenario == scenario if scenario else (not tags or u.scenario in tags)) and u.scenario not in excluded
    ]
    if not keep:
        raise SystemExit(f"no user class left for scenario={scenario!r} tags={options.tags!r}")
    environment.user_classes[:] = keep


def _record(
    environment: Any, request_type: str, name: str, ms: float, length: int = 0, exception: Exception | None = None
) -> None:
    environment.events.request.fire(
        request_type=request_type, name=name, response_time=ms, response_length=length, exception=exception, context={}
    )


class _Image:
    """One generated image: bytes kept for a possible upload, hash sent first."""

    __slots__ = ("data", "hash")

    def __init__(self, seed: int, size: tuple[int, int]) -> None:
        self.data = screenshot_png(seed, *size)
        self.hash = image_hash(self.data)


class VisencUser(FastHttpUser):
    """Shared request flow; subclasses only choose which images each request carries."""

    abstract = True
    scenario: ClassVar[str] = ""
    #: a ``missing`` answer is a failure (the images were warmed)
    expect_hits: ClassVar[bool] = False
    network_timeout = 120.0
    connection_timeout = 10.0

    def on_start(self) -> None:
        o = self.environment.parsed_options
        self.opts = o
        self.size = parse_size(o.image_size)
        self.user_key = uuid.uuid4().hex
        self.counter = 0
        self.rng = random.Random(derive_seed(o.run_id, self.user_key))

    def wait_time(self) -> float:
        return float(self.opts.think_time)

    def new_image(self, kind: str) -> _Image:
        """An image no one has sent before in this run (unique per run, user and counter)."""
        self.counter += 1
        return _Image(derive_seed(self.opts.run_id, kind, self.user_key, self.counter), self.size)

    def pool_image(self, i: int) -> _Image:
        """Image ``i`` of the pool every user of the run shares (same seed, same bytes)."""
        return _Image(derive_seed(self.opts.run_id, "pool", i), self.size)

    # --- one prefill request: encode (hash-first), then fetch chunk by chunk ----

    def _encode(self, name: str, images: list[_Image], with_data: bool, allowed: frozenset[str]) -> list[dict]:
        items = [{"hash": im.hash, "data": im.data} if with_data else {"hash": im.hash} for im in images]
        wait = bool(self.opts.encode_wait)
        with self.client.post(
            "/v1/encode", data=encode_body(items, wait), headers=HEADERS, name=name, catch_response=True
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {bytes(resp.content or b'')[:200]!r}")
                return []
            try:
                handles = check_handles(resp.content, [im.hash for im in images], allowed)
            except PayloadError as e:
                resp.failure(str(e))
                return []
            for label, ms in timing_headers(resp.headers).items():
                _record(self.environment, "server", label, ms)
        return handles

    def encode(self, images: list[_Image]) -> list[dict] | None:
        """Handles of ``images`` in order (hash-first unless --upload bytes); None after a failure."""
        done = frozenset({"ready"}) if self.opts.encode_wait else frozenset({"ready", "pending"})
        if self.opts.upload == "bytes":
            handles = self._encode("/v1/encode [bytes]", images, True, done)
            return handles or None
        handles = self._encode("/v1/encode [hashes]", images, False, done | {"missing"})
        if not handles:
            return None
        missing = [i for i, h in enumerate(handles) if h["status"] == "missing"]
        for h in handles:
            if h["status"] != "missing":
                _record(self.environment, "images", "hit", 0.0)
            elif self.expect_hits:  # hot: the pool was warmed, so a miss means the index dropped it
                _record(
                    self.environment,
                    "images",
                    "miss",
                    0.0,
                    exception=PayloadError("a warmed pool image answered missing (evicted? index too small)"),
                )
            else:
                _record(self.environment, "images", "miss", 0.0)
        if missing:
            uploaded = self._encode("/v1/encode [upload]", [images[i] for i in missing], True, done)
            if not uploaded:
                return None
            for i, h in zip(missing, uploaded):
                handles[i] = h
        return handles

    def prefill(self, images: list[_Image], fetch_from: int = 0) -> bool:
        """Encode ``images``, then fetch the rows of ``images[fetch_from:]`` chunk by chunk, as a prefill
        worker would; records TTFC and TTA. True when every step passed its checks."""
        t0 = time.perf_counter()
        handles = self.encode(images)
        if handles is None:
            return False
        fetched = handles[fetch_from:]
        label = f"n={len(images):02d}"
        for k, chunk in enumerate(plan_chunks([h["num_tokens"] for h in fetched], self.opts.chunk_tokens)):
            ranges = [(fetched[r.index]["hash"], r.start, r.end) for r in chunk]
            chunk_handles = [fetched[r.index] for r in chunk]
            if not (
                self.fetch_batch(ranges, chunk_handles)
                if self.opts.fetch_mode == "batch"
                else all(self.fetch_get(rng, h) for rng, h in zip(ranges, chunk_handles))
            ):
                return False
            if k == 0:
                _record(self.environment, "TTFC", label, (time.perf_counter() - t0) * 1000.0)
        _record(self.environment, "TTA", label, (time.perf_counter() - t0) * 1000.0)
        return True

    def fetch_batch(self, ranges: list[tuple[str, int, int]], handles: list[dict]) -> bool:
        """One chunk's ranges in one ``POST /v1/embeddings/fetch``."""
        with self.client.post(
            "/v1/embeddings/fetch",
            data=fetch_body(ranges),
            headers=HEADERS,
            name="/v1/embeddings/fetch [chunk]",
            catch_response=True,
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {bytes(resp.content or b'')[:200]!r}")
                return False
            try:
                check_rows_body(resp.content, ranges, handles, LEDGER)
            except PayloadError as e:
                resp.failure(str(e))
                return False
        return True

    def fetch_get(self, rng: tuple[str, int, int], handle: dict) -> bool:
        """One image's part of a chunk with ``GET /v1/embeddings/{hash}?start=&end=``."""
        h, start, end = rng
        with self.client.get(
            f"/v1/embeddings/{h}?start={start}&end={end}", name="/v1/embeddings/{hash}", catch_response=True
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {bytes(resp.content or b'')[:200]!r}")
                return False
            try:
                check_rows_get(resp.headers, resp.content, start, end, handle, LEDGER)
            except PayloadError as e:
                resp.failure(str(e))
                return False
        return True


class AgentUser(VisencUser):
    """A multi-turn agent: one new screenshot a turn, the earlier ones resent by hash."""

    scenario = "agent"

    def on_start(self) -> None:
        super().on_start()
        self.conversation: list[_Image] = []

    @tag("agent")
    @task
    def turn(self) -> None:
        if len(self.conversation) >= self.opts.agent_turns:
            self.conversation = []
        self.conversation.append(self.new_image("agent"))
        fetch_from = len(self.conversation) - 1 if self.opts.agent_fetch == "new" else 0
        if not self.prefill(self.conversation, fetch_from):
            self.conversation = []  # a failed turn ends the conversation


class ProbeUser(VisencUser):
    """Requests of 1, 2, ..., --probe-max new images in turn: TTFC and TTA against N."""

    scenario = "probe"

    def on_start(self) -> None:
        super().on_start()
        self.sent = 0

    @tag("probe")
    @task
    def probe(self) -> None:
        n = self.sent % self.opts.probe_max + 1
        self.sent += 1
        self.prefill([self.new_image("probe") for _ in range(n)])


class ColdUser(VisencUser):
    """Every image is new: the encoder does all the work."""

    scenario = "cold"

    @tag("cold")
    @task
    def cold(self) -> None:
        self.prefill([self.new_image("cold") for _ in range(self.opts.images_per_request)])


class _PoolUser(VisencUser):
    abstract = True

    def on_start(self) -> None:
        super().on_start()
        self.pool = [self.pool_image(i) for i in range(self.opts.hot_pool)]
        # warm the shared pool with bytes (not counted as hits or misses); a user that finds it warm
        # already costs the service hashing only
        if not self._encode("/v1/encode [warm pool]", self.pool, True, frozenset({"ready", "pending"})):
            log.warning("warming the hot pool failed")


class HotUser(_PoolUser):
    """Every image is one the index holds: lookups and fetches only."""

    scenario = "hot"
    expect_hits = True

    @tag("hot")
    @task
    def hot(self) -> None:
        self.prefill(self.rng.sample(self.pool, min(self.opts.images_per_request, len(self.pool))))


class MixedUser(_PoolUser):
    """Each image comes from the cached pool with probability --hit-ratio, else it is new."""

    scenario = "mixed"

    @tag("mixed")
    @task
    def mixed(self) -> None:
        o = self.opts
        images = [
            self.rng.choice(self.pool) if self.rng.random() < o.hit_ratio else self.new_image("mixed")
            for _ in range(o.images_per_request)
        ]
        self.prefill(images)
