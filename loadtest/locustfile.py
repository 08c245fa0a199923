"""Locust scenarios that look like prefill-worker traffic against visenc (the shared request flow:
``users.py``)."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path
from typing import Any

from locust import events, tag, task

if __package__ in (None, ""):  # run by `locust -f loadtest/locustfile.py`: make `loadtest.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loadtest.payloads import DEFAULT_STAGES
from loadtest.tenants import FloodTenantUser, InteractiveTenantUser  # noqa: F401  (the tenants scenario)
from loadtest.users import Image, VisencUser, log

__all__ = ["SCENARIOS", "VisencUser"]

SCENARIOS = ("agent", "probe", "cold", "hot", "mixed", "tenants")
_SHOWN = {"include_in_web_ui": True}
#: the scenario options, as ``parser.add_argument`` takes them
OPTIONS: list[tuple[str, dict[str, Any]]] = [
    (
        "--scenario",
        {
            **_SHOWN,
            "choices": SCENARIOS,
            "default": None,
            "help": "User class to run (default: every class left after --tags / class names).",
        },
    ),
    (
        "--image-size",
        {**_SHOWN, "default": "1280x720", "help": "WIDTHxHEIGHT of generated screenshots (CPU runs: e.g. 320x180)."},
    ),
    (
        "--chunk-tokens",
        {**_SHOWN, "type": int, "default": 512, "help": "Token rows per prefill chunk (one fetch request each)."},
    ),
    (
        "--fetch-mode",
        {
            **_SHOWN,
            "choices": ("batch", "get"),
            "default": "batch",
            "help": "Fetch a chunk with one POST /v1/embeddings/fetch, or one GET per image range.",
        },
    ),
    (
        "--agent-turns",
        {**_SHOWN, "type": int, "default": 8, "help": "Turns of one agent conversation before it starts a new one."},
    ),
    (
        "--agent-fetch",
        {
            **_SHOWN,
            "choices": ("all", "new"),
            "default": "all",
            "help": "Fetch every image's rows each turn (no prefix cache) or only the new image's.",
        },
    ),
    ("--probe-max", {**_SHOWN, "type": int, "default": 8, "help": "The probe cycles through requests of 1..N images."}),
    (
        "--images-per-request",
        {**_SHOWN, "type": int, "default": 4, "help": "Images per request of the cold, hot and mixed scenarios."},
    ),
    (
        "--hit-ratio",
        {
            **_SHOWN,
            "type": float,
            "default": 0.5,
            "help": "mixed: probability that an image comes from the cached pool.",
        },
    ),
    (
        "--hot-pool",
        {**_SHOWN, "type": int, "default": 16, "help": "Images in the shared pool that hot and mixed warm at start."},
    ),
    (
        "--upload",
        {
            **_SHOWN,
            "choices": ("hash-first", "bytes"),
            "default": "hash-first",
            "help": "Send hashes first, or bytes with every item.",
        },
    ),
    (
        "--encode-wait",
        {
            "action": "store_true",
            "default": False,
            "help": "Encode with wait=true (the answer comes when every image is encoded).",
        },
    ),
    (
        "--think-time",
        {**_SHOWN, "type": float, "default": 0.2, "help": "Seconds a user pauses between requests (turns)."},
    ),
    (
        "--run-id",
        {
            "default": uuid.uuid4().hex[:12],
            "help": "Salt of every generated image: the same id regenerates the same images.",
        },
    ),
    (
        "--stages",
        {
            "default": DEFAULT_STAGES,
            "help": "StagedShape (loadtest/shapes.py): END_S:USERS:SPAWN_RATE, comma-separated.",
        },
    ),
]


@events.init_command_line_parser.add_listener
def _add_arguments(parser: Any) -> None:
    for flag, options in OPTIONS:
        parser.add_argument(flag, **options)


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


class AgentUser(VisencUser):
    """A multi-turn agent: one new screenshot a turn, the earlier ones resent by hash."""

    scenario = "agent"

    def on_start(self) -> None:
        super().on_start()
        self.conversation: list[Image] = []

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
