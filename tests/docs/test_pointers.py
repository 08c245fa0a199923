"""Every path the docs and the code's docstrings and comments name in this repository exists.

A pointer is a path in backquotes whose first part is one of the repository's folders (``service/``,
``tests/``, ...) or one of the service's packages (``engine/``, ``index/``, ...: read under
``service/visenc/``, or ``visenc_client/`` under ``clients/``); paths in other projects (vLLM's,
SGLang's) start otherwise and are not checked.
"""

from __future__ import annotations

import re
import subprocess

from harness.paths import ROOT

TOP = ("service", "clients", "tests", "bench", "deploy", "loadtest", "harness")
PACKAGES = ("engine", "index", "api", "models", "imaging", "epd", "proxy")
_ROOTS = "|".join((*TOP, *PACKAGES, "visenc_client", "visenc", "docs"))
_POINTER = re.compile(r"`{1,2}((?:" + _ROOTS + r")/[\w./-]*)`{1,2}")


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [f for f in out.split() if f.endswith((".py", ".md")) and not f.startswith("clients/build/")]


def _exists(pointer: str) -> bool:
    path = pointer.rstrip("/.")
    first = path.split("/")[0]
    if first == "docs" and path.count("/") > 1:
        return True  # a folder of another project's docs (ours are flat)
    bases = {
        "visenc": [ROOT / "service"],
        "visenc_client": [ROOT / "clients"],
        **{p: [ROOT / "service" / "visenc"] for p in PACKAGES},
    }.get(first, [ROOT])
    if first in PACKAGES:
        bases = [*bases, ROOT]  # a top-level folder of the same name (deploy/, bench/) is fine too
    return any((base / path).exists() for base in bases)


def test_every_pointer_names_a_path_that_exists():
    stale = []
    for name in _tracked():
        for i, line in enumerate((ROOT / name).read_text().splitlines(), 1):
            stale += [f"{name}:{i}: {m.group(1)}" for m in _POINTER.finditer(line) if not _exists(m.group(1))]
    assert stale == []
