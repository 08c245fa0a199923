"""Deployments name models by hub id: the compose stack and the Kubernetes manifests share one Hugging
Face cache (``HF_HOME``) across replicas, writable by the image's user, and take ``HF_TOKEN`` from a
file the repository never holds (compose) or from a Secret (Kubernetes)."""

from __future__ import annotations

import re

import pytest
import yaml
from tests.support.paths import ROOT

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
    assert ref["optional"] is True and ref["key"] in docs[("Secret", ref["name"])]["stringData"]
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "hf-cache"]
    assert mount["mountPath"] == hf_home
    (volume,) = [v for v in spec["volumes"] if v["name"] == "hf-cache"]
    claim = docs[("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # one cache for every replica
    assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsGroup"]  # writable by the pod
