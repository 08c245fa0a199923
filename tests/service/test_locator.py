"""One answer to "where is this image?": an encode asked for rows carries them (nothing is looked up
again), and a fetch of many ranges reads the index once for all of them."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import pytest
from harness.images import png_bytes
from harness.waits import until
from tests.support.api import running_app

from visenc.engine.fetch import Fetch
from visenc.index.redis_store import RedisStore
from visenc_client import AsyncClient, RowRange, Video
from visenc_client.format import entry_key


def client(app: Any) -> AsyncClient:
    return AsyncClient("http://visenc", transport=httpx.ASGITransport(app=app))


def frames(seed: int, n: int) -> list[bytes]:
    return [png_bytes(seed + i, 56, 56) for i in range(n)]


async def test_rows_come_with_the_encode_and_nothing_is_looked_up_again(tiny_tower: Any, monkeypatch) -> None:
    tripped: list[str] = []

    def wire(name: str):
        async def tripped_wire(*args: Any, **kwargs: Any) -> Any:
            tripped.append(name)
            raise AssertionError(f"{name} ran")

        return tripped_wire

    async with running_app(tiny_tower) as service:
        async with client(service.app) as vc:
            for name in ("lookup", "lookup_many"):
                monkeypatch.setattr(Fetch, name, wire(name))
            images = [png_bytes(1700 + i, 84, 56) for i in range(2)]
            uploaded = await vc.encode([*images, Video(frames(1800, 4))], include_rows=True)
            asked = await vc.lookup([h.hash for h in uploaded], wait=True, include_rows=True)
            assert tripped == []
            assert [h.status for h in uploaded + asked] == ["ready"] * 6
            with pytest.raises(AssertionError, match="lookup ran"):  # the control: a fetch trips the wire
                await vc.fetch(uploaded[0])
            assert tripped == ["lookup"]
            monkeypatch.undo()
            for up, again in zip(uploaded, asked):
                fetched = await vc.fetch(up)
                assert up.rows is not None and again.rows is not None
                np.testing.assert_array_equal(up.rows, fetched)
                np.testing.assert_array_equal(again.rows, fetched)
            engine = service.app.state.engine  # type: ignore[attr-defined]
            assert not any(engine.index.local.pins(k) for k in list(engine.index.local._order))


async def test_a_fetch_of_many_ranges_reads_redis_once(tiny_tower: Any, redis_url: str, monkeypatch) -> None:
    async with running_app(tiny_tower, redis_url=redis_url) as service:
        engine = service.app.state.engine  # type: ignore[attr-defined]
        async with client(service.app) as vc:
            handles = await vc.encode([png_bytes(1900 + i, 56, 84) for i in range(5)], pin=False)
            keys = [entry_key("default", engine.fingerprint, h.hash) for h in handles]

            async def written() -> bool:
                return None not in await engine.index.remote.get_many(keys)

            await until(written, what="every entry written through to Redis")
            for k in keys:
                engine.index.discard(k)
            reads: list[int] = []
            real = RedisStore.get_many

            async def counted(self: RedisStore, asked: Any) -> Any:
                reads.append(len(asked))
                return await real(self, asked)

            monkeypatch.setattr(RedisStore, "get_many", counted)
            ranges = [RowRange(h.hash, 0, h.num_tokens or 0) for h in handles] * 2
            got = await vc.fetch_many(ranges)
            assert reads == [len(handles)]  # one round trip for every range, each image once
            for h, rows in zip(handles * 2, got):
                assert rows.shape[0] == h.num_tokens
