"""``vllm serve`` with the connector refuses a visenc that serves other weights of the same width, and
accepts one that serves its own: the weights identity of the vision tensors visenc names, computed again
over vLLM's checkpoint files. vLLM serves the right tiny Qwen2-VL; the first visenc serves the copy whose
vision tower was redrawn (same shapes, same width), the second the right one.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import httpx
import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment (make vllm)")

from harness.processes import serve_process, stop_process
from harness.waits import free_port, metric, wait_ready, wait_until

from visenc_client import Client, image_hash

sys.path.insert(0, str(Path(__file__).parent))
import run_vllm
from openai_servers import chat, connector_config, openai_server

LOGPROB_ATOL = 1e-3


def unseen(datas: list[bytes]) -> list[str]:
    """Valid hashes no visenc holds: vLLM encodes these images itself."""
    return [hashlib.sha256(b"unseen:" + d).hexdigest() for d in datas]


def assert_same(got: dict, want: dict) -> None:
    assert got["tokens"] == want["tokens"]
    assert max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"])) <= LOGPROB_ATOL


def hits(url: str) -> float:
    return metric(httpx.get(f"{url}/metrics", timeout=10).text, "vllm:visenc_hits_total")


@pytest.mark.timeout(900)  # a vLLM server of its own starts here (minutes on a loaded host)
def test_other_weights_are_refused_and_the_engines_own_accepted(qwen2_vl, right_visenc, tmp_path):
    right, wrong = qwen2_vl
    fresh, known = [run_vllm.picture(333, 250, 21)], run_vllm.images()[0]  # ``right_visenc`` holds ``known``
    with serve_process("--model", str(wrong), "--max-wait-ms", "1") as other:
        with Client(other) as vc:
            assert all(h.status == "ready" for h in vc.encode(fresh + known, pin=False))
        port, log = free_port(), tmp_path / "vllm.log"
        proc = openai_server(right, port, "--ec-transfer-config", connector_config([other, right_visenc]), log=log)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, proc, 600, "/health")
            said = log.read_text()
            assert f"visenc at {other} serves {str(wrong)!r}, vLLM serves {str(right)!r}: other weights" in said
            assert f"visenc at {right_visenc} serves" not in said  # the same weights: accepted
            # an image only the other weights' visenc holds: vLLM encodes it, as without any visenc
            assert_same(chat(url, fresh, [image_hash(d) for d in fresh]), chat(url, fresh, unseen(fresh)))
            before = hits(url)
            got = chat(url, known, [image_hash(d) for d in known])  # both hold these: the right one answers
            wait_until(lambda: hits(url) == before + len(known), 30, "the connector counts both images present")
            assert_same(got, chat(url, known, unseen(known)))
        finally:
            stop_process(proc)
            print(log.read_text()[-3000:])
