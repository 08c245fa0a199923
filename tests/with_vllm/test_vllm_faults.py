"""``vllm serve`` with ``VisencConnector`` is never worse than ``vllm serve`` alone when visenc fails.

Two real OpenAI servers on the same tiny Qwen2-VL checkpoint: one alone, one an ``ec_consumer`` of a
visenc (serving the same checkpoint) reached through a fault-injecting proxy
(``tests/support/fault_proxy.py``). For each fault, every ``POST`` the connector makes (its one
round trip per image: look-up, wait, rows) meets it: a 503, a reset connection, a hang, a visenc
that was killed, a restarted visenc that lost its index (every entry evicted), a visenc whose rows
have another shape than vLLM reads. After each fault:

- the faulted request gets the tokens vLLM alone gives (vLLM encoded the image itself);
- ``/health`` answers 200;
- a following request with a new image (visenc healthy again) gets vLLM alone's tokens too.

vLLM's engine ends on any exception in its worker step or any image counted present but absent at
gather time, so a single one of these faults used to take the whole server down.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment (make vllm)")

from harness.processes import serve_subprocess, stop_process
from harness.waits import free_port, wait_ready, wait_until
from tests.support.fault_proxy import FaultProxy

from visenc_client import Client, image_hash

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import run_vllm  # noqa: E402
from openai_servers import chat, chat_request, connector_config, openai_server  # noqa: E402
from vllm_forks import vllm_run  # noqa: E402

LOGPROB_ATOL = 1e-3
DEFER_TIMEOUT_S = 1.5  # the connector's longest wait for rows (a hang costs this, then vLLM encodes)
_seeds = iter(range(1000, 2000))


def fresh() -> bytes:
    """A picture no one has seen yet (needs a resize: 300x200 is not a multiple of 28)."""
    return run_vllm.picture(300, 200, next(_seeds))


@pytest.fixture(scope="module")
def checkpoint(qwen2_vl: tuple[Path, Path]) -> Path:
    return qwen2_vl[0]


@pytest.fixture(scope="module")
def servers(checkpoint: Path, openai_pair: tuple[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """visenc, the proxy in front of it, vLLM alone (the session's) and vLLM with the connector (through
    the proxy)."""
    logs = tmp_path_factory.mktemp("logs")
    with serve_subprocess("--model", str(checkpoint), "--max-wait-ms", "1") as (visenc, proc):
        with FaultProxy(visenc, delay_s=2 * DEFER_TIMEOUT_S) as proxy:
            config = connector_config(
                proxy.url,
                timeout_s=2 * DEFER_TIMEOUT_S,
                answer_timeout_s=2 * DEFER_TIMEOUT_S,  # past the wait: slow rows are kept for next time
                defer_timeout_s=DEFER_TIMEOUT_S,
                backoff_s=0.001,  # every request meets the fault (test_vllm_replicas tests the back-off)
            )
            port = free_port()
            behind = openai_server(checkpoint, port, "--ec-transfer-config", config, log=logs / "vllm.log", videos=1)
            url = f"http://127.0.0.1:{port}"
            try:
                wait_ready(url, behind, 300, "/health")
                yield {"alone": openai_pair[0], "behind": url, "proxy": proxy, "visenc": visenc, "proc": proc}
            finally:
                stop_process(behind)
                if (logs / "vllm.log").exists():  # the connector's warnings, shown with a failure
                    print((logs / "vllm.log").read_text()[-4000:])


def same(got: dict, want: dict) -> None:
    assert got["tokens"] == want["tokens"]
    assert max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"])) <= LOGPROB_ATOL


def answered_as_alone(servers: dict, data: bytes) -> None:
    """The connector's vLLM answers ``data`` with vLLM alone's tokens, and stays healthy."""
    want = chat(servers["alone"], [data])
    same(chat(servers["behind"], [data], [image_hash(data)]), want)
    assert httpx.get(f"{servers['behind']}/health", timeout=10).status_code == 200


def encoded(visenc: str, data: bytes) -> None:
    with Client(visenc) as vc:
        assert vc.encode([data], pin=False)[0].status == "ready"  # nothing read here


def healthy_again(servers: dict) -> None:
    """visenc answers through the proxy again: a new image it holds is a hit, with alone's tokens."""
    servers["proxy"].mode = "pass"
    data = fresh()
    encoded(servers["visenc"], data)
    before = servers["proxy"].counts["pass"]
    answered_as_alone(servers, data)
    assert servers["proxy"].counts["pass"] > before  # the rows were asked of visenc


@pytest.mark.parametrize("mode", ["503", "reset", "hang", "slow"])
def test_a_failing_visenc_costs_only_the_cache_hit(servers: dict, mode: str) -> None:
    data = fresh()
    encoded(servers["visenc"], data)  # visenc holds the rows: only the fault stops them
    servers["proxy"].mode = mode
    before = servers["proxy"].counts[mode]
    started = time.monotonic()
    answered_as_alone(servers, data)
    assert servers["proxy"].counts[mode] > before  # the fault was met
    assert time.monotonic() - started < 60  # every wait is bounded (defer_timeout_s, then vLLM encodes)
    healthy_again(servers)


def test_rows_of_another_shape_are_never_loaded(servers: dict, checkpoint: Path) -> None:
    """A visenc that resizes otherwise (a lower pixel limit: fewer rows than vLLM reads) behind the
    same URL: its rows are refused before the image is counted present; vLLM encodes it."""
    with serve_subprocess("--model", str(checkpoint), "--max-wait-ms", "1", "--max-pixels", "12544") as (other, _):
        data = run_vllm.picture(640, 480, next(_seeds))
        with Client(other) as vc:
            (h,) = vc.encode([data])
        assert h.status == "ready" and h.num_tokens < 64  # 112x112 pixels at most: vLLM reads more rows
        servers["proxy"].upstream = other
        try:
            want = chat(servers["alone"], [data])
            same(chat(servers["behind"], [data], [image_hash(data)]), want)
        finally:
            servers["proxy"].upstream = servers["visenc"]
    healthy_again(servers)


def test_many_requests_while_visenc_fails_every_other_time(servers: dict) -> None:
    """Requests in flight together while the proxy flips between faults: every one is answered."""
    from concurrent.futures import ThreadPoolExecutor

    datas = [fresh() for _ in range(6)]
    for d in datas[::2]:
        encoded(servers["visenc"], d)
    wants = [chat(servers["alone"], [d]) for d in datas]

    def ask(d: bytes) -> dict:
        return chat(servers["behind"], [d], [image_hash(d)])

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(ask, d) for d in datas]
        for mode in ("503", "reset", "pass", "503"):  # each fault met by a request, while any is left to meet it
            proxy, met = servers["proxy"], servers["proxy"].counts[mode]
            proxy.mode = mode
            wait_until(lambda: proxy.counts[mode] > met or all(f.done() for f in futures), 120, f"{mode} met")  # noqa: B023
        for f, want in zip(futures, wants):
            same(f.result(timeout=120), want)
    healthy_again(servers)
    r = chat_request(servers["behind"], [fresh()], ["not-a-visenc-hash"])  # any other uuid: not cached
    assert r.status_code == 200


def test_images_without_pixels_fail_alone_when_visenc_cannot_answer(checkpoint: Path, tmp_path: Path) -> None:
    """vLLM given images as their grids only (no pixels) cannot encode them itself: with visenc
    unreachable each such request fails on its own (an error finish), while a request with pixels
    in the same engine is answered, and the engine lives on."""
    dead = f"http://127.0.0.1:{free_port()}"
    results = vllm_run(checkpoint, "--in-process", "--visenc", dead, "--grid-only")
    assert [r["finish_reason"] for r in results[:-1]] == ["error"] * (len(results) - 1)
    assert results[-1]["finish_reason"] == "length" and len(results[-1]["tokens"]) == 8  # the one with pixels


def test_visenc_killed_then_restarted_without_its_index(servers: dict, checkpoint: Path) -> None:
    """Last in this module (the visenc it restarts lives only as long as the test). Killed:
    connections are refused. Restarted: every entry it held is gone (evicted), so an
    image vLLM was told of before is missing; vLLM encodes it, and new images are hits again."""
    data = fresh()
    encoded(servers["visenc"], data)
    servers["proc"].kill()
    servers["proc"].wait()
    answered_as_alone(servers, data)
    answered_as_alone(servers, fresh())
    with serve_subprocess("--model", str(checkpoint), "--max-wait-ms", "1") as (visenc, _):
        servers["proxy"].upstream = visenc
        servers["visenc"] = visenc
        time.sleep(1.1)  # the connector asks again about an image found absent after ABSENT_TTL_S
        answered_as_alone(servers, data)  # evicted: missing in the new visenc
        healthy_again(servers)
