"""Fresh virtual environments, set up as a user's: ``python -m venv``, then pip from the registry
(pip's own cache and configuration apply, nothing of this repository's environment leaks in)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from harness.paths import ROOT


def clean_env() -> dict[str, str]:
    """This process's environment without what would hand a child this repository's packages."""
    drop = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSAFEPATH")
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("VISENC_")}


def fresh_venv(folder: Path) -> Path:
    """A new venv made by the base interpreter of this one; its ``bin`` folder."""
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(folder)], check=True, env=clean_env(), timeout=120)
    return folder / "bin"


def client_source(folder: Path) -> Path:
    """A copy of ``clients/`` (pip builds in the source tree: the checkout stays untouched)."""
    dst = folder / "clients"
    shutil.copytree(ROOT / "clients", dst, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    return dst


def run(
    argv: list[str], *, cwd: Path, env: dict[str, str] | None = None, timeout: float = 600, check: bool = True
) -> str:
    """``argv``'s stdout (``check``: it must exit 0, else the failure shows its stderr's tail); without
    ``check``, its stdout and stderr."""
    r = subprocess.run(argv, cwd=cwd, env=env or clean_env(), capture_output=True, text=True, timeout=timeout)
    if not check:
        return r.stdout + r.stderr
    assert r.returncode == 0, f"{argv}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r.stdout
