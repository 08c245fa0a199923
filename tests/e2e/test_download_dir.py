"""``--download-dir`` and ``--hf-token``, as vLLM's: the vision weights are fetched into the folder named,
with the token given on the command line."""

from __future__ import annotations

from pathlib import Path

from harness.processes import serve_subprocess
from tests.support.hub import LoopbackHub
from tests.support.hub_checkpoints import hub_layout

TOKEN = "hf_loopback_token"


def test_the_vision_weights_go_to_the_download_dir(tmp_path: Path) -> None:
    with LoopbackHub(tokens=(TOKEN,)) as hub:
        hub.publish("acme/gated", hub_layout("qwen2_5_vl", tmp_path / "ckpt"), gated=True)
        home, folder = tmp_path / "home", tmp_path / "downloads"
        argv = ("--model", "acme/gated", "--torch-threads", "1", "--download-dir", str(folder), "--hf-token", TOKEN)
        with serve_subprocess(*argv, env=hub.env(home), log=tmp_path / "serve.log"):
            pass
    assert [p.name for p in folder.rglob("vision.safetensors")] == ["vision.safetensors"]
    assert list(home.rglob("*.safetensors")) == []
