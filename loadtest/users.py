"""The request flow every Locust scenario shares: hash-first encode, then chunk-by-chunk fetches, each
answer checked (``payloads.py``); a scenario only chooses which images each request carries."""

from __future__ import annotations

import logging
import random
import time
import uuid
from typing import Any, ClassVar

from loadtest.payloads import (
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
from locust import FastHttpUser

HEADERS = {"content-type": MSGPACK, "accept": MSGPACK}
#: every row read in this process, checked against its first read (wrong answers fail the request)
LEDGER = RowLedger()
log = logging.getLogger("visenc.loadtest")


def record(
    environment: Any, request_type: str, name: str, ms: float, length: int = 0, exception: Exception | None = None
) -> None:
    environment.events.request.fire(
        request_type=request_type, name=name, response_time=ms, response_length=length, exception=exception, context={}
    )


class Image:
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

    def new_image(self, kind: str) -> Image:
        """An image no one has sent before in this run (unique per run, user and counter)."""
        self.counter += 1
        return Image(derive_seed(self.opts.run_id, kind, self.user_key, self.counter), self.size)

    def pool_image(self, i: int) -> Image:
        """Image ``i`` of the pool every user of the run shares (same seed, same bytes)."""
        return Image(derive_seed(self.opts.run_id, "pool", i), self.size)

    # --- one prefill request: encode (hash-first), then fetch chunk by chunk ----

    def _encode(self, name: str, images: list[Image], with_data: bool, allowed: frozenset[str]) -> list[dict]:
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
                record(self.environment, "server", label, ms)
        return handles

    def encode(self, images: list[Image]) -> list[dict] | None:
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
                record(self.environment, "images", "hit", 0.0)
            elif self.expect_hits:  # hot: the pool was warmed, so a miss means the index dropped it
                record(
                    self.environment,
                    "images",
                    "miss",
                    0.0,
                    exception=PayloadError("a warmed pool image answered missing (evicted? index too small)"),
                )
            else:
                record(self.environment, "images", "miss", 0.0)
        if missing:
            uploaded = self._encode("/v1/encode [upload]", [images[i] for i in missing], True, done)
            if not uploaded:
                return None
            for i, h in zip(missing, uploaded):
                handles[i] = h
        return handles

    def prefill(self, images: list[Image], fetch_from: int = 0) -> bool:
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
                record(self.environment, "TTFC", label, (time.perf_counter() - t0) * 1000.0)
        record(self.environment, "TTA", label, (time.perf_counter() - t0) * 1000.0)
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
