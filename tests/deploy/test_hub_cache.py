"""Deployments name models by hub id: the compose stack and the Kubernetes manifests share one Hugging
Face cache (``HF_HOME``) across replicas, writable by the image's user, and take ``HF_TOKEN`` from a
file the repository never holds (compose) or from a Secret (Kubernetes)."""

from __future__ import annotations

import re

import pytest
import yaml
from harness.paths import ROOT

from visenc.models.hub import parse_spec

DEPLOY = ROOT / "deploy"


@pytest.fixture(scope="module")
def hf_home() -> str:
    """The image's HF_HOME, which the image creates owned by its user."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    (home,) = re.findall(r"HF_HOME=(\S+)", dockerfile)
    assert re.search(rf"install -d -o visenc -g visenc .*{re.escape(home)}", dockerfile)
    return home


def test_compose_serves_a_hub_id_from_a_shared_cache(hf_home: str) -> None:
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    visenc = compose["services"]["visenc"]
    m = re.fullmatch(r"\$\{VISENC_MODEL:-(.+)\}", visenc["environment"]["VISENC_MODEL"])
    assert m and parse_spec(m.group(1), None) is not None, "the default model is a hub id"
    (name,) = [v.split(":")[0] for v in visenc["volumes"] if v.split(":")[1] == hf_home]
    assert name in compose["volumes"]  # a named volume: every replica mounts the same
    assert visenc["deploy"]["replicas"] > 1
    assert visenc["env_file"] == [{"path": "./hf.env", "required": False}]
    example = (DEPLOY / "hf.env.example").read_text()
    assert re.search(r"^HF_TOKEN=$", example, re.M)
    assert "/deploy/hf.env" in (ROOT / ".gitignore").read_text().splitlines()  # the token never committed


def test_kubernetes_serves_a_hub_id_from_a_shared_cache(hf_home: str) -> None:
    docs = {
        (d["kind"], d["metadata"]["name"]): d
        for path in sorted((DEPLOY / "k8s").glob("*.yaml"))
        for d in yaml.safe_load_all(path.read_text())
        if d and d["kind"] != "Kustomization"
    }
    spec = docs[("Deployment", "visenc")]["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert parse_spec(env["VISENC_MODEL"]["value"], None) is not None
    ref = env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]
    created = f"create secret generic {ref['name']} --from-literal={ref['key']}="  # out of band, documented
    assert ref["optional"] is True and created in (DEPLOY / "k8s" / "kustomization.yaml").read_text()
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "hf-cache"]
    assert mount["mountPath"] == hf_home
    (volume,) = [v for v in spec["volumes"] if v["name"] == "hf-cache"]
    claim = docs[("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # one cache for every replica
    assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsGroup"]  # writable by the pod


#: the first start of Qwen2.5-VL-72B: its vision weights (1.40 GB, ``docs/models.md``) fetched at 50 MB/s,
#: then the load (the file's checksum, the tower built and moved to the device), then a 32-block warm-up
FETCH_BYTES, FETCH_BYTES_PER_S, LOAD_S, BLOCKS = 1.40e9, 50e6, 60.0, 32


def first_start_s(env: dict[str, str]) -> tuple[float, float]:
    """(until ``/healthz`` answers, until ``/readyz`` does) for a first start with the settings
    ``env`` (``VISENC_*``; the defaults otherwise): the whole hub wait, the fetch, the load, the warm-up."""
    from visenc.config import Settings
    from visenc.models import compiled

    def setting(name: str) -> float | None:
        value = env.get(f"VISENC_{name.upper()}")
        found = re.fullmatch(r"\$\{\w+:-(.+)\}|(.+)", str(value)) if value is not None else None
        return float(next(g for g in found.groups() if g)) if found else Settings.model_fields[name].default

    warm_up = setting("warm_up_timeout_s") or compiled.warm_up_limit_s(BLOCKS)
    loaded = float(setting("hub_wait_s") or 0) + FETCH_BYTES / FETCH_BYTES_PER_S + LOAD_S
    return loaded, loaded + warm_up


def seconds(duration: str) -> float:
    """A compose duration (``90s``, ``15m``, ``1h30m``) in seconds."""
    units = {"h": 3600, "m": 60, "s": 1}
    parts = re.findall(r"(\d+)([hms])", duration)
    assert "".join(n + u for n, u in parts) == duration, duration
    return float(sum(int(n) * units[u] for n, u in parts))


def test_a_first_start_of_a_72b_model_outlasts_no_probe() -> None:
    """No probe ends (k8s) or counts unhealthy (compose: Prometheus and vLLM wait for it) a first start
    that waits out a busy hub, fetches a 72B model's vision weights at 50 MB/s, loads and warms up."""
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]["visenc"]
    _, ready = first_start_s({k: str(v) for k, v in compose["environment"].items()})
    assert "/readyz" in " ".join(compose["healthcheck"]["test"])
    assert seconds(compose["healthcheck"]["start_period"]) >= ready, ready
    deployment = yaml.safe_load((DEPLOY / "k8s" / "deployment.yaml").read_text())
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    loaded, ready = first_start_s({e["name"]: e["value"] for e in c["env"] if "value" in e})
    probe = c["startupProbe"]
    allowed = probe.get("initialDelaySeconds", 0) + probe["periodSeconds"] * probe["failureThreshold"]
    assert probe["httpGet"]["path"] == "/healthz" and allowed >= ready, (allowed, loaded, ready)
    assert deployment["spec"]["progressDeadlineSeconds"] >= ready  # a rollout is not marked failed meanwhile
