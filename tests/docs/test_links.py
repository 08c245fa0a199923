"""Every relative link and image of the repository's Markdown resolves: to a file, and to a heading
of it where the link names one (GitHub's anchors: lower case, punctuation dropped, spaces as '-')."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from harness.paths import ROOT

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def _markdown() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / f for f in out.split() if not f.startswith("clients/build/")]


def anchors(doc: Path) -> set[str]:
    """The anchors GitHub gives the headings of ``doc``."""
    text = _FENCE.sub("", doc.read_text())
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").lower()).replace(" ", "-")
        out.add(slug)
    return out


def broken(doc: Path, root: Path = ROOT) -> list[str]:
    out = []
    for target in _LINK.findall(_FENCE.sub("", doc.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked here
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists() or root.resolve() not in file.parents:
            out.append(f"{doc.relative_to(root)}: {target} (no file {file})")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            out.append(f"{doc.relative_to(root)}: {target} (no heading #{anchor})")
    return out


def test_the_markdown_has_relative_links():
    assert sum(len(_LINK.findall(d.read_text())) for d in _markdown()) > 20


def test_every_relative_link_resolves():
    assert [b for doc in _markdown() for b in broken(doc)] == []


def test_a_link_to_a_missing_file_or_heading_is_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "api.md").write_text("# API\n\n## Per-item errors\n")
    (tmp_path / "docs" / "dashboard.png").write_bytes(b"")
    doc = tmp_path / "docs" / "probe.md"
    doc.write_text(
        "[a](api.md#no-such-heading) ![b](docs/dashboard.png) [c](api.md#per-item-errors) ![d](dashboard.png)"
    )
    assert [b.split(" (")[0] for b in broken(doc, tmp_path)] == [
        "docs/probe.md: api.md#no-such-heading",
        "docs/probe.md: docs/dashboard.png",
    ]
