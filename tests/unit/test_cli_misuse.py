"""``visenc serve`` misused: one line on stderr, an exit status of its own (``visenc.preflight``, listed in
docs/operations.md), found before torch is imported; byte sizes with units; flags in groups with their
defaults; an unknown ``VISENC_*`` variable warned about."""

from __future__ import annotations

import re
import socket
import subprocess
import sys

import pytest
from harness.paths import ROOT

from visenc import preflight
from visenc.cli import GROUPS, build_parser
from visenc.config import Settings
from visenc.process_memory import host_gpus

ENV = {"PYTHONPATH": f"{ROOT / 'service'}:{ROOT / 'clients'}", "PATH": "/usr/bin:/bin"}
#: runs ``visenc serve ARGV``, then says whether torch was imported on the way
PROBE = "import sys\nfrom visenc.cli import main\nrc = main(sys.argv[1:])\nprint('torch' in sys.modules)\nsys.exit(rc)"


def serve(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", PROBE, "serve", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={**ENV, **(env or {})},
    )


def refused(r: subprocess.CompletedProcess[str]) -> str:
    """The one line a refused start printed (it printed nothing else and imported no torch)."""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stdout.strip() in ("", "False"), "torch was imported before the refusal"
    return lines[0]


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize(
    ("argv", "code", "said"),
    [
        (["--process-memory-bytes", "-1"], preflight.EXIT_USAGE, "invalid --process-memory-bytes=-1"),
        (["--process-memory-bytes", "2XB"], preflight.EXIT_USAGE, "'2XB' is not a byte size"),
        (["--port", "abc"], preflight.EXIT_USAGE, "argument --port: invalid int value"),
        (["--bogus"], preflight.EXIT_USAGE, "unrecognized arguments: --bogus"),
        (["--device", "tpu"], preflight.EXIT_USAGE, "the device is auto, cpu, cuda or cuda:N"),
        (["--api-key", "short"], preflight.EXIT_USAGE, "keys must be at least 16 characters"),
        (["--model", "./no-such-folder"], preflight.EXIT_MODEL_UNAVAILABLE, "cannot serve ./no-such-folder: no such"),
        (["--model", "not a model"], preflight.EXIT_MODEL_UNAVAILABLE, "neither a built-in name"),
        (["--model", "/"], preflight.EXIT_MODEL_UNAVAILABLE, "the folder has no config.json"),
        (["--api-keys-file", "/no/such/file"], preflight.EXIT_BAD_PATH, "No such file or directory"),
        (["--download-dir", "/proc/no/such"], preflight.EXIT_BAD_PATH, "--download-dir /proc/no/such"),
        (["--uds", "/no/such/dir/visenc.sock"], preflight.EXIT_CANNOT_LISTEN, "cannot listen on /no/such/dir"),
        (["--tenant", "a weight=0"], preflight.EXIT_USAGE, "weight must be a positive number, got '0'"),
        (["--tenant", "a", "--tenant", "a weight=2"], preflight.EXIT_USAGE, "tenant 'a' is named twice"),
        (["--tenant-max-images", "0"], preflight.EXIT_USAGE, "invalid --tenant-max-images=0"),
        (["--tenant-max-queued-tokens", "0"], preflight.EXIT_USAGE, "invalid --tenant-max-queued-tokens=0"),
        (["--batch-floor", "1"], preflight.EXIT_USAGE, "invalid --batch-floor=1"),
    ],
)
def test_a_misuse_is_one_line_with_its_own_status(argv, code, said):
    r = serve("--port", "1", *argv) if "--port" not in argv else serve(*argv)
    assert r.returncode == code, r.stderr
    assert said in refused(r)


def test_a_key_file_naming_a_tenant_twice_stops_the_start(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("k" * 16 + ":a\ntenant a weight=2\ntenant a max_images=4\n")
    r = serve("--port", "1", "--api-keys-file", str(keys))
    assert r.returncode == preflight.EXIT_USAGE
    assert refused(r) == f"visenc: {keys}, line 3: tenant 'a' is named twice"


def test_a_busy_port_is_refused_before_the_model_loads(busy_port):
    r = serve("--port", str(busy_port))
    assert r.returncode == preflight.EXIT_CANNOT_LISTEN
    assert refused(r) == f"visenc: cannot listen on 127.0.0.1:{busy_port}: Address already in use"


def test_cuda_on_a_host_without_one_is_refused_at_once():
    if host_gpus() > 0:
        pytest.skip("this host has a CUDA GPU")
    r = serve("--device", "cuda", "--port", "1")
    assert r.returncode == preflight.EXIT_NO_DEVICE
    assert refused(r).startswith("visenc: --device cuda: this host has no CUDA GPU")


def test_cuda_where_torch_has_none_is_refused_before_the_model_loads():
    import torch

    from visenc.bootstrap import load_tower

    if torch.cuda.is_available():
        pytest.skip("this torch sees a CUDA GPU")
    with pytest.raises(preflight.StartError, match="this torch is") as e:
        load_tower(Settings(device="cuda:0"))
    assert e.value.code == preflight.EXIT_NO_DEVICE


def test_the_exit_statuses_differ_and_the_docs_list_each():
    codes = {n: v for n, v in vars(preflight).items() if n.startswith("EXIT_")}
    assert len(set(codes.values())) == len(codes)
    table = (ROOT / "docs" / "operations.md").read_text()
    for name, code in codes.items():
        assert re.search(rf"^\| {code} \| `{name}` \|", table, re.M), f"docs/operations.md lists no {name}"


def test_an_unknown_variable_is_warned_about_and_a_misspelt_one_named():
    r = serve("--max-batch-tokens", "0", env={"VISENC_MODLE": "x", "VISENC_PROXY_UPSTREAM": '["http://a"]'})
    warning, error = r.stderr.strip().splitlines()
    assert warning == "visenc: warning: VISENC_MODLE is not a setting and is ignored (did you mean VISENC_MODEL?)"
    assert error.startswith("visenc serve: invalid --max-batch-tokens=0")


@pytest.mark.parametrize(
    ("given", "n"),
    [("2GiB", 2 << 30), ("512MB", 512_000_000), ("1073741824", 1 << 30), (1 << 20, 1 << 20), ("1.5k", 1500)],
)
def test_byte_sizes_take_units(given, n, monkeypatch):
    assert Settings(process_memory_bytes=given).process_memory_bytes == n
    monkeypatch.setenv("VISENC_MAX_BODY_BYTES", str(given))
    assert Settings().max_body_bytes == n
    args = vars(build_parser().parse_args(["serve", "--cache-bytes", str(given)]))
    args.pop("command")
    assert Settings(**args).cache_bytes == n


def test_every_setting_is_in_one_group_and_shows_its_default(capsys):
    grouped = [name for names in GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(Settings.model_fields)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    assert [g for g in GROUPS if f"\n{g} options:\n" not in text] == []
    helps = [" ".join(h.split()) for h in re.split(r"\n  (?=--)", text)[1:]]
    assert len(helps) == len(Settings.model_fields)
    assert [h.split()[0] for h in helps if "default" not in h.lower() and "(required" not in h] == []
    assert [h.split()[0] for h in helps if h.lower().count("default") > 1 and "default: unset" in h] == []
    assert "(default: 256MiB; env VISENC_MAX_BODY_BYTES)" in " ".join(text.split())


def test_the_built_in_names_are_the_registry():
    from visenc.models.registry import built_in_names

    assert preflight.BUILT_IN == tuple(built_in_names())


@pytest.mark.parametrize("command", ["serve", "proxy"])
def test_every_byte_size_flag_takes_units(command):
    from visenc.proxy.settings import ProxySettings

    model = Settings if command == "serve" else ProxySettings
    names = [n for n in model.model_fields if n.endswith("_bytes")]
    extra = ["--upstream", "http://a"] if command == "proxy" else []
    for name in names:
        args = vars(build_parser().parse_args([command, *extra, f"--{name.replace('_', '-')}", "1GiB"]))
        args.pop("command")
        assert getattr(model(**args), name) == 1 << 30, name


def test_a_second_start_on_an_address_a_loading_visenc_holds_is_refused(tmp_path):
    first = preflight.listen(Settings(port=0))  # the first visenc, loading its model
    settings = Settings(port=first.getsockname()[1])
    second = preflight.listen(settings)  # a second one, started meanwhile
    try:
        with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", settings.port)):
            pass  # while they load, callers are refused (they fall back at once)
        preflight.start_listening(first, settings)
        with pytest.raises(preflight.StartError, match="Address already in use") as e:
            preflight.start_listening(second, settings)
        assert e.value.code == preflight.EXIT_CANNOT_LISTEN
    finally:
        first.close()
        second.close()
    uds = preflight.listen(Settings(uds=tmp_path / "v.sock"))
    try:
        with pytest.raises(preflight.StartError, match="another process listens there"):
            preflight.listen(Settings(uds=tmp_path / "v.sock")).close()
        assert (tmp_path / "v.sock").exists()
    finally:
        uds.close()


def test_no_variable_the_repository_names_is_warned_about():
    from visenc.proxy.settings import ProxySettings

    known = {f"VISENC_{n}".upper() for n in Settings.model_fields} | {"VISENC_API_KEY"}
    known |= {f"VISENC_PROXY_{n}".upper() for n in ProxySettings.model_fields}
    files = [ROOT / "README.md", ROOT / "Makefile", *(ROOT / "docs").glob("*.md"), *(ROOT / "deploy").rglob("*")]
    files += [*(ROOT / "clients" / "visenc_client").rglob("*.py")]
    named = {
        v: f.relative_to(ROOT)
        for f in files
        if f.is_file() and f.suffix in ("", ".md", ".py", ".yml", ".yaml", ".example", ".conf")
        for v in re.findall(r"\bVISENC_[A-Z0-9_]*[A-Z0-9]\b", f.read_text(errors="replace"))
        if v != "VISENC_MODLE"  # the docs' example of a misspelt one
    }
    warned = {line.split()[2]: named[line.split()[2]] for line in preflight.unknown_variables(named, known, "\0")}
    assert warned == {}


def test_the_proxy_on_a_busy_port_is_one_line(busy_port):
    r = subprocess.run(
        [sys.executable, "-m", "visenc.cli", "proxy", "--upstream", "http://127.0.0.1:9", "--port", str(busy_port)],
        capture_output=True,
        text=True,
        timeout=60,
        env=ENV,
    )
    assert r.returncode == preflight.EXIT_CANNOT_LISTEN, r.stderr
    assert r.stderr.strip() == f"visenc: cannot listen on 127.0.0.1:{busy_port}: Address already in use"
