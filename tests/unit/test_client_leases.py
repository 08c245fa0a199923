"""The connector's sources (``visenc_client._sources.RowSources``) and the leases replicas hand out: a
lease taken at one replica is named only in reads of that replica. When the replica stops answering
between its look-up and the read, the rows come from the next source (another replica, or the shared
index), which never sees the lease; the first replica's pin lapses with the lease and its entry stays.
Real ``visenc serve`` subprocesses, a real ``redis-server``, a real dead port
(``tests.support.dead_ends.Switch``) and shared-memory reads.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from harness.images import png_bytes
from harness.processes import redis_process, serve_subprocess
from harness.waits import wait_until
from tests.support.dead_ends import Switch

from visenc_client import Client
from visenc_client._exceptions import VisencClientError
from visenc_client._redis import RedisRows
from visenc_client._sources import RowSources, Served, Want, torch_rows

#: the first replica's ready lease: short, so that a test sees its pin lapse
LEASE_S = 2.0
QUICK = {"timeout_s": 5.0, "connect_timeout_s": 0.5, "answer_timeout_s": 5.0}


@pytest.fixture(scope="module")
def replicas() -> Iterator[dict[str, Any]]:
    """Two replicas of the default tiny tower; the first writes to a real Redis and keeps ready
    answers for ``LEASE_S``."""
    with redis_process() as (redis_url, _):
        first_flags = ("--redis-url", redis_url, "--max-wait-ms", "1", "--ready-lease-s", str(LEASE_S))
        with serve_subprocess(*first_flags) as (first, _), serve_subprocess("--max-wait-ms", "1") as (second, _):
            with Client(first) as vc:
                info = vc.model()
            yield {"first": first, "second": second, "redis": redis_url, "info": info}


def memory(url: str) -> dict[str, Any]:
    """The in-process index's health at ``url`` (``/readyz``)."""
    index = httpx.get(f"{url}/readyz", timeout=30).json()["index"]
    return dict(index.get("memory", index))


def stored(index: RedisRows, image: str) -> bool:
    try:
        index.info(image)
    except VisencClientError:
        return False
    return True


@pytest.mark.parametrize("next_source", ["replica", "redis"])
def test_a_lease_stays_with_the_replica_that_gave_it_and_lapses_there(
    replicas: dict[str, Any], next_source: str
) -> None:
    seed = {"replica": 70, "redis": 80}[next_source]
    images = [png_bytes(seed + i, 72 + 8 * i, 56) for i in range(2)]
    truth: dict[str, torch.Tensor] = {}
    for url in (replicas["first"], replicas["second"]):
        with Client(url) as vc:
            handles = vc.encode(images, pin=False)
            truth = {h.hash: torch_rows(vc.fetch(h), h.dtype) for h in handles}
    info = replicas["info"]
    served = Served(int(info["hidden_size"]), str(info["image_loader"]), str(info["fingerprint"]))
    if next_source == "redis":  # Redis holds one replica's rows: a batch of other images may differ in the last bit
        with RedisRows.from_url(replicas["redis"], fingerprint=served.fingerprint or "") as index:
            wait_until(lambda: all(stored(index, h) for h in truth), 30, "the rows in Redis")
            truth = {h: torch_rows(index.fetch(h), str(info["dtype"])) for h in truth}
    assert memory(replicas["first"])["pinned_bytes"] == 0
    with Switch(replicas["first"]) as switch:
        switch.set("forward")
        urls = [switch.url] + ([replicas["second"]] if next_source == "replica" else [])
        redis_url = replicas["redis"] if next_source == "redis" else None
        sources = RowSources(urls, served=served, transport="shm", redis_url=redis_url, **QUICK)
        leases: list[str] = []
        at_first = sources.replicas[0].client(wait=True)
        look_up = at_first.lookup

        def look_up_then_stop(*args: Any, **kwargs: Any) -> Any:
            handles = look_up(*args, **kwargs)
            leases.extend(h.lease for h in handles if h.lease)
            switch.set("refused")  # the first replica stops answering before its rows are read
            return handles

        at_first.lookup = look_up_then_stop  # type: ignore[method-assign]
        sent: list[str] = []  # every request the second replica got, its body included
        if next_source == "replica":
            at_second = sources.replicas[1].client(wait=True)
            at_second._http.event_hooks["request"].append(
                lambda r: sent.append(f"{r.url} {r.read().decode('latin-1')}")
            )
        try:
            got = sources.obtain({h: Want(len(rows), None) for h, rows in truth.items()}, wait=True)
        finally:
            sources.close()
    assert set(got) == set(truth)
    for identifier, rows in got.items():
        assert isinstance(rows, torch.Tensor), rows
        assert torch.equal(rows, truth[identifier])
    assert len(leases) == len(truth)  # the first replica pinned each image for this caller ...
    held = memory(replicas["first"])
    assert held["pinned_bytes"] > 0  # ... and keeps it for the lease (nobody read it there)
    if next_source == "replica":
        assert sent and not any(lease in s for s in sent for lease in leases)  # never named elsewhere
        assert memory(replicas["second"])["pinned_bytes"] == 0
    wait_until(lambda: memory(replicas["first"])["pinned_bytes"] == 0, 30, "the first replica's lease lapses")
    assert memory(replicas["first"])["entries"] == held["entries"]  # the entries stay


@pytest.mark.parametrize("transport", ["http", "shm"])
def test_a_handle_the_connector_rejects_leaves_no_pin(replicas: dict[str, Any], transport: str) -> None:
    """The connector looks an image up and finds its rows are not what the engine reads (another row
    count): it reads nothing, and hands the lease back. The control: the rows it takes."""
    url = replicas["second"]
    with Client(url) as vc:
        (h,) = vc.encode([png_bytes({"shm": 90, "http": 91}[transport], 96, 64)], pin=False)
    info = replicas["info"]
    served = Served(int(info["hidden_size"]), str(info["image_loader"]), str(info["fingerprint"]))
    sources = RowSources([url], served=served, transport=transport, **QUICK)
    try:
        assert h.num_tokens is not None
        (wrong,) = sources.obtain({h.hash: Want(h.num_tokens + 1, None)}, wait=True).values()
        assert not isinstance(wrong, torch.Tensor) and "rows" in str(wrong)
        assert memory(url)["pinned_bytes"] == 0
        (right,) = sources.obtain({h.hash: Want(h.num_tokens, None)}, wait=True).values()
        assert isinstance(right, torch.Tensor) and right.shape[0] == h.num_tokens
        assert memory(url)["pinned_bytes"] == 0
    finally:
        sources.close()
