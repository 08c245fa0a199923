"""Cross-replica encode claims, stored in Redis beside the entries.

A claim key wraps its whole entry key in a hash tag, ``{visenc:ns:fp:hash}:claim``,
so on Redis Cluster it lives in the *same slot* as its entry and one Lua script
can read the entry and take the claim atomically; the scripts of one call are
pipelined (one round trip for all of a request's new images; on a cluster, one
concurrent call per key). Every method
answers ``None`` (or nothing) while Redis is unavailable: see ``redis_conn.py``.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from typing import Any

from redis.exceptions import NoScriptError, ResponseError

from visenc.index.redis_conn import RedisConnection
from visenc.index.redis_store import RedisStore
from visenc_client.format import Entry

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


def claim_key(key: str) -> str:
    """The claim key of an entry key: same Redis Cluster slot (hash tag = the entry key)."""
    return f"{{{key}}}:claim"


class RedisClaims:
    def __init__(self, store: RedisStore) -> None:
        self.store = store  # decodes an entry a claim script returns
        self.conn: RedisConnection = store.conn

    async def _scripts(
        self, op: str, script: str, keys: Sequence[tuple[str, ...]], args: tuple[Any, ...]
    ) -> list[Any] | None:
        """Run ``script`` once per key tuple, pipelined, by its SHA1 (``EVALSHA``: the script text is not
        resent every time); a Redis whose script cache lacks it (new, restarted, flushed) gets it loaded
        once (``SCRIPT LOAD``, on every primary of a cluster) and the pipeline is sent again."""
        sha = hashlib.sha1(script.encode()).hexdigest()

        async def send() -> list[Any]:
            client = self.conn.client
            if self.conn.cluster:  # redis-py refuses EVALSHA in cluster pipelines: concurrent calls, one per slot owner
                return list(await asyncio.gather(*(client.evalsha(sha, len(ks), *ks, *args) for ks in keys)))
            pipe = client.pipeline(transaction=False)
            for ks in keys:
                pipe.evalsha(sha, len(ks), *ks, *args)
            return list(await pipe.execute())

        async def call() -> list[Any]:
            try:
                return await send()
            except ResponseError as e:  # NoScriptError, or a cluster pipeline's wrapping of it
                if not isinstance(e, NoScriptError) and "NOSCRIPT" not in str(e) and "No matching script" not in str(e):
                    raise
                await self.conn.client.script_load(script)
                return await send()

        return await self.conn.run(op, call) if keys else []

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
                entry = self.store.decode(key, reply)
                out.append(True if entry is None else entry)
            else:
                out.append(bool(reply))
        return out

    async def claims_held(self, keys: Sequence[str]) -> list[bool] | None:
        """Whether some replica holds the claim on each key (read-only; ``None`` if Redis is unavailable)."""

        async def call() -> list[Any]:
            pipe = self.conn.client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(claim_key(k))
            return list(await pipe.execute())

        replies = await self.conn.run("claims_held", call) if keys else []
        return None if replies is None else [bool(r) for r in replies]

    async def renew_claims(self, keys: Sequence[str], token: str, ttl_ms: int) -> None:
        """Extend the claims on ``keys`` that are still held by ``token``."""
        await self._scripts("renew", RENEW_SCRIPT, [(claim_key(k),) for k in keys], (token, ttl_ms))

    async def release_claims(self, keys: Sequence[str], token: str) -> None:
        """Drop the claims on ``keys`` that are still held by ``token``."""
        await self._scripts("release", RELEASE_SCRIPT, [(claim_key(k),) for k in keys], (token,))
