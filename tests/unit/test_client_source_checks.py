"""The connector's sources (``visenc_client._sources.RowSources``) with real ``visenc serve`` processes: a
waiting look-up that outlasts ``timeout_s`` backs nothing off (the replica answered; its prompt look-ups go
on); a replica behind one URL that moves to a host whose memory this one does not share is read over HTTP
from then on; the shared index on a real Redis Cluster (``redis_mode: cluster``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from harness.images import png_bytes
from harness.processes import redis_cluster, serve_process, serve_subprocess
from harness.waits import wait_until
from redis.crc import key_slot
from tests.support.dead_ends import Switch, refused
from tests.support.serve_faulty import launcher as faulty

from visenc_client import Client
from visenc_client._sources import Absent, RowSources, Served, Want, torch_rows
from visenc_client.format import entry_key

BACKOFF_S = 600.0
#: a forward of the slow replica takes this long; a waiting look-up there gives up after ``WAIT_S``
FORWARD_S, WAIT_S = 3.0, 0.5
IMAGES = [png_bytes(700 + i, 64 + 8 * i, 48) for i in range(2)]


def truth(url: str, images: list[bytes]) -> tuple[Served, dict[str, Want], dict[str, torch.Tensor]]:
    """What ``url`` serves, the images' wants, and their rows (encoded there first)."""
    with Client(url) as vc:
        info, handles = vc.model(), vc.encode(images)
        rows = {h.hash: torch_rows(vc.fetch(h), h.dtype) for h in handles}
    served = Served(int(info["hidden_size"]), str(info["image_loader"]), str(info["fingerprint"]))
    return served, {h.hash: Want(h.num_tokens, None) for h in handles}, rows


def assert_rows(got: dict[str, Any], rows: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(rows)
    for identifier, answer in got.items():
        assert isinstance(answer, torch.Tensor), answer
        assert torch.equal(answer, rows[identifier])


@pytest.fixture(scope="module")
def slow_http_visenc() -> Iterator[str]:
    """A visenc whose forwards take ``FORWARD_S`` and that serves no shared memory (as one on another host)."""
    faults = ("--forward-delay-s", str(FORWARD_S))
    with serve_subprocess("--max-wait-ms", "1", "--shm-enabled", "false", launcher=faulty(*faults)) as (url, _):
        yield url


def test_a_slow_wait_backs_nothing_off(slow_http_visenc: str) -> None:
    """Before, the waiting look-up's timeout backed the URL off: the prompt look-up right after was
    "not asked: it could not be reached lately"."""
    served, wants, rows = truth(slow_http_visenc, IMAGES)
    sources = RowSources(
        [slow_http_visenc],
        served=served,
        timeout_s=WAIT_S,
        connect_timeout_s=5,
        answer_timeout_s=30,
        backoff_s=BACKOFF_S,
    )
    try:
        with Client(slow_http_visenc) as vc:
            (pending,) = vc.encode([png_bytes(799, 80, 40)], wait=False)
        assert pending.status == "pending"
        got = sources.obtain({pending.hash: Want(pending.num_tokens, None)}, wait=True)
        assert_rows(sources.obtain(wants, wait=False), rows)  # asked at once
        assert sources.backoff.skipped_for(slow_http_visenc) == 0 and sources.backoff.unreachable == 0
        assert "not ready within timeout_s" in str(got[pending.hash])
    finally:
        sources.close()


def test_a_replica_that_moves_off_this_host_is_read_over_http(slow_http_visenc: str) -> None:
    """``transport: auto`` behind one URL: shared memory while the replica is on this host; once it has
    gone and the URL leads to one that serves no shared memory here, the replica is checked again and
    read over HTTP (before, the choice was never made again: every read failed until a restart)."""
    quick = {"timeout_s": 30.0, "connect_timeout_s": 5.0, "answer_timeout_s": 30.0}
    with Switch(slow_http_visenc) as switch:
        with serve_process("--max-wait-ms", "1") as here:
            served, wants, rows = truth(here, IMAGES)
            host, port = here.removeprefix("http://").split(":")
            switch.upstream = (host, int(port))
            switch.set("forward")
            sources = RowSources([switch.url], served=served, transport="auto", **quick)
            assert_rows(sources.obtain(wants, wait=False), rows)
        try:
            replica = sources.replicas[0]
            assert replica.prompt.shared_memory
            assert truth(slow_http_visenc, IMAGES)[2].keys() == rows.keys()  # the other replica holds them too
            host, port = slow_http_visenc.removeprefix("http://").split(":")
            switch.upstream = (host, int(port))
            switch.set("forward")  # the URL now leads to the other replica
            answers = [sources.obtain(wants, wait=False) for _ in range(2)]  # the first may find the move
            assert_rows(answers[-1], rows)
            assert not replica.prompt.shared_memory and not replica.waiting.shared_memory
        finally:
            sources.close()


def test_the_shared_index_on_a_redis_cluster(tmp_path: Path) -> None:
    """``redis_mode: cluster`` reads entries spread over three nodes; a standalone client of the same
    cluster (before, the only kind) is answered MOVED (``MovedError``) for the keys other nodes hold."""
    with redis_cluster(tmp_path) as ports:
        url = f"redis://127.0.0.1:{ports[0]}"
        with serve_process("--redis-url", url, "--redis-mode", "cluster", "--max-wait-ms", "1") as visenc:
            images = [png_bytes(720 + i, 64, 48) for i in range(6)]
            served, wants, rows = truth(visenc, images)
        assert len({key_slot(entry_key("default", str(served.fingerprint), h).encode()) % 3 for h in wants}) > 1
        quick = {"timeout_s": 5.0, "connect_timeout_s": 2.0, "answer_timeout_s": 5.0}
        cluster = RowSources([refused()], served=served, redis_url=url, redis_mode="cluster", **quick)
        standalone = RowSources([refused()], served=served, redis_url=url, **quick)
        try:
            wait_until(lambda: all(isinstance(a, torch.Tensor) for a in cluster.obtain(wants, wait=False).values()), 10)
            assert_rows(cluster.obtain(wants, wait=False), rows)
            alone = standalone.obtain(wants, wait=False)
            assert any(isinstance(a, Absent) and "MovedError" in str(a) for a in alone.values()), alone
        finally:
            cluster.close()
            standalone.close()


def test_a_redis_cluster_down_at_start_is_read_once_it_answers(tmp_path: Path) -> None:
    """A cluster's client asks its nodes at once: one down when the connector starts was a
    ``RedisClusterException`` out of the connector (vLLM did not start); now the index is a source
    that cannot be reached yet, opened at a later look-up once the cluster answers."""
    with redis_cluster(tmp_path) as ports:
        url = f"redis://127.0.0.1:{ports[0]}"
        with serve_process("--redis-url", url, "--redis-mode", "cluster", "--max-wait-ms", "1") as visenc:
            served, wants, rows = truth(visenc, [png_bytes(740 + i, 64, 48) for i in range(3)])
        with Switch(url.replace("redis://", "http://")) as first_node:  # refused until set to forward
            quick = {"timeout_s": 5.0, "connect_timeout_s": 2.0, "answer_timeout_s": 5.0, "backoff_s": 0.1}
            index = f"redis://127.0.0.1:{first_node.port}"
            sources = RowSources([refused()], served=served, redis_url=index, redis_mode="cluster", **quick)
            try:
                down = sources.obtain(wants, wait=False)
                assert all(isinstance(a, Absent) and "redis" in str(a).lower() for a in down.values()), down
                first_node.set("forward")
                wait_until(lambda: all(isinstance(a, torch.Tensor) for a in sources.obtain(wants, False).values()), 10)
                assert_rows(sources.obtain(wants, wait=False), rows)
            finally:
                sources.close()
