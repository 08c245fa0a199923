"""Redis: the shared tier (L2) every replica reads and writes.

Values are exactly the stored format of ``index/format.py`` (versioned header,
rows from ``DATA_OFFSET``), so a client can read a chunk's rows with one
``GETRANGE``. Contracts:

* **Atomic writes.** An entry is one ``SET key value EX ttl``: a reader sees the
  whole value or none. ``cache_ttl_s`` bounds how long an entry lives; Redis'
  ``maxmemory-policy allkeys-lru`` evicts earlier under memory pressure.
* **Nothing wrong is served.** A value read back is checked against its header
  and against the key it was read under (fingerprint, image hash, length):
  a corrupt, truncated or mismatched value is a miss, counted as ``corrupt``.
* **One round trip per lookup.** ``get_many`` is one ``MGET`` (standalone) or one
  ``MGET`` per slot, pipelined to every node at once (cluster).
* **Outages degrade, never fail.** A connection error or timeout is counted
  (``visenc_redis_errors{op}``), turns ``health()["ok"]`` (``visenc_index_up{tier="redis"}``)
  to false and makes Redis
  be *skipped* for ``redis_retry_s``: lookups miss at once, writes are dropped,
  so no request waits on a dead server. The next call after that tries again,
  so a restarted Redis is used again without restarting the service. Each
  command has socket timeouts (``redis_timeout_s``) and one immediate retry
  (a pooled connection broken by a Redis restart is replaced transparently).

Cross-replica claims (see ``engine/claims.py``) live here too, because they are
Redis scripts over the same keys: a claim key shares its entry's cluster slot
(``keys.claim_key``), so "is the entry there, else take the claim" is one
atomic script, pipelined for all of a request's new images.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ClusterError, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.utils import HIREDIS_AVAILABLE

from visenc.config import Settings
from visenc.index.base import Index
from visenc.index.format import CorruptEntry, Entry, unpack_entry
from visenc.index.keys import claim_key, split_key
from visenc.metrics import Metrics

log = logging.getLogger(__name__)
T = TypeVar("T")

#: KEYS = (entry, claim), ARGV = (token, ttl_ms). Returns the entry's value if it
#: exists; else 1 if the claim is (now) ours, taking it when free; else 0.
CLAIM_SCRIPT = """
local v = redis.call('GET', KEYS[1])
if v then return v end
local owner = redis.call('GET', KEYS[2])
if not owner then
  redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
  return 1
end
if owner == ARGV[1] then return 1 end
return 0
"""
#: KEYS = (claim,), ARGV = (token, ttl_ms): extend the claim if it is still ours.
RENEW_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
#: KEYS = (claim,), ARGV = (token,): delete the claim if it is still ours.
RELEASE_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

#: errors that mean "Redis is unreachable or failing over": skip it for a while
_OUTAGE = (RedisConnectionError, RedisTimeoutError, ClusterError, OSError, asyncio.TimeoutError)


def redacted_location(url: str) -> str:
    """``scheme://host:port/db`` of a Redis URL, without user or password (safe to log)."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return f"unix://{parts.path}"
    host = parts.hostname or "localhost"
    return f"{parts.scheme}://{host}:{parts.port or 6379}{parts.path}"


class RedisIndex(Index):
    """The Redis tier alone: no in-process copy (``peek`` always misses); see ``TieredIndex``."""

    tier = "redis"

    def __init__(self, client: Redis | RedisCluster, *, ttl_s: int, retry_after_s: float,
                 metrics: Metrics | None = None, mode: str = "standalone", location: str = "") -> None:
        self.client = client
        self.ttl_s = ttl_s
        self.retry_after_s = retry_after_s
        self.mode = mode
        self.location = location
        self._metrics = metrics
        self._down_until = 0.0
        self._up = True
        self.errors = 0

    @classmethod
    def from_settings(cls, settings: Settings, metrics: Metrics | None = None) -> RedisIndex:
        assert settings.redis_url is not None
        url = settings.redis_url.get_secret_value()
        if not HIREDIS_AVAILABLE:  # ~10x slower on multi-MiB values; still correct
            log.warning("hiredis is not installed: Redis replies are parsed in pure Python")
        options: dict[str, Any] = {
            "socket_timeout": settings.redis_timeout_s,
            "socket_connect_timeout": settings.redis_timeout_s,
            # one immediate retry: replaces a pooled connection a Redis restart broke; no backoff
            # sleeps on the request path (an outage is handled by skipping Redis, below)
            "retry": Retry(NoBackoff(), 1),
        }
        client: Redis | RedisCluster
        if settings.redis_mode == "cluster":
            client = RedisCluster.from_url(url, **options)
        else:
            client = Redis.from_url(url, health_check_interval=30, **options)
        return cls(client, ttl_s=settings.cache_ttl_s, retry_after_s=settings.redis_retry_s, metrics=metrics,
                   mode=settings.redis_mode, location=redacted_location(url))

    # --- failure policy ------------------------------------------------------------
    @property
    def up(self) -> bool:
        """False while Redis is skipped after a failure."""
        return self._up

    async def _run(self, op: str, call: Callable[[], Awaitable[T]]) -> T | None:
        """Run one Redis operation; ``None`` if Redis is skipped or the operation failed (counted)."""
        if not self._up and time.monotonic() < self._down_until:
            return None
        try:
            result = await call()
        except (RedisError, *_OUTAGE) as e:
            self.errors += 1
            if self._metrics is not None:
                self._metrics.redis_errors.labels(op).inc()
            if isinstance(e, _OUTAGE):
                self._down_until = time.monotonic() + self.retry_after_s
                if self._up:
                    log.warning("redis %s unavailable (%s: %s); skipping it for %.1f s", self.location,
                                type(e).__name__, e, self.retry_after_s)
                    self._up = False
            else:
                log.warning("redis %s failed on %s: %s: %s", self.location, op, type(e).__name__, e)
            return None
        if not self._up:
            log.warning("redis %s is back", self.location)
            self._up = True
        return result

    # --- values ----------------------------------------------------------------------
    def _decode(self, key: str, value: bytes | None) -> Entry | None:
        """A value read under ``key`` as an entry; ``None`` (counted) when absent or not trustworthy."""
        m = self._metrics
        if value is None:
            if m is not None:
                m.cache_lookups.labels(self.tier, "miss").inc()
            return None
        _, fingerprint, image_hash = split_key(key)
        try:
            entry = unpack_entry(value, fingerprint=fingerprint, hash=image_hash)
        except CorruptEntry as e:
            log.warning("ignoring a corrupt redis value under %s: %s", key, e)
            if m is not None:
                m.cache_lookups.labels(self.tier, "corrupt").inc()
            return None
        if m is not None:
            m.cache_lookups.labels(self.tier, "hit").inc()
            m.bytes_index.labels(self.tier, "read").inc(len(value))
        return entry

    async def get_many(self, keys: Sequence[str]) -> list[Entry | None]:
        if not keys:
            return []
        client = self.client
        if isinstance(client, RedisCluster):
            values = await self._run("get", lambda: client.mget_nonatomic(list(keys)))
        else:
            values = await self._run("get", lambda: client.mget(list(keys)))
        if values is None:
            if self._metrics is not None:
                self._metrics.cache_lookups.labels(self.tier, "error").inc(len(keys))
            return [None] * len(keys)
        return [self._decode(k, v) for k, v in zip(keys, values)]

    def peek(self, key: str) -> Entry | None:
        return None

    def store_local(self, key: str, entry: Entry) -> None:
        pass

    async def write_remote(self, key: str, entry: Entry) -> None:
        """One ``SET key value EX ttl``: atomic, so a reader sees all of the value or none of it."""
        done = await self._run("set", lambda: self.client.set(key, memoryview(entry.blob), ex=self.ttl_s))
        if done and self._metrics is not None:
            self._metrics.bytes_index.labels(self.tier, "write").inc(entry.nbytes)

    # --- cross-replica claims ------------------------------------------------------------
    async def _scripts(self, op: str, script: str, keys: Sequence[tuple[str, ...]],
                       args: tuple[Any, ...]) -> list[Any] | None:
        async def call() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for ks in keys:
                pipe.eval(script, len(ks), *ks, *args)
            return list(await pipe.execute())

        return await self._run(op, call) if keys else []

    async def claim_many(self, keys: Sequence[str], token: str, ttl_ms: int) -> list[Entry | bool] | None:
        """For each key, one of: its entry (already encoded), ``True`` (the claim is ours: encode it
        here), ``False`` (another owner holds the claim: wait). One pipelined round trip; ``None`` if
        Redis is unavailable. A corrupt stored value answers ``True`` (encode and overwrite it)."""
        replies = await self._scripts("claim", CLAIM_SCRIPT, [(k, claim_key(k)) for k in keys], (token, ttl_ms))
        if replies is None:
            return None
        out: list[Entry | bool] = []
        for key, reply in zip(keys, replies):
            if isinstance(reply, bytes):
                entry = self._decode(key, reply)
                out.append(True if entry is None else entry)
            else:
                out.append(bool(reply))
        return out

    async def claims_held(self, keys: Sequence[str]) -> list[bool] | None:
        """Whether some replica holds the claim on each key (read-only; ``None`` if Redis is unavailable)."""
        async def call() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(claim_key(k))
            return list(await pipe.execute())

        replies = await self._run("claims_held", call) if keys else []
        return None if replies is None else [bool(r) for r in replies]

    async def renew_claims(self, keys: Sequence[str], token: str, ttl_ms: int) -> None:
        """Extend the claims on ``keys`` that are still held by ``token``."""
        await self._scripts("renew", RENEW_SCRIPT, [(claim_key(k),) for k in keys], (token, ttl_ms))

    async def release_claims(self, keys: Sequence[str], token: str) -> None:
        """Drop the claims on ``keys`` that are still held by ``token``."""
        await self._scripts("release", RELEASE_SCRIPT, [(claim_key(k),) for k in keys], (token,))

    # --- lifecycle ---------------------------------------------------------------------------
    async def close(self) -> None:
        await self.client.aclose()

    def health(self) -> dict[str, object]:
        return {"tier": self.tier, "ok": self._up, "mode": self.mode, "location": self.location,
                "errors": self.errors}
