"""``pip install ./clients`` alone, in a fresh venv, as the README says: no torch, no service, no
Redis; the README's client snippet then runs against a served visenc and prints what the README
shows, and an extra that is not installed is named in one line."""

from __future__ import annotations

import re

import pytest
from harness.paths import ROOT
from harness.processes import serve_process
from tests.support.venvs import client_source, fresh_venv, run

README = (ROOT / "README.md").read_text()


def readme_client_snippet() -> tuple[str, str]:
    """The README's client snippet and the output it shows after it."""
    m = re.search(r"```python\n(from visenc_client import Client.*?)```\s*\n[^`]*?```text\n(.*?)```", README, re.S)
    assert m, "README.md: no client snippet followed by its output"
    return m.group(1), m.group(2)


def test_readme_installs_the_client_from_its_folder():
    assert "pip install ./clients" in README


@pytest.mark.slow
def test_the_client_alone_runs_the_readme_snippet(tmp_path):
    code, shown = readme_client_snippet()
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "screenshot.png").write_bytes((ROOT / "docs" / "screenshot.png").read_bytes())
    with serve_process("--max-wait-ms", "1") as url:  # started first: it loads while pip installs
        bin_ = fresh_venv(tmp_path / "venv")
        run([str(bin_ / "pip"), "install", "-q", str(client_source(tmp_path))], cwd=tmp_path)
        printed = run([str(bin_ / "python"), "-c", code.replace("http://127.0.0.1:8000", url)], cwd=tmp_path)
    assert printed == shown
    absent = run(
        [
            str(bin_ / "python"),
            "-c",
            "import importlib.util as u; print([u.find_spec(m) for m in ('torch', 'visenc', 'redis')])",
        ],
        cwd=tmp_path,
    )
    assert absent.strip() == "[None, None, None]"

    r = run([str(bin_ / "python"), "-c", "from visenc_client import RedisRows"], cwd=tmp_path, check=False)
    assert r.splitlines()[-1] == (
        "ModuleNotFoundError: visenc_client.RedisRows needs the 'redis' extra (redis is not installed): "
        "pip install 'visenc-client[redis]'"
    )
