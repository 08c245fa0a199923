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

import json
import subprocess
import sys
from pathlib import Path

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
