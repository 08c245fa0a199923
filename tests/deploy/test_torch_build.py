"""``make run`` installs the torch build for the host and says which: CUDA where ``nvidia-smi -L`` lists a
GPU, CPU where it is absent or fails; the CPU line, run by pip as the Makefile writes it, takes a CPU
wheel (here the local one pip's configuration points to: PyTorch's CPU index is not reachable)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from harness.paths import ROOT


def dry_run(tmp_path: Path, nvidia_smi: str | None, *extra: str) -> list[str]:
    """The commands ``make`` would run to create a venv, with ``nvidia-smi`` as given on PATH."""
    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    if nvidia_smi is not None:
        (bin_ / "nvidia-smi").write_text(f"#!/bin/sh\n{nvidia_smi}\n")
        (bin_ / "nvidia-smi").chmod(0o755)
    venv = tmp_path / "venv"
    r = subprocess.run(
        ["make", "-n", f"{venv}/bin/python", f"VENV={venv}", *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": f"{bin_}:/usr/bin:/bin"},
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def torch_line(lines: list[str]) -> str:
    (line,) = [ln for ln in lines if re.search(r"pip install .*torch==", ln)]
    return line


@pytest.mark.parametrize(
    ("nvidia_smi", "build", "index"),
    [
        (None, "cpu", "https://download.pytorch.org/whl/cpu"),  # no nvidia-smi at all
        ("exit 9", "cpu", "https://download.pytorch.org/whl/cpu"),  # a driver without a GPU: it fails
        ("echo 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'", "cuda", "https://download.pytorch.org/whl/cu128"),
    ],
)
def test_the_build_follows_the_host_and_is_said(tmp_path, nvidia_smi, build, index):
    if nvidia_smi is None and Path("/usr/bin/nvidia-smi").exists():
        pytest.skip("this host has nvidia-smi in /usr/bin")
    lines = dry_run(tmp_path, nvidia_smi)
    assert any(ln.startswith("echo") and f"torch 2.13.0: the {build} build" in ln for ln in lines), lines
    assert f"--extra-index-url {index}" in torch_line(lines) and "--no-deps" in torch_line(lines)


def test_the_choice_can_be_forced_and_a_wrong_one_is_refused(tmp_path):
    assert "whl/cpu" in torch_line(dry_run(tmp_path, "echo GPU 0", "TORCH_BUILD=cpu"))
    r = subprocess.run(
        ["make", "-n", f"{tmp_path}/v/bin/python", f"VENV={tmp_path}/v", "TORCH_BUILD=rocm"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode != 0 and 'TORCH_BUILD is cpu or cuda, not "rocm"' in r.stderr


@pytest.mark.slow
def test_the_cpu_line_installs_a_cpu_wheel(tmp_path):
    argv = shlex.split(torch_line(dry_run(tmp_path, None)))
    argv = [sys.executable, "-m", "pip", *argv[1:]]  # this interpreter's pip for the venv's
    report = tmp_path / "report.json"
    argv += ["--dry-run", "--ignore-installed", "--report", str(report)]
    env = {**os.environ, "PIP_RETRIES": "0"}  # an unreachable index costs one try, not five
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    (item,) = json.loads(report.read_text())["install"]
    assert item["metadata"]["name"] == "torch" and item["metadata"]["version"] == "2.13.0+cpu"
