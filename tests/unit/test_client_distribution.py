"""The client is its own distribution (``clients/pyproject.toml``: ``visenc-client``), importable
without the service or torch."""

from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest
from harness.paths import ROOT


def test_importing_the_client_imports_neither_the_service_nor_torch():
    code = (
        "import sys, visenc_client, visenc_client.format, visenc_client.chunks, visenc_client.prefill\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m == 'visenc' or m.startswith('visenc.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(ROOT / "clients"), "PATH": "/usr/bin:/bin"},
    )
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
def test_the_client_builds_as_its_own_wheel(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT / "clients")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = tmp_path.glob("visenc_client-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta = next(zf.read(n).decode() for n in names if n.endswith("METADATA"))
    assert "visenc_client/vllm.py" in names and "visenc_client/py.typed" in names
    assert not any(n.startswith("visenc/") for n in names)
    requires = [line for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    assert any("httpx" in r for r in requires) and not any("fastapi" in r or r.endswith(" torch") for r in requires)
    assert any("vllm" in r and "extra" in r for r in requires)
