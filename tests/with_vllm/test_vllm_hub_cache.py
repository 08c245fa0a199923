"""A checkpoint vLLM 0.32 already downloaded on the host (its own ``download_weights_from_hf``, what
``vllm serve ORG/NAME`` runs, into the same ``HF_HOME``) is read by ``visenc serve ORG/NAME`` from the
hub cache: no weight byte is fetched, no vision-only file is written, and the rows are those of the same
checkpoint served from a local folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from harness.images import png_bytes
from harness.processes import serve_subprocess
from tests.support.hub import LoopbackHub
from tests.support.hub_checkpoints import reshard
from tests.with_vllm import tiny_vlm

from visenc_client import Client

pytest.importorskip("vllm", reason="needs the vLLM environment (make vllm)")

IMAGES = [png_bytes(3, 150, 100)]


def rows(model: str, env: dict[str, str], log: Path) -> list[np.ndarray]:
    with serve_subprocess("--model", model, "--torch-threads", "1", env=env, log=log) as (url, _):
        with Client(url) as vc:
            return [vc.fetch(h) for h in vc.encode(IMAGES)]


def test_visenc_reads_what_vllm_downloaded(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    full = tiny_vlm.build(tmp_path / "full", arch="qwen2_5_vl")
    names = sorted(load_file(str(full / "model.safetensors")))
    vision = [n for n in names if n.startswith("visual.")]
    language = [n for n in names if not n.startswith("visual.")]
    folder = tmp_path / "sharded"
    reshard(full, folder, [[language[0], *vision], language[1:]])
    home = tmp_path / "hf"
    with LoopbackHub() as hub:
        hub.publish("acme/tiny-vlm", folder)
        env = hub.env(home)
        code = (
            "from vllm.model_executor.model_loader.weight_utils import download_weights_from_hf as d\n"
            "print(d('acme/tiny-vlm', None, ['*.safetensors']))\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert len(list((home / "hub").rglob("model-0000*.safetensors"))) == 2  # vLLM fetched every shard
        hub.reset()
        got = rows("acme/tiny-vlm", env, tmp_path / "hub.log")
        fetched = [r for r in hub.served() if r.file is not None and r.file.endswith(".safetensors")]
    assert fetched == [] and not (home / "visenc").exists()
    assert "read from the hub cache" in (tmp_path / "hub.log").read_text()
    want = rows(str(folder), {}, tmp_path / "local.log")
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
