"""``visenc serve --model sim:...`` serves the simulated device (``models/sim.py``) through the CLI, with
every setting, as ``docs/internals.md`` documents; a key it does not know is refused at start, in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
from harness.images import png_bytes
from harness.paths import ROOT
from harness.processes import serve_subprocess

from visenc.models import sim
from visenc_client import Client


def test_the_cli_serves_the_stand_in_with_its_settings(tmp_path: Path) -> None:
    timeline = tmp_path / "timeline.jsonl"
    spec = f"sim:launch_ms=1,token_us=50,patch=16,hidden=8,memory_mb=256,timeline={timeline}"
    args = ["--model", spec, "--max-batch-images", "4", "--max-wait-ms", "5", "--device", "cpu"]
    with serve_subprocess(*args, log=tmp_path / "serve.log") as (url, _):
        info = httpx.get(f"{url}/v1/model", timeout=10).json()
        assert info["name"].startswith("sim:") and "memory_mb=256" in info["name"], info
        images = [png_bytes(5900 + i, 96, 64) for i in range(6)]
        with Client(url) as client:
            handles = client.encode(images, wait=True)
            for data, handle in zip(images, handles):
                rows = client.fetch(handle, 0, handle.num_tokens)
                grey = sim.load(spec.replace(f",timeline={timeline}", "")).preprocess(_decoded(data)).pixels
                np.testing.assert_allclose(rows, np.repeat(grey[:, None], 8, axis=1), rtol=1e-6)
    spans = [json.loads(line) for line in timeline.read_text().splitlines()]
    assert sum(s["images"] for s in spans if "images" in s) >= len(images)


def test_an_unknown_sim_key_is_refused_in_one_line(tmp_path: Path) -> None:
    env = {"PYTHONPATH": f"{ROOT / 'service'}:{ROOT / 'clients'}:{ROOT}"}
    out = subprocess.run(
        [sys.executable, "-m", "visenc", "serve", "--model", "sim:no_such_key=1", "--port", "1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode != 0
    assert "cannot serve sim:no_such_key=1: unknown sim key 'no_such_key'" in out.stderr, out.stderr


def _decoded(data: bytes):
    from visenc.imaging.decode import decode

    return decode(data, max_pixels=10**9)
