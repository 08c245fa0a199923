"""docs/integration-prefill.md's commands, run as written in the environment ``make run`` builds
(``runtime_env``: no torchvision, no test extras): the example's ``--check`` passes within its bound,
fails (exit 1) past a bound it cannot meet, and refuses in one line, naming torchvision, to compare
the default backend's rows with a reference it cannot build there; where torchvision is installed
(this test environment) the default backend passes too.

Cost: one tiny checkpoint, two servers, four runs of the example (about a minute on 2 cores)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from harness.paths import ROOT
from harness.processes import serve_process
from harness.waits import free_port
from tests.docs.runtime_env import runtime_env, runtime_venv

DOC = ROOT / "docs" / "integration-prefill.md"
EXAMPLE = "clients/examples/qwen2vl_prefill.py"
RESULT = re.compile(r"max \|logits - full model's\| = (\S+) \(bound 0\.0001\)")

pytestmark = pytest.mark.slow


def documented() -> tuple[str, str]:
    """The doc's bash block that runs the example, and the ``text`` block that shows its output."""
    text = DOC.read_text()
    m = re.search(r"```bash\n([^`]*qwen2vl_prefill\.py save-tiny[^`]*)```\s*```text\n(.*?)```", text, re.S)
    assert m, "docs/integration-prefill.md runs the example in a bash block, its output in a text block after"
    return m.group(1), m.group(2)


def as_run_here(block: str, venv: Path, folder: Path, port: int) -> str:
    """The block with this test's venv, folder and port; the server it starts is ended when it ends."""
    lines = ["set -euo pipefail"]
    for line in block.splitlines():
        line = line.replace(". .venv/bin/activate", f". {venv}/bin/activate").replace("/tmp/tiny-vlm", str(folder))
        line = line.replace("--port 8001", f"--port {port}").replace("127.0.0.1:8001", f"127.0.0.1:{port}")
        lines.append(line)
        if re.sub(r"\s+#.*$", "", line).rstrip().endswith("&"):
            lines.append("serve_pid=$!; trap 'kill $serve_pid; wait $serve_pid || true' EXIT")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def venv() -> Path:
    return runtime_venv()


@pytest.fixture(scope="module")
def as_documented(venv: Path, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("prefill") / "tiny-vlm"
    block, shown = documented()
    port = free_port()
    script = as_run_here(block, venv, folder, port)
    assert script.count(f"127.0.0.1:{port}") == 1 and f"--port {port}" in script, script
    r = subprocess.run(
        ["bash", "-c", script], cwd=ROOT, env=runtime_env(venv), capture_output=True, text=True, timeout=600
    )
    return r, shown, folder


def test_the_documented_commands_pass_in_the_environment_make_run_builds(as_documented):
    r, shown, _ = as_documented
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr[-3000:]}"
    printed = r.stdout.splitlines()
    for line in shown.splitlines():
        if RESULT.match(line):
            (got,) = [float(m.group(1)) for p in printed if (m := RESULT.match(p))]
            assert got <= 1e-4
        else:
            assert line in printed, f"shown but not printed: {line!r}; printed: {printed}"


def run_example(python: str, env: dict[str, str] | None, url: str, model: Path, *extra: str):
    argv = [python, EXAMPLE, "run", "--model", str(model), "--url", url, "--chunk", "16", "--check", *extra]
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_the_default_backend_is_checked_where_torchvision_is_and_refused_where_it_is_not(as_documented, venv):
    r, _, model = as_documented
    assert r.returncode == 0, "the documented commands failed (see the test before)"
    with serve_process("--model", str(model), "--max-wait-ms", "2") as url:  # image_backend: torchvision
        refused = run_example("python", runtime_env(venv), url, model)
        said = [line for line in refused.stderr.splitlines() if not line.startswith("waiting for visenc")]
        assert refused.returncode != 0 and "max |logits" not in refused.stdout
        assert len(said) == 1 and "torchvision" in said[0] and "--image-backend pil" in said[0], refused.stderr
        env = {"PYTHONPATH": f"{ROOT / 'service'}:{ROOT / 'clients'}", "PATH": "/usr/bin:/bin"}
        passed = run_example(sys.executable, env, url, model)
        assert passed.returncode == 0, passed.stderr[-3000:]
        (m,) = [m for line in passed.stdout.splitlines() if (m := RESULT.match(line))]
        assert float(m.group(1)) <= 1e-4
        strict = run_example(sys.executable, env, url, model, "--tolerance", "1e-12")
        assert strict.returncode == 1 and "--check failed" in strict.stderr, strict.stderr[-3000:]
        other = run_example(sys.executable, env, url, model.parent)  # a folder the service does not serve
        said = [line for line in other.stderr.splitlines() if not line.startswith("waiting for visenc")]
        assert other.returncode != 0 and len(said) == 1 and "serves" in said[0], other.stderr[-3000:]
