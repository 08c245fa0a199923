"""Cross-replica encode claims, stored in Redis beside the entries."""

from __future__ import annotations

import asyncio
import enum
import hashlib
from collections.abc import Sequence
from typing import Any

from redis.exceptions import NoScriptError, ResponseError

from visenc.index.redis_conn import RedisConnection
from visenc.index.redis_store import RedisStore
from visenc_client.format import Entry


class ClaimState(enum.IntEnum):
    """Where an image without an entry stands across replicas (``STATE_SCRIPT``'s codes)."""

    HELD = 0  #: another replica is encoding it (holds its claim)
    OURS = 1  #: the claim is ours: encode it here
    QUEUED = 2  #: nobody encodes it yet; some replica has it queued (marked by ``queue``)
    FREE = 3


#: KEYS = (entry, claim, queued), ARGV = (mode, token, ttl_ms): the entry's value, else a ``ClaimState`` code
STATE_SCRIPT = """
local v = redis.call('GET', KEYS[1])
if v then return v end
local owner = redis.call('GET', KEYS[2])
if owner == ARGV[2] then return 1 end
if owner then return 0 end
if ARGV[1] == 'claim' then
  redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
  return 1
end
if ARGV[1] == 'queue' then
  redis.call('SET', KEYS[3], ARGV[2], 'PX', ARGV[3])
  return 2
end
if redis.call('EXISTS', KEYS[3]) == 1 then return 2 end
return 3
"""
RENEW_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
UNCLAIM_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def claim_key(key: str) -> str:
    """The claim key of an entry key: same Redis Cluster slot (hash tag = the entry key)."""
    return f"{{{key}}}:claim"


def queued_key(key: str) -> str:
    return f"{{{key}}}:queued"


class RedisClaims:
    def __init__(self, store: RedisStore) -> None:
        self.store = store
        self.conn: RedisConnection = store.conn

    async def _scripts(
        self, op: str, script: str, keys: Sequence[tuple[str, ...]], args: tuple[Any, ...]
    ) -> list[Any] | None:
        """Run ``script`` per key tuple, pipelined by SHA1 (``EVALSHA``); loaded once where Redis lacks it."""
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

    async def states(self, keys: Sequence[str], mode: str, token: str, ttl_ms: int) -> list[Entry | ClaimState] | None:
        """For each key, its entry or its ``ClaimState`` after ``mode`` (``claim``, ``queue`` or ``look``)."""
        replies = await self._scripts(
            mode, STATE_SCRIPT, [(k, claim_key(k), queued_key(k)) for k in keys], (mode, token, ttl_ms)
        )
        if replies is None:
            return None
        out: list[Entry | ClaimState] = []
        for key, reply in zip(keys, replies):
            entry = self.store.decode(key, reply) if isinstance(reply, bytes) else None
            if entry is not None:
                out.append(entry)
            elif isinstance(reply, bytes):  # corrupt: as if absent; the claim is ours only in claim mode
                out.append(ClaimState.OURS if mode == "claim" else ClaimState.FREE)
            else:
                out.append(ClaimState(int(reply)))
        return out

    async def mark_queued(self, keys: Sequence[str], token: str, ttl_ms: int) -> None:
        """(Re)mark ``keys`` queued here for ``ttl_ms``: a fetch elsewhere waits instead of answering 404."""

        async def call() -> list[Any]:
            pipe = self.conn.client.pipeline(transaction=False)
            for k in keys:
                pipe.set(queued_key(k), token, px=ttl_ms)
            return list(await pipe.execute())

        if keys:
            await self.conn.run("queue", call)

    async def renew_claims(self, keys: Sequence[str], token: str, ttl_ms: int) -> None:
        await self._scripts("renew", RENEW_SCRIPT, [(claim_key(k),) for k in keys], (token, ttl_ms))

    async def unclaim(self, keys: Sequence[str], token: str) -> None:
        await self._scripts("unclaim", UNCLAIM_SCRIPT, [(claim_key(k),) for k in keys], (token,))
