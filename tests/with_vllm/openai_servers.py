"""``vllm serve`` (vLLM's OpenAI server) in a subprocess, and chat requests to it, for the tests here."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
from harness.waits import wait_ready

ROOT = Path(__file__).resolve().parent.parent.parent


def connector_config(url: str | list[str], **options: Any) -> str:
    """``--ec-transfer-config`` for vLLM as an ``ec_consumer`` of the visenc at ``url``."""
    return json.dumps(
        {
            "ec_connector": "VisencConnector",
            "ec_connector_module_path": "visenc_client.vllm",
            "ec_role": "ec_consumer",
            "ec_connector_extra_config": {"url": url, **options},
        }
    )


def openai_server(
    model: Path, port: int, *extra: str, log: Path | None = None, videos: int = 0
) -> subprocess.Popen[bytes]:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    out = open(log, "wb") if log else subprocess.DEVNULL  # the child holds it
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.launchers.api_server.entry",  # what `vllm serve` runs (docs/integration-vllm.md)
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
            json.dumps({"image": 2, "video": videos}),
            "--seed",
            "0",
            *extra,
        ],
        cwd=ROOT,
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT if log else subprocess.DEVNULL,
    )


def chat_request(
    url: str, datas: list[bytes], uuids: list[str] | None = None, videos: list[list[bytes]] = ()
) -> httpx.Response:
    """A greedy 8-token chat completion over ``datas`` (PNG bytes as data: URLs), each image part
    given its ``uuid`` when ``uuids`` is set, and ``videos`` (JPEG frames as ``data:video/jpeg``)."""
    parts: list[dict[str, Any]] = []
    for frames in videos:
        url_ = "data:video/jpeg;base64," + ",".join(base64.b64encode(f).decode() for f in frames)
        parts.append({"type": "video_url", "video_url": {"url": url_}})
    for i, d in enumerate(datas):
        part: dict[str, Any] = {
            "type": "image_url",
            "image_url": {"url": "data:image/png;base64," + base64.b64encode(d).decode()},
        }
        if uuids is not None:
            part["uuid"] = uuids[i]
        parts.append(part)
    body = {
        "model": httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"],
        "temperature": 0.0,
        "max_tokens": 8,
        "logprobs": True,
        "top_logprobs": 1,
        "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "Describe the pictures."}]}],
    }
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)


def chat(url: str, datas: list[bytes], uuids: list[str] | None = None, videos: list[list[bytes]] = ()) -> dict:
    """Tokens and logprobs of ``chat_request``'s answer (which must be a 200)."""
    r = chat_request(url, datas, uuids, videos)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    return {"tokens": [c["token"] for c in content], "logprobs": [c["logprob"] for c in content]}


@contextlib.contextmanager
def alone_and_behind_proxy(right: Path, wrong: Path, visenc: str, *, videos: int = 0) -> Any:
    """``(alone, proxied)`` URLs: ``vllm serve`` on ``right`` alone, and ``vllm serve`` on ``wrong``
    with the connector (``wait_for_encoding``) behind ``visenc proxy --encode-first``; all three
    stopped on exit."""
    from harness.processes import stop_process
    from harness.waits import free_port

    ports = [free_port() for _ in range(3)]
    alone = openai_server(right, ports[0], videos=videos)
    config = connector_config(visenc, wait_for_encoding=True, accept_other_weights=True)
    behind = openai_server(wrong, ports[1], "--ec-transfer-config", config, videos=videos)
    upstream = f"http://127.0.0.1:{ports[1]}"
    command = ["-m", "visenc", "proxy", "--port", str(ports[2]), "--upstream", upstream, "--visenc", visenc]
    proxy = subprocess.Popen(
        [sys.executable, *command, "--encode-first"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        for url, proc in zip(urls, [alone, behind, proxy]):
            wait_ready(url, proc, 300, "/health")
        yield urls[0], urls[2]
    finally:
        for proc in (proxy, behind, alone):
            stop_process(proc)
