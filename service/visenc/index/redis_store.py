"""Redis: the shared entry store (L2) every replica reads and writes."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from visenc.index.redis_conn import RedisConnection
from visenc_client.format import CorruptEntry, Entry, split_key, unpack_entry

log = logging.getLogger(__name__)


class RedisStore:
    tier = "redis"

    def __init__(self, conn: RedisConnection, *, ttl_s: int) -> None:
        self.conn = conn
        self.ttl_s = ttl_s
        self._metrics = conn.metrics

    def _decode(self, key: str, value: bytes | None) -> Entry | None:
        """A value read under ``key`` as an entry; ``None`` (counted) when absent or not trustworthy."""
        m = self._metrics
        if value is None:
            m.cache_lookups.labels(self.tier, "miss").inc()
            return None
        _, fingerprint, image_hash = split_key(key)
        try:
            entry = unpack_entry(value, fingerprint=fingerprint, hash=image_hash)
        except CorruptEntry as e:
            log.warning("ignoring a corrupt redis value under %s: %s", key, e)
            m.cache_lookups.labels(self.tier, "corrupt").inc()
            return None
        m.cache_lookups.labels(self.tier, "hit").inc()
        m.bytes_index.labels(self.tier, "read").inc(len(value))
        return entry

    def decode(self, key: str, value: bytes) -> Entry | None:
        return self._decode(key, value)

    async def get_many(self, keys: Sequence[str]) -> list[Entry | None]:
        """Entries of ``keys`` in one round trip; misses (never an exception) on an outage."""
        if not keys:
            return []
        client = self.conn.client
        if self.conn.cluster:
            values = await self.conn.run("get", lambda: client.mget_nonatomic(list(keys)))  # type: ignore[union-attr]
        else:
            values = await self.conn.run("get", lambda: client.mget(list(keys)))
        if values is None:
            self._metrics.cache_lookups.labels(self.tier, "error").inc(len(keys))
            return [None] * len(keys)
        return [self._decode(k, v) for k, v in zip(keys, values)]

    async def put(self, key: str, entry: Entry) -> bool:
        """One ``SET key value EX ttl``: atomic, so a reader sees all of the value or none of it."""
        done = await self.conn.run("set", lambda: self.conn.client.set(key, memoryview(entry.blob), ex=self.ttl_s))
        if done:
            self._metrics.bytes_index.labels(self.tier, "write").inc(entry.nbytes)
        return bool(done)
