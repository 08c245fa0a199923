"""``vllm serve`` with two visenc replicas whose first cannot be reached: every request still gets its
rows from the second, vLLM encodes nothing, and the time to its first token grows by at most the
connector's connect timeout.

vLLM serves a copy of a tiny Qwen2-VL whose own vision tower is wrong; both visenc replicas serve the
right checkpoint, so vLLM gives the right checkpoint's tokens only if every image's rows came from
visenc. The connector's first URL is a port (``tests.support.dead_ends.Switch``) that relays to the
first replica (a healthy pair), or is closed, or hangs on connect (a full accept queue), or accepts
and never answers. Requests alternate between the healthy pair and the fault. Per request:

- tokens and logprobs equal vLLM alone's on the right checkpoint (no image encoded by vLLM);
- the second replica served rows (its own ``visenc_bytes_served``) exactly when the first failed;
- neither replica holds a pin afterwards: the connector's shared-memory read named the lease of the
  replica that answered its look-up, and released it there;
- vLLM's own stats (``/metrics``): the connector counted one hit, no miss or failure, and one
  unreachable source per faulty request; the time to first token (vLLM's histogram) of the faulty
  requests is at most ``CONNECT_TIMEOUT_S`` above the healthy ones' (medians, with a margin for a
  loaded host).

Before, the first replica's ``OSError`` escaped the connector's look-up: the whole batch failed, the
second replica was never asked, and vLLM encoded every image (its tokens then differ here).
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment (make vllm)")

from harness.processes import serve_process, stop_process
from harness.waits import free_port, metric, wait_ready, wait_until
from tests.support.dead_ends import Switch

from visenc_client import Client, image_hash

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import run_vllm  # noqa: E402
from openai_servers import chat, connector_config, openai_server  # noqa: E402

LOGPROB_ATOL = 1e-3
#: the connector's bound on connecting to, and on waiting for the answer of, a replica (a healthy
#: visenc answers in milliseconds; this host may be loaded by other work)
CONNECT_TIMEOUT_S = 2.0
#: what a loaded 2-core host may add to a median time to first token, beyond the bound under test
MARGIN_S = 1.0
ROUNDS = 3
_seeds = iter(range(5000, 6000))


@pytest.fixture(scope="module")
def stack(
    qwen2_vl: tuple[Path, Path], openai_pair: tuple[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    right, wrong = qwen2_vl
    folder = tmp_path_factory.mktemp("replicas")
    with serve_process("--model", str(right), "--max-wait-ms", "1") as first:
        with serve_process("--model", str(right), "--max-wait-ms", "1") as second, Switch(first) as switch:
            switch.set("forward")
            config = connector_config(
                [switch.url, second],
                connect_timeout_s=CONNECT_TIMEOUT_S,
                answer_timeout_s=CONNECT_TIMEOUT_S,
                defer_timeout_s=120,  # never the reason a request goes on without its rows
                backoff_s=0.001,  # every request asks the first replica again: each meets the fault
                accept_other_weights=True,  # vLLM runs the wrong copy: its rows come from visenc
            )
            port = free_port()
            log = folder / "vllm.log"
            behind = openai_server(wrong, port, "--ec-transfer-config", config, log=log, videos=1)
            url = f"http://127.0.0.1:{port}"
            try:
                wait_ready(url, behind, 300, "/health")
                stack = {"alone": openai_pair[0], "behind": url, "replicas": (first, second), "switch": switch}
                one_request(stack, "forward")  # each process's first request, not measured
                yield stack
            finally:
                stop_process(behind)
                if log.exists():
                    print(log.read_text()[-4000:])


def counters(stack: dict[str, Any]) -> dict[str, float]:
    """The second replica's rows served, and vLLM's own counts (the connector's and its TTFT histogram)."""
    second = httpx.get(f"{stack['replicas'][1]}/metrics", timeout=10).text
    vllm = httpx.get(f"{stack['behind']}/metrics", timeout=10).text
    out = {"second_bytes": metric(second, "visenc_bytes_served_total")}
    for name in ("hits", "misses", "failures", "unreachable"):
        out[name] = metric(vllm, f"vllm:visenc_{name}_total")
    out["ttft_sum"] = metric(vllm, "vllm:time_to_first_token_seconds_sum")
    out["ttft_count"] = metric(vllm, "vllm:time_to_first_token_seconds_count")
    return out


def pinned_bytes(url: str) -> int:
    """The bytes the replica at ``url`` holds pinned for readers (``/readyz``)."""
    index = httpx.get(f"{url}/readyz", timeout=10).json()["index"]
    return int(index.get("memory", index)["pinned_bytes"])


def one_request(stack: dict[str, Any], mode: str) -> float:
    """A new image, held by both replicas, asked of vLLM with the first URL in ``mode``: its time to
    first token, after checking where its rows came from."""
    data = run_vllm.picture(300, 200, next(_seeds))
    for replica in stack["replicas"]:
        with Client(replica) as vc:
            assert vc.encode([data], pin=False)[0].status == "ready"  # it reads nothing: no pin
    want = chat(stack["alone"], [data])
    stack["switch"].set(mode)
    before = counters(stack)
    got = chat(stack["behind"], [data], [image_hash(data)])
    assert got["tokens"] == want["tokens"], mode  # the right tower's rows: vLLM encoded nothing
    assert max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"])) <= LOGPROB_ATOL
    wait_until(lambda: counters(stack)["ttft_count"] > before["ttft_count"], 30, "vLLM's stats of the request")
    wait_until(lambda: counters(stack)["hits"] > before["hits"], 30, "the connector's stats")
    after = counters(stack)
    assert after["hits"] - before["hits"] == 1 and after["misses"] == before["misses"]
    assert after["failures"] == before["failures"]
    faulty = mode != "forward"
    said = f"{mode}: {before} -> {after}"
    assert (after["second_bytes"] > before["second_bytes"]) == faulty, said  # the second served iff the first failed
    assert (after["unreachable"] > before["unreachable"]) == faulty, said
    assert [pinned_bytes(replica) for replica in stack["replicas"]] == [0, 0], said
    return after["ttft_sum"] - before["ttft_sum"]


@pytest.mark.parametrize("kind", ["refused", "connect-hangs", "silent"])
def test_a_dead_first_replica_costs_at_most_the_connect_timeout(stack: dict[str, Any], kind: str) -> None:
    healthy, faulty = [], []
    for _ in range(ROUNDS):  # alternating, so both see the same load
        healthy.append(one_request(stack, "forward"))
        faulty.append(one_request(stack, kind))
    print(f"{kind}: TTFT healthy pair {healthy}, first replica {kind} {faulty} (s)")
    assert statistics.median(faulty) <= statistics.median(healthy) + CONNECT_TIMEOUT_S + MARGIN_S
    assert httpx.get(f"{stack['behind']}/health", timeout=10).status_code == 200
