"""What ``visenc serve`` says at start is what it applies: the process budget's parts add up to it, the
batch limits as the scheduler holds them, "no GPU" where there is none, the revision and commit served;
and the flags vLLM and TEI users reach for work: ``--uds``, ``--api-key``, ``--served-model-name``,
``--trust-remote-code`` (accepted, changing nothing)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from harness.paths import ROOT
from harness.processes import serve_subprocess, stop_process
from harness.waits import wait_until
from tests.support.hub import LoopbackHub
from tests.support.hub_checkpoints import hub_layout

from visenc.process_memory import host_gpus

KEY = "k" * 24
GIB = r"([\d.]+) GiB"


def test_over_a_unix_socket_with_one_key_and_a_served_name(tmp_path: Path) -> None:
    sock, log = tmp_path / "visenc.sock", tmp_path / "serve.log"
    argv = ["--uds", str(sock), "--api-key", KEY, "--served-model-name", "enc", "--trust-remote-code"]
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'service'}:{ROOT / 'clients'}:{ROOT}"}
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "visenc", "serve", *argv], env=env, stdout=out, stderr=out)
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://visenc", timeout=30) as http:

            def ready() -> bool:
                assert proc.poll() is None, log.read_text()
                try:
                    return http.get("/readyz").status_code == 200
                except httpx.TransportError:
                    return False

            wait_until(ready, 120, "visenc serve on its unix socket")
            assert http.get("/v1/model").status_code == 401
            info = http.get("/v1/model", headers={"Authorization": f"Bearer {KEY}"}).json()
            assert info["served_model_name"] == "enc" and info["name"] == "tiny-qwen2-vl"
    finally:
        stop_process(proc)
    text = log.read_text()
    assert f"listening on unix:{sock}" in text
    assert "--trust-remote-code changes nothing" in text
    budget = re.search(
        rf"process memory budget {GIB} \((.*?)\): L1 {GIB} \+ .*? {GIB} \+ .*? {GIB} \+ .*? {GIB} = {GIB}", text
    )
    assert budget, text
    total, source, *parts, total_parts = budget.groups()
    assert sum(float(p) for p in parts) == pytest.approx(float(total_parts), abs=0.02)
    assert float(total_parts) <= float(total) + 0.01
    if host_gpus() == 0:
        assert source.endswith("no GPU"), source
    forwards = re.search(
        r"forwards: at most (\d+) tokens and 64 images a batch(, lowered from max_batch_tokens 16384)?", text
    )
    assert forwards, text
    assert (forwards.group(2) is None) == (forwards.group(1) == "16384")
    ready = next(line for line in text.splitlines() if "visenc ready" in line)
    assert "model=tiny-qwen2-vl (served as enc) " in ready
    assert f"'max_batch_tokens': {forwards.group(1)}," in ready and "'cache_bytes': None" not in ready


def test_the_ready_line_names_the_revision_and_commit_served(tmp_path: Path) -> None:
    with LoopbackHub() as hub:
        sha = hub.publish("acme/served", hub_layout("qwen2_5_vl", tmp_path / "ckpt"))
        log = tmp_path / "serve.log"
        with serve_subprocess("--model", "acme/served", "--torch-threads", "1", env=hub.env(tmp_path / "hf"), log=log):
            pass
    assert f"'revision': 'main (commit {sha})'" in log.read_text()
