"""The environment ``make run`` builds (``make install``: the project and its runtime dependencies, no
test extras, no torchvision), as a view of the test environment: a venv whose site-packages holds links
to the files of the runtime's distributions only, so nothing else can be imported or is listed as
installed. Same interpreter, same versions, nothing downloaded; built once per dependency list (about
a second), under the user's cache.

``python`` and ``visenc`` are on its ``bin/`` as after ``make run``; the project's code is the
checkout's (``PYTHONPATH``), as an editable install gives it."""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import os
import subprocess
import sys
from pathlib import Path

import tomllib
from harness.paths import ROOT
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def runtime_distributions() -> list[md.Distribution]:
    """The project's runtime requirements (``[project] dependencies``) and theirs, as installed here."""
    todo = [Requirement(r) for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
    seen: dict[str, md.Distribution] = {}
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            continue
        name = canonicalize_name(req.name)
        if name in seen and not req.extras:
            continue
        seen[name] = dist
        for extra in (*req.extras, ""):
            for r in map(Requirement, dist.requires or []):
                if r.marker is None or r.marker.evaluate({"extra": extra}):
                    r.marker = None  # taken: its own marker (an extra of this one) is spent
                    todo.append(r)
    return sorted(seen.values(), key=lambda d: canonicalize_name(d.metadata["Name"]))


def top_level_entries(dists: list[md.Distribution]) -> list[Path]:
    """The site-packages entries (packages, modules, dist-info folders, .pth files) of ``dists``."""
    out: set[Path] = set()
    for dist in dists:
        for f in dist.files or []:
            if f.parts and f.parts[0] != ".." and f.parts[0] != "__pycache__":
                out.add(Path(str(dist.locate_file(f.parts[0]))))
    return sorted(out)


def runtime_venv() -> Path:
    """The view venv (built on first use; again when the dependency list or the interpreter changes)."""
    entries = top_level_entries(runtime_distributions())
    key = hashlib.sha256(json.dumps([sys.executable, *map(str, entries)]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "visenc-tests" / f"runtime-{key}"
    python = cache / "bin" / "python"
    if not (cache / ".ready").exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--clear", str(cache)], check=True)
        site = subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
        view = Path(site.decode().strip())
        for entry in entries:
            if entry.exists():
                (view / entry.name).symlink_to(entry)
        script = cache / "bin" / "visenc"
        script.write_text(f"#!{python}\nimport sys\nfrom visenc.cli import main\nsys.exit(main())\n")
        script.chmod(0o755)
        (cache / ".ready").touch()
    return cache


def runtime_env(venv: Path) -> dict[str, str]:
    """The variables of a shell with ``venv`` activated, the checkout's code importable."""
    return {
        "PATH": f"{venv / 'bin'}:/usr/bin:/bin",
        "VIRTUAL_ENV": str(venv),
        "PYTHONPATH": f"{ROOT / 'service'}:{ROOT / 'clients'}",
        "HOME": os.environ.get("HOME", "/tmp"),
    }
