"""Redis: the shared entry store (L2) every replica reads and writes.

Values are exactly the stored format of ``visenc_client.format`` (versioned
header, rows from ``DATA_OFFSET``), so a client can read a chunk's rows with
one ``GETRANGE``. Contracts:

* **Atomic writes.** An entry is one ``SET key value EX ttl``: a reader sees the
  whole value or none. ``cache_ttl_s`` bounds how long an entry lives; Redis'
  ``maxmemory-policy allkeys-lru`` evicts earlier under memory pressure.
* **Nothing wrong is served.** A value read back is checked against its header
  and against the key it was read under (fingerprint, image hash, length):
  a corrupt, truncated or mismatched value is a miss, counted as ``corrupt``.
* **One round trip per batch.** ``get_many`` is one ``MGET`` (standalone) or one
  ``MGET`` per slot, pipelined to every node at once (cluster); the index asks it for
  batches bounded in bytes (``tiered.py``).
* Outages: see ``redis_conn.py``; a lookup then misses and a write is dropped.
"""

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
        """A value read some other way (a claim script) under ``key``; ``None`` when corrupt."""
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
        """One ``SET key value EX ttl``: atomic, so a reader sees all of the value or none of it.
        False (counted, never raised) when Redis is unavailable."""
        done = await self.conn.run("set", lambda: self.conn.client.set(key, memoryview(entry.blob), ex=self.ttl_s))
        if done:
            self._metrics.bytes_index.labels(self.tier, "write").inc(entry.nbytes)
        return bool(done)
