"""Rows reach their caller whatever the budgets, in-process with the real app:

- one request whose rows are 1.5x L1, answered ``ready``: every image is fetched (pinned until read);
  with leases that lapse at once two of them are gone (the check can fail);
- a shared-memory pass larger than the segment budget: every range arrives, the ones that did not fit
  over HTTP, counted and said once in the log;
- ``include_rows`` look-ups answer a rows frame read into arrays of their own, equal to the fetch;
- ``/v1/model`` names a probe segment a client on this host reads: ``shared_memory="auto"`` picks
  shared memory here and HTTP where the probe is not readable.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from harness.images import png_bytes
from tests.support.api import running_app

from visenc_client import AsyncClient, RowRange, image_hash
from visenc_client._shm import same_host

SIZE = (64, 64)
#: the tower's largest image (its most rows): an L1 of a few of them starts
LARGE = (896, 1120)


def images(seed: int, n: int, size: tuple[int, int] = SIZE) -> list[bytes]:
    return [png_bytes(seed + i, *size) for i in range(n)]


def entry_bytes(tower: Any, size: tuple[int, int] = SIZE) -> int:
    return tower.layout(*size).num_tokens * tower.hidden_size * 4 + 256


def client(app: Any, **options: Any) -> AsyncClient:
    return AsyncClient("http://visenc", transport=httpx.ASGITransport(app=app), **options)


async def test_one_request_over_the_cache_is_fetched_whole(tiny_tower: Any) -> None:
    pngs = images(900, 6, LARGE)
    async with running_app(tiny_tower, cache_bytes=4 * entry_bytes(tiny_tower, LARGE)) as service:
        async with client(service.app) as vc:
            handles = await vc.encode(pngs)
            assert [h.status for h in handles] == ["ready"] * 6
            rows = [await vc.fetch(h) for h in handles]
            assert all(r.shape == (h.num_tokens, h.hidden_size) for r, h in zip(rows, handles))
            health = (await service.get("/readyz")).json()["index"]
            assert health["pinned_bytes"] == 0 and health["bytes"] <= health["max_bytes"]  # read: released


async def test_without_pins_the_requests_own_images_evict_each_other(tiny_tower: Any) -> None:
    pngs = images(920, 6, LARGE)
    async with running_app(tiny_tower, cache_bytes=4 * entry_bytes(tiny_tower, LARGE), ready_lease_s=1e-9) as service:
        async with client(service.app) as vc:
            handles = await vc.encode(pngs)
            assert [h.status for h in handles] == ["ready"] * 6
            answers = [(await service.get(f"/v1/embeddings/{h.hash}")).status_code for h in handles]
            assert answers.count(404) == 2, answers


async def test_a_shared_memory_pass_over_its_budget_reads_the_rest_over_http(
    tiny_tower: Any, tmp_path: Path, caplog: Any
) -> None:
    pngs = images(940, 8)
    budget = int(2.5 * entry_bytes(tiny_tower))
    async with running_app(tiny_tower, shm_dir=str(tmp_path), shm_max_bytes=budget, shm_lease_s=60) as service:
        async with client(service.app) as http, client(service.app, shared_memory=True) as shm:
            handles = await http.encode(pngs)
            want = [await http.fetch(h) for h in handles]
            with caplog.at_level(logging.WARNING, logger="visenc_client"):
                got = [await shm.fetch(h) for h in handles]
                again = await shm.fetch_many([RowRange(h.hash) for h in handles])
            for a, b, c in zip(want, got, again):
                np.testing.assert_array_equal(a, b)
                np.testing.assert_array_equal(a, c)
            assert shm.shm_http_fallbacks >= len(pngs) - 2
            said = [r for r in caplog.records if "shared-memory budget is full" in r.getMessage()]
            assert len(said) == 1


async def test_include_rows_answers_a_frame_of_owned_arrays(tiny_tower: Any) -> None:
    pngs = images(960, 3)
    async with running_app(tiny_tower) as service:
        async with client(service.app) as vc:
            handles = await vc.encode(pngs)
            looked = await vc.lookup([h.hash for h in handles] + ["0" * 64], wait=True, include_rows=True)
            assert [h.status for h in looked] == ["ready"] * 3 + ["missing"]
            for h, seen in zip(handles, looked):
                assert seen.rows is not None and seen.rows.flags.owndata and seen.rows.flags.writeable
                np.testing.assert_array_equal(seen.rows, await vc.fetch(h))
            assert looked[3].rows is None
            plain = await service.post(
                "/v1/encode",
                json={"items": [{"hash": image_hash(pngs[0])}], "wait": True, "include_rows": True},
            )
            assert plain.headers["content-type"].startswith("application/json")  # no frame unless accepted


async def test_a_client_on_this_host_finds_the_probe(tiny_tower: Any, tmp_path: Path) -> None:
    async with running_app(tiny_tower, shm_dir=str(tmp_path)) as service:
        info = (await service.get("/v1/model")).json()
        assert same_host(info)
        assert not same_host({**info, "shm": {**info["shm"], "token": "0" * 32}})  # another host's probe
        assert not same_host({k: v for k, v in info.items() if k != "shm"})
        async with client(service.app, shared_memory="auto") as vc:
            (h,) = await vc.encode(images(980, 1))
            await vc.fetch(h)
            assert vc.shared_memory
    async with running_app(tiny_tower, shm_enabled=False) as service:
        assert "shm" not in (await service.get("/v1/model")).json()
        async with client(service.app, shared_memory="auto") as vc:
            (h,) = await vc.encode(images(981, 1))
            await vc.fetch(h)
            assert not vc.shared_memory
