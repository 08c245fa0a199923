"""Every command in the README and docs/ runs as written.

The commands are read out of the Markdown (fenced ``bash`` blocks) and ``python``
snippets, so a doc that drifts from the code fails here:

* ``make T``: the target exists (``make -n``);
* ``visenc serve ...``: the flags parse and the settings validate (``visenc proxy ...``: the flags parse);
* ``python SCRIPT ...`` / ``loadtest/run ...``: the script exists and its (sub)command takes ``--help``;
* ``docker`` / ``kubectl``: the files they name exist (no engine or cluster here);
* Python snippets (and ``python - <<PY`` heredocs): run for real against a live
  ``visenc serve`` (and a real Redis), with the free names a snippet leaves to
  the reader (``images``, ``png``, ...) given test values; where a ``text`` block
  follows one that prints, it prints exactly that;
* a bash block with ``curl``: run by bash as written against the live service; every
  line of the ``text`` block after it is a line of its output.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest
from harness.images import png_bytes
from harness.paths import ROOT
from harness.processes import serve_process

from visenc.cli import build_parser
from visenc.config import Settings

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: commands that install or reach what no test machine has (a registry, a Docker engine, a cluster)
NOT_RUN = ("pip install", "python -m venv", "docker run", "kubectl -n")


def blocks(lang: str) -> list[tuple[str, str]]:
    out = []
    for doc in DOCS:
        for m in re.finditer(rf"```{lang}\n(.*?)```", doc.read_text(), re.S):
            out.append((doc.name, m.group(1)))
    return out


def shown_output(doc: str, code: str) -> str | None:
    """The ``text`` block that comes next after ``code`` in ``doc``, if no other block comes between."""
    text = next(d for d in DOCS if d.name == doc).read_text()
    rest = text[text.index(code) + len(code) :].split("```", 1)[1]
    m = re.match(r"\n*[^`]*?```text\n(.*?)```", rest, re.S)
    return m.group(1) if m else None


def commands() -> list[tuple[str, str]]:
    """Shell commands of every bash block; a ``python - <<'PY'`` heredoc comes as one command."""
    out = []
    for doc, text in blocks("bash"):
        if "curl " in text:
            out.append((doc, "bash-script\n" + text))
            continue
        lines = iter(text.splitlines())
        for line in lines:
            line = re.sub(r"\s+#.*$", "", line).strip().rstrip("&").strip()
            if not line or line.startswith("#"):
                continue
            if "<<'PY'" in line:
                body = []
                for more in lines:
                    if more.strip() == "PY":
                        break
                    body.append(more)
                out.append((doc, "python-heredoc\n" + "\n".join(body)))
            else:
                out.append((doc, line))
    return out


COMMANDS = commands()


def test_the_docs_have_commands():
    assert any(c == "make run" for _, c in COMMANDS) and any(c == "make test" for _, c in COMMANDS)


@pytest.mark.parametrize(("doc", "command"), [c for c in COMMANDS if c[1].startswith("make ")])
def test_make_targets_exist(doc, command):
    r = subprocess.run(["make", "-n", *shlex.split(command)[1:]], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, f"{doc}: {command}: {r.stderr}"


@pytest.mark.parametrize(("doc", "command"), [c for c in COMMANDS if c[1].startswith("visenc serve")])
def test_serve_commands_parse_and_validate(doc, command):
    args = vars(build_parser().parse_args(shlex.split(command)[1:]))
    args.pop("command")
    Settings(**args)


@pytest.mark.parametrize(("doc", "command"), [c for c in COMMANDS if c[1].startswith("visenc proxy")])
def test_proxy_commands_parse(doc, command):
    args = vars(build_parser().parse_args(shlex.split(command)[1:]))
    assert args["command"] == "proxy" and args["upstream"]


def _help_argv(command: str) -> list[str]:
    argv = shlex.split(command)
    if argv[0] == "python":
        argv = [sys.executable, *argv[1:]]
    script = argv[1] if argv[0] == sys.executable else argv[0]
    assert (ROOT / script).exists(), f"{script} does not exist"
    head = argv[: 2 if argv[0] == sys.executable else 1]
    rest = argv[len(head) :]
    sub = [rest[0]] if rest and not rest[0].startswith("-") and "/" not in rest[0] else []
    return [*head, *sub, "--help"]


@pytest.mark.parametrize(
    ("doc", "command"),
    [c for c in COMMANDS if re.match(r"(python \S+\.py|loadtest/)", c[1])],
)
def test_scripts_exist_and_take_their_options(doc, command):
    r = subprocess.run(_help_argv(command), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{doc}: {command}: {r.stderr[-2000:]}"
    known = r.stdout
    if command.startswith("loadtest/"):  # the runner hands the scenario options on to the locustfile
        known += (ROOT / "loadtest" / "locustfile.py").read_text()
    for option in re.findall(r"\s(--[a-z][a-z-]+)", " " + command):
        assert option in known, f"{doc}: {command}: {option} is not an option of {_help_argv(command)}"


@pytest.mark.parametrize(("doc", "command"), [c for c in COMMANDS if c[1].startswith(("docker", "kubectl"))])
def test_container_commands_name_real_files(doc, command):
    if command.startswith(NOT_RUN):
        pytest.skip(f"{command!r} needs a Docker engine or a cluster (none here)")
    argv = shlex.split(command)
    for flag in ("-f", "-k"):
        if flag in argv:
            assert (ROOT / argv[argv.index(flag) + 1]).exists(), command
    if command.startswith("docker build"):
        dockerfile = (ROOT / "Dockerfile").read_text()
        for arg in re.findall(r"--build-arg (\w+)=", command):
            assert re.search(rf"^ARG {arg}\b", dockerfile, re.M), f"{command}: no ARG {arg} in the Dockerfile"


@pytest.mark.parametrize(("doc", "command"), [c for c in COMMANDS if c[1].startswith(". ")])
def test_activated_venvs_are_those_make_builds(doc, command):
    """``. .venv/bin/activate``: the folder ``make run`` installs into (``.venv-vllm``: ``make vllm``)."""
    makefile = (ROOT / "Makefile").read_text()
    venv = shlex.split(command)[1].removesuffix("/bin/activate")
    assert re.search(rf"^(VENV|VLLM_VENV) \?= {re.escape(venv)}$", makefile, re.M), f"{doc}: {command}"


def test_make_run_says_how_to_run_what_it_installed():
    """The README's commands (``visenc``, ``python`` with the project) run in ``.venv``: ``make run`` prints
    the line that activates it, the line the README shows."""
    r = subprocess.run(["make", "-n", "run"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and "'. .venv/bin/activate'" in r.stdout, r.stdout
    assert "```bash\n. .venv/bin/activate\n```" in (ROOT / "README.md").read_text()


def test_every_command_is_checked_somewhere():
    checked = (
        ". ",
        "make ",
        "visenc serve",
        "visenc proxy",
        "python ",
        "loadtest/",
        "docker",
        "kubectl",
        "pip install",
        "python-heredoc",
        "bash-script",
        "vllm serve",  # these two: tests/with_vllm/test_vllm_docs_commands.py, with vLLM's parser
        ".venv-vllm/bin/python -m vllm.",
    )
    unchecked = [c for _, c in COMMANDS if not c.startswith(checked)]
    assert unchecked == []


@pytest.fixture(scope="module")
def live(redis_url, tmp_path_factory):
    folder = tmp_path_factory.mktemp("docs")
    (folder / "screenshot.png").write_bytes(png_bytes(1, 320, 200))
    (folder / "docs").mkdir()
    (folder / "docs" / "screenshot.png").write_bytes((ROOT / "docs" / "screenshot.png").read_bytes())
    with serve_process("--max-wait-ms", "1", "--redis-url", redis_url) as url:
        yield url, folder


def _run_snippet(code: str, live, redis_url: str) -> str:
    url, folder = live
    code = re.sub(r"http://(127\.0\.0\.1|localhost|visenc):8000", url, code)
    code = re.sub(r"redis://:PASSWORD@cache:6379/0", redis_url, code)
    prelude = (
        "import numpy as np, torch\n"
        "from harness.images import png_bytes\n"
        "images = [png_bytes(i, 64 + 28 * i, 64) for i in range(3)]\n"
        "text_lens = [5, 3, 7]\n"
        "png = png_bytes(9, 320, 200)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", prelude + code],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": f"{ROOT}:{ROOT / 'service'}:{ROOT / 'clients'}", "PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == 0, f"{code}\n{r.stderr[-3000:]}"
    return r.stdout


@pytest.mark.parametrize(
    ("doc", "code"),
    [*blocks("python"), *((d, c.split("\n", 1)[1]) for d, c in COMMANDS if c.startswith("python-heredoc"))],
)
def test_python_snippets_run_against_a_live_service(doc, code, live, redis_url):
    shown = shown_output(doc, code) if "print(" in code else None
    if "hidden" in code and "hidden =" not in code:
        code = "hidden = 256\n" + code  # the served tower's row width (the default tower's)
    printed = _run_snippet(code, live, redis_url)
    if shown is not None:
        assert printed == shown, f"{doc}: the snippet printed {printed!r}, the doc shows {shown!r}"


@pytest.mark.parametrize(("doc", "script"), [(d, c.split("\n", 1)[1]) for d, c in COMMANDS if c.startswith("bash-")])
def test_curl_blocks_run_against_a_live_service(doc, script, live):
    url, folder = live
    r = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script.replace("http://127.0.0.1:8000", url)],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, f"{script}\n{r.stderr[-2000:]}"
    printed = [line.rstrip("\r") for line in r.stdout.splitlines()]
    shown = shown_output(doc, script)
    assert shown is not None, f"{doc}: no output shown after {script!r}"
    missing = [line for line in shown.splitlines() if line not in printed]
    assert missing == [], f"{doc}: shown but not printed: {missing}; printed: {printed}"


def test_no_snippet_needs_this_repository_on_its_path():
    """A reader runs a snippet from anywhere: none imports the repository's test helpers."""
    snippets = [c for _, c in blocks("python")] + [c for _, c in COMMANDS if c.startswith("python-heredoc")]
    assert [c for c in snippets if re.search(r"^\s*(from|import) tests\b", c, re.M)] == []
