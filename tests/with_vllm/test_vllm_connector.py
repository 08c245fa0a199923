"""vLLM with ``visenc_client.vllm.VisencConnector``: token-identical to vLLM alone.

vLLM serves a copy of a tiny Qwen2-VL whose own vision tower is wrong (redrawn from another seed);
visenc serves the right checkpoint's tower. With the connector, vLLM produces the same tokens, and
logprobs within 1e-3, as vLLM alone on the right checkpoint: for prompts of 1 and 2 images, sizes
that need a resize included, with the pixels sent or only their grids, in one process and in
vLLM's default engine (engine core and worker in their own processes). Without the connector the
wrong copy gives other tokens, so the embeddings did come from visenc.

Runs in the vLLM environment (``make vllm``; ``make test-vllm`` runs this folder); each vLLM run is a
subprocess (``run_vllm.py``), as vLLM keeps process-wide state.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment (make vllm)")

from tests.conftest import serve_process

from visenc_client import Client

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import run_vllm  # noqa: E402
import tiny_vlm  # noqa: E402

ROOT = HERE.parent.parent
LOGPROB_ATOL = 1e-3


def vllm_run(model: Path, *args: str) -> list[dict]:
    out = subprocess.run(
        [sys.executable, str(HERE / "run_vllm.py"), str(model), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def same(a: list[dict], b: list[dict]) -> None:
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b]
    for ra, rb in zip(a, b):
        assert max(abs(x - y) for x, y in zip(ra["logprobs"], rb["logprobs"])) <= LOGPROB_ATOL


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("tiny-vlm")
    return tiny_vlm.build(folder / "right", seed=0), tiny_vlm.build(folder / "wrong", seed=0, vision_seed=1)


@pytest.fixture(scope="module")
def visenc(checkpoints):
    right, _ = checkpoints
    with serve_process("--model", str(right), "--max-wait-ms", "1") as url:
        with Client(url) as vc:  # the prompts' images, encoded once; the connector never uploads
            for datas in run_vllm.images():
                assert all(h.status == "ready" for h in vc.encode(datas))
        yield url


@pytest.fixture(scope="module")
def reference(checkpoints) -> list[dict]:
    right, _ = checkpoints
    return vllm_run(right, "--in-process")


def test_the_wrong_checkpoint_alone_differs(checkpoints, reference):
    _, wrong = checkpoints
    assert [r["tokens"] for r in vllm_run(wrong, "--in-process")] != [r["tokens"] for r in reference]


def test_connector_gives_the_right_checkpoints_tokens(checkpoints, visenc, reference):
    _, wrong = checkpoints
    same(vllm_run(wrong, "--in-process", "--visenc", visenc), reference)


def test_grid_only_images_give_the_same_tokens(checkpoints, visenc, reference):
    """No pixels reach vLLM: each image is its ``image_grid_thw`` (from visenc) and its uuid."""
    _, wrong = checkpoints
    same(vllm_run(wrong, "--in-process", "--visenc", visenc, "--grid-only"), reference)


def test_connector_in_vllms_default_engine(checkpoints, visenc, reference):
    """Scheduler and worker halves of the connector in different processes (vLLM's default)."""
    _, wrong = checkpoints
    same(vllm_run(wrong, "--visenc", visenc), reference)


def test_a_visenc_serving_another_model_is_refused(checkpoints, tmp_path):
    _, wrong = checkpoints
    with serve_process("--model", "tiny-clip") as other:  # rows of 256, the model reads 128
        out = subprocess.run(
            [sys.executable, str(HERE / "run_vllm.py"), str(wrong), "--in-process", "--visenc", other],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=400,
        )
    assert out.returncode != 0 and "serves another model" in out.stderr


def _openai_server(model: Path, port: int, *extra: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--enforce-eager",
            "--max-model-len",
            "2048",
            "--limit-mm-per-prompt",
            '{"image": 2, "video": 0}',
            "--seed",
            "0",
            *extra,
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _wait_up(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{url} exited with {proc.returncode}"
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(url)


def _chat(url: str, datas: list[bytes]) -> dict:
    parts = [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(d).decode()}}
        for d in datas
    ]
    body = {
        "model": None,
        "temperature": 0.0,
        "max_tokens": 8,
        "logprobs": True,
        "top_logprobs": 1,
        "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "Describe the pictures."}]}],
    }
    models = httpx.get(f"{url}/v1/models", timeout=30).json()
    body["model"] = models["data"][0]["id"]
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    return {"tokens": [c["token"] for c in content], "logprobs": [c["logprob"] for c in content]}


def test_openai_server_behind_visenc_proxy(checkpoints, visenc):
    """``vllm serve`` on the wrong copy, with the connector, behind ``visenc proxy`` (which tags the data:
    URL images with their hash and encodes them): the same answers as ``vllm serve`` on the right one."""
    from tests.conftest import free_port, stop_process

    right, wrong = checkpoints
    ports = [free_port() for _ in range(3)]
    connector = json.dumps(
        {
            "ec_connector": "VisencConnector",
            "ec_connector_module_path": "visenc_client.vllm",
            "ec_role": "ec_consumer",
            "ec_connector_extra_config": {"url": visenc},
        }
    )
    alone = _openai_server(right, ports[0])
    behind = _openai_server(wrong, ports[1], "--ec-transfer-config", connector)
    upstream = f"http://127.0.0.1:{ports[1]}"
    proxy = subprocess.Popen(
        [sys.executable, "-m", "visenc", "proxy", "--port", str(ports[2]), "--upstream", upstream, "--visenc", visenc],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for url, proc in [
            (f"http://127.0.0.1:{ports[0]}", alone),
            (upstream, behind),
            (f"http://127.0.0.1:{ports[2]}", proxy),
        ]:
            _wait_up(url, proc)
        fresh = [run_vllm.picture(333, 250, 7), run_vllm.picture(224, 224, 8)]  # never sent to visenc before
        for datas in [fresh, run_vllm.images()[0]]:
            want = _chat(f"http://127.0.0.1:{ports[0]}", datas)
            got = _chat(f"http://127.0.0.1:{ports[2]}", datas)
            assert got["tokens"] == want["tokens"]
            assert max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"])) <= LOGPROB_ATOL
    finally:
        for proc in (proxy, behind, alone):
            stop_process(proc)


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl", "gemma3"])
def test_other_families_through_the_connector(arch, tmp_path):
    """Qwen2.5-VL (window attention), Qwen3-VL (rows carry the deepstack levels,
    ``[main | ds_1 | ds_2]``, as vLLM's encoder cache does) and Gemma 3 (SigLIP, pooled, in a
    Hub-format checkpoint): the wrong copy with the connector gives the right checkpoint's
    tokens, and alone it does not."""
    if arch == "gemma3":
        right = tiny_vlm.build_gemma3(tmp_path / "right", seed=0)
        wrong = tiny_vlm.build_gemma3(tmp_path / "wrong", seed=0, vision_seed=1)
    else:
        right = tiny_vlm.build(tmp_path / "right", seed=0, arch=arch)
        wrong = tiny_vlm.build(tmp_path / "wrong", seed=0, vision_seed=1, arch=arch)
    reference = vllm_run(right, "--in-process")
    with serve_process("--model", str(right), "--max-wait-ms", "1") as url:
        with Client(url) as vc:
            for datas in run_vllm.images():
                assert all(h.status == "ready" for h in vc.encode(datas))
        same(vllm_run(wrong, "--in-process", "--visenc", url), reference)
    assert [r["tokens"] for r in vllm_run(wrong, "--in-process")] != [r["tokens"] for r in reference]


def test_a_request_is_deferred_while_an_image_it_needs_is_encoding():
    """``ensure_cache_available``: pending images the request still needs defer it (bounded by
    ``defer_timeout_s``); images before its computed tokens, or ready ones, do not."""
    from types import SimpleNamespace

    from visenc_client.vllm import ConnectorStats, VisencConnector

    statuses = {"a": "pending", "b": "ready"}
    fake = SimpleNamespace(_status={}, _pending_since={}, defer_timeout_s=0.5, stats=ConnectorStats())
    fake._refresh = lambda ids: fake._status.update({i: statuses[i] for i in ids if fake._status.get(i) != "ready"})

    def feature(identifier, offset, length):
        return SimpleNamespace(identifier=identifier, mm_position=SimpleNamespace(offset=offset, length=length))

    request = SimpleNamespace(mm_features=[feature("a", 10, 4), feature("b", 20, 4)])
    ensure = VisencConnector.ensure_cache_available
    assert not ensure(fake, request, 0)  # "a" is still encoding
    assert ensure(fake, request, 14)  # "a" lies before the computed tokens: only "b" is needed
    assert not ensure(fake, request, 0) and fake.stats.deferred == 2
    time.sleep(0.6)
    assert ensure(fake, request, 0)  # deferred long enough: scheduled, its load will wait
    statuses["a"] = "ready"
    assert ensure(fake, request, 0) and fake._pending_since == {}
