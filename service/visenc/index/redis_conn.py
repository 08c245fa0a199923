"""One Redis connection (standalone or cluster) and its failure policy, shared by the entry store and the claims."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ClusterError, OutOfMemoryError, ReadOnlyError, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.utils import HIREDIS_AVAILABLE

from visenc.config import Settings
from visenc.errors import VisencError
from visenc.metrics import Metrics

log = logging.getLogger(__name__)
T = TypeVar("T")

#: errors that mean "Redis is unreachable or failing over": skip it for a while
_OUTAGE = (RedisConnectionError, RedisTimeoutError, ClusterError, OSError, asyncio.TimeoutError)
#: error replies that are the server's state, not a bug: counted as failed operations
_STATE_REPLIES = ("BUSY", "MASTERDOWN", "MISCONF", "NOREPLICAS", "LOADING", "TRYAGAIN", "CLUSTERDOWN")


def is_bug(error: BaseException) -> bool:
    if not isinstance(error, ResponseError) or isinstance(error, (OutOfMemoryError, ReadOnlyError)):
        return False
    return not str(error).startswith(_STATE_REPLIES)


def redacted_location(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return f"unix://{parts.path}"
    host = parts.hostname or "localhost"
    return f"{parts.scheme}://{host}:{parts.port or 6379}{parts.path}"


class RedisConnection:
    tier = "redis"

    def __init__(
        self,
        client: Redis | RedisCluster,
        *,
        retry_after_s: float,
        metrics: Metrics,
        mode: str = "standalone",
        location: str = "",
    ) -> None:
        self.client = client
        self.retry_after_s = retry_after_s
        self.mode = mode
        self.location = location
        self.metrics = metrics
        self._down_until = 0.0
        self._up = True
        self.errors = 0

    @classmethod
    def from_settings(cls, settings: Settings, metrics: Metrics) -> RedisConnection:
        assert settings.redis_url is not None
        url = settings.redis_url.get_secret_value()
        if not HIREDIS_AVAILABLE:  # ~10x slower on multi-MiB values; still correct
            log.warning("hiredis is not installed: Redis replies are parsed in pure Python")
        options: dict[str, Any] = {
            "socket_timeout": settings.redis_timeout_s,
            "socket_connect_timeout": settings.redis_timeout_s,
            # one immediate retry replaces a pooled connection a Redis restart broke; an outage skips Redis instead
            "retry": Retry(NoBackoff(), 1),
        }
        client: Redis | RedisCluster
        if settings.redis_mode == "cluster":
            client = RedisCluster.from_url(url, **options)
        else:
            client = Redis.from_url(url, health_check_interval=30, **options)
        return cls(
            client,
            retry_after_s=settings.redis_retry_s,
            metrics=metrics,
            mode=settings.redis_mode,
            location=redacted_location(url),
        )

    @property
    def up(self) -> bool:
        return self._up

    @property
    def cluster(self) -> bool:
        return isinstance(self.client, RedisCluster)

    async def run(self, op: str, call: Callable[[], Awaitable[T]]) -> T | None:
        """Run one Redis operation; ``None`` if Redis is skipped or the operation failed (counted)."""
        if not self._up and time.monotonic() < self._down_until:
            return None
        try:
            result = await call()
        except (RedisError, *_OUTAGE) as e:
            if is_bug(e):
                self.metrics.redis_script_errors.labels(op).inc()
                log.error("redis %s answered %s with an error (a bug, not an outage)", self.location, op, exc_info=e)
                raise VisencError(f"the shared index failed on {op}") from e
            self.errors += 1
            self.metrics.redis_errors.labels(op).inc()
            if isinstance(e, _OUTAGE):
                self._down_until = time.monotonic() + self.retry_after_s
                if self._up:
                    log.warning(
                        "redis %s unavailable (%s: %s); skipping it for %.1f s",
                        self.location,
                        type(e).__name__,
                        e,
                        self.retry_after_s,
                    )
                    self._up = False
            else:
                log.warning("redis %s failed on %s: %s: %s", self.location, op, type(e).__name__, e)
            return None
        if not self._up:
            log.warning("redis %s is back", self.location)
            self._up = True
        return result

    async def close(self) -> None:
        await self.client.aclose()

    def health(self) -> dict[str, object]:
        return {"tier": self.tier, "ok": self._up, "mode": self.mode, "location": self.location, "errors": self.errors}
