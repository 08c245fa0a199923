"""The shards visenc reads (and, from a hub, fetches from) are the shards vLLM 0.32 keeps under
``--mm-encoder-only`` (``filter_mm_encoder_only_safetensors_files``), for the same index file: visenc
applies vLLM's read filter, and goes on to read only the vision tensors inside those shards."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import safetensors
from harness.paths import ROOT
from safetensors.torch import load_file
from tests.support.hub_checkpoints import reshard
from tests.with_vllm import tiny_vlm

import visenc.models.loading as loading
import visenc.models.registry as registry

pytest.importorskip("vllm", reason="needs the vLLM environment (make vllm)")


def vllm_kept(folder: Path) -> list[str]:
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "with_vllm" / "vllm_shard_filter.py"), str(folder)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def visenc_read(folder: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], list[str]]:
    """(shards, tensors) ``load_tower`` opens and reads (a spy on safetensors' reader)."""
    files: set[str] = set()
    tensors: list[str] = []

    def spy(filename: str, **kwargs: Any) -> Any:
        files.add(Path(filename).name)
        handle = safetensors.safe_open(filename, **kwargs)

        class Reader:
            def __enter__(self) -> Reader:
                handle.__enter__()
                return self

            def __exit__(self, *exc: object) -> None:
                handle.__exit__(*exc)

            def get_tensor(self, name: str) -> Any:
                tensors.append(name)
                return handle.get_tensor(name)

        return Reader()

    monkeypatch.setattr(registry, "safe_open", spy)  # the checkpoint reader lives in the registry
    loading.load_tower(str(folder), image_backend="pil")
    return sorted(files), tensors


def is_vision(name: str) -> bool:
    return name.startswith(("visual.", "model.visual.")) or "vision_tower." in name or "multi_modal_projector." in name


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "gemma3"])
@pytest.mark.parametrize("last", ["vision beside language", "vision alone"])
def test_visenc_reads_the_shards_vllm_keeps(
    arch: str, last: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    full = (
        tiny_vlm.build_gemma3(tmp_path / "full") if arch == "gemma3" else tiny_vlm.build(tmp_path / "full", arch=arch)
    )
    names = sorted(load_file(str(full / "model.safetensors")))
    vision = [n for n in names if is_vision(n)]
    language = [n for n in names if not is_vision(n)]
    half = len(vision) // 2
    if last == "vision alone":
        groups = [[language[0], *vision[:half]], language[1:], vision[half:]]
    else:
        groups = [[language[0], *vision[:half]], language[1:-1], [*vision[half:], language[-1]]]
    shards = reshard(full, tmp_path / "sharded", groups)
    kept = vllm_kept(tmp_path / "sharded")
    read, tensors = visenc_read(tmp_path / "sharded", monkeypatch)
    assert kept == read == [shards[0], shards[2]]  # the language-model-only shard: neither reads it
    assert sorted(tensors) == vision  # and inside the kept shards, visenc reads the vision tensors alone
