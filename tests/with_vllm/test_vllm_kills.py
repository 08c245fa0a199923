"""``vllm serve`` with ``VisencConnector`` on two visenc replicas that share one Redis, the first of which
is killed with SIGKILL at random moments and started again at once (as a supervisor does): the kills
cost vLLM no request, each answer equals vLLM alone's (tokens, and logprobs within ``LOGPROB_ATOL``),
and vLLM stays healthy. Requests run one after another for as long as the kills go on, so they meet a
replica that is dead or starting; images are encoded beforehand through the replica
that is never killed (the connector never uploads)."""

from __future__ import annotations

import random
import sys
import threading
from pathlib import Path

import httpx
import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment (make vllm)")

from harness.paths import ROOT
from harness.processes import redis_process, serve_subprocess, stop_process
from harness.waits import free_port, metric, wait_ready

from visenc_client import Client, image_hash

HERE = Path(__file__).parent
sys.path[:0] = [str(HERE), str(ROOT / "bench")]
import run_vllm  # noqa: E402
from bench_kill_soak import Replica  # noqa: E402
from openai_servers import chat, connector_config, openai_server  # noqa: E402

LOGPROB_ATOL = 1e-3
KILLS = 4
_seeds = iter(range(7000, 8000))


def same(got: dict, want: dict) -> None:
    assert got["tokens"] == want["tokens"]
    assert max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True)) <= LOGPROB_ATOL


def bytes_served(url: str) -> float:
    return metric(httpx.get(f"{url}/metrics", timeout=10).text, "visenc_bytes_served_total")


@pytest.mark.timeout(1200)  # two vLLM servers of its own start here (minutes on a loaded host)
def test_kills_of_a_replica_cost_vllm_no_request(qwen2_vl: tuple[Path, Path], tmp_path: Path) -> None:
    checkpoint = qwen2_vl[0]
    rng = random.Random(7)
    with redis_process() as (redis_url, _):
        args = ["--model", str(checkpoint), "--max-wait-ms", "1", "--redis-url", redis_url]
        with serve_subprocess(*args, log=tmp_path / "a.log") as (kept, _):
            killed = Replica("b", args, tmp_path / "b.log")
            killed.start()
            config = connector_config(
                [killed.url, kept],  # the killed one first: every request asks it before the other
                timeout_s=3.0,
                answer_timeout_s=3.0,
                defer_timeout_s=1.5,
                backoff_s=0.001,
            )
            port, alone_port = free_port(), free_port()
            behind = openai_server(checkpoint, port, "--ec-transfer-config", config, log=tmp_path / "vllm.log")
            by_itself = openai_server(checkpoint, alone_port, log=tmp_path / "alone.log")
            url, alone = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{alone_port}"
            try:
                wait_ready(killed.url, killed.proc, 300)
                wait_ready(url, behind, 600, "/health")
                wait_ready(alone, by_itself, 600, "/health")
                run_while_killed(url, alone, kept, killed, rng)
                wait_ready(killed.url, killed.proc, 300)
                print(f"rows served by visenc: {bytes_served(kept) + bytes_served(killed.url):.0f} bytes")
            finally:
                killed.stop()
                stop_process(behind)
                stop_process(by_itself)


def run_while_killed(url: str, alone: str, kept: str, killed: Replica, rng: random.Random) -> int:
    """Requests one after another (at least one) until ``KILLS`` kills are over; returns how many."""
    kinds: list[bool] = []

    def kill() -> None:
        for _ in range(KILLS):
            threading.Event().wait(rng.uniform(1.0, 6.0))
            kinds.append(killed.kill())
            killed.start()

    killer = threading.Thread(target=kill)
    killer.start()
    asked = 0
    with Client(kept) as vc:
        while killer.is_alive() or asked == 0:
            data = run_vllm.picture(300, 200, next(_seeds))
            assert vc.encode([data], pin=False)[0].status == "ready"
            same(chat(url, [data], [image_hash(data)]), chat(alone, [data]))
            assert httpx.get(f"{url}/health", timeout=10).status_code == 200
            asked += 1
    killer.join()
    print(f"{asked} requests; kills while serving: {sum(kinds)}, while starting: {len(kinds) - sum(kinds)}")
    return asked
