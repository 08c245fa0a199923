"""deploy/k8s: every manifest parses, and probes, ports, labels, selectors and secrets agree."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from harness.paths import ROOT

K8S = ROOT / "deploy" / "k8s"


@pytest.fixture(scope="module")
def docs() -> dict[tuple[str, str], dict]:
    out: dict[tuple[str, str], dict] = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is None:
                continue
            assert {"apiVersion", "kind"} <= set(doc), path.name
            if doc["kind"] == "Kustomization":
                continue
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in out, f"duplicate {key}"
            out[key] = doc
    return out


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def container_ports(deploy: dict) -> dict[str, int]:
    (c, *_) = deploy["spec"]["template"]["spec"]["containers"]
    return {p["name"]: p["containerPort"] for p in c["ports"]}


def test_kustomization_lists_every_manifest():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kust["resources"]) == files


def test_deployments_select_their_pods_and_services_select_deployments(docs):
    deployments = {n: d for (k, n), d in docs.items() if k == "Deployment"}
    assert {"visenc", "visenc-redis"} <= set(deployments)
    for name, d in deployments.items():
        pod_labels = d["spec"]["template"]["metadata"]["labels"]
        assert selects(d["spec"]["selector"]["matchLabels"], pod_labels), name
    for (kind, name), svc in docs.items():
        if kind != "Service":
            continue
        targets = [
            d
            for d in deployments.values()
            if selects(svc["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])
        ]
        assert len(targets) == 1, f"Service {name} selects {len(targets)} deployments"
        ports = container_ports(targets[0])
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports, f"Service {name}: targetPort {p['targetPort']} is not a container port"


def test_visenc_probes_resources_and_gpu_note(docs):
    d = docs[("Deployment", "visenc")]
    spec = d["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    ports = container_ports(d)
    assert ports == {"http": 8000}
    env = {e["name"]: e for e in c["env"]}
    assert env["VISENC_PORT"]["value"] == str(ports["http"])  # the server listens on the probed port
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert c["startupProbe"]["httpGet"]["path"] == "/healthz"
    # the image runs as uid 10001 (Dockerfile USER); the pod insists on a non-root user
    assert spec["securityContext"]["runAsNonRoot"] is True
    user = [line.split()[1] for line in (ROOT / "Dockerfile").read_text().splitlines() if line.startswith("USER ")]
    assert user == [f"{spec['securityContext']['runAsUser']}:{spec['securityContext']['runAsGroup']}"]
    assert "command" not in c and "args" not in c  # the image's own CMD runs
    res = c["resources"]
    assert res["requests"]["cpu"] and res["requests"]["memory"] and res["limits"]["memory"]
    text = (K8S / "deployment.yaml").read_text()
    assert "# nvidia.com/gpu: 1" in text and "device plugin" in text
    assert d["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    # drained by uvicorn's 30 s graceful shutdown before the kubelet kills it
    assert spec["terminationGracePeriodSeconds"] > 30


def created_secrets() -> dict[str, set[str]]:
    """The Secrets the kustomization tells the user to create (``kubectl create secret``), with their keys."""
    text = (K8S / "kustomization.yaml").read_text()
    out: dict[str, set[str]] = {}
    for name, literals in re.findall(r"create secret generic (\S+)((?: --from-literal=\w+=\S+)+)", text):
        out.setdefault(name, set()).update(re.findall(r"--from-literal=(\w+)=", literals))
    return out


def secret_refs(docs) -> list[tuple[str, dict]]:
    out = []
    for (kind, name), d in docs.items():
        if kind == "Deployment":
            for c in d["spec"]["template"]["spec"]["containers"]:
                out += [
                    (name, e["valueFrom"]["secretKeyRef"]) for e in c["env"] if "secretKeyRef" in e.get("valueFrom", {})
                ]
    return out


def test_no_secret_ships_so_applying_never_overwrites_one(docs):
    """A shipped Secret would be a usable placeholder (a password everyone knows), and ``kubectl apply -k``
    would write it back over the one the user made: the Secrets are created out of band, each key every
    manifest reads from them, with a random password."""
    assert [key for key in docs if key[0] == "Secret"] == []
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert "secretGenerator" not in kust
    created = created_secrets()
    assert set(created) == {"visenc-redis", "visenc-hf"}
    for deployment, ref in secret_refs(docs):
        assert ref["key"] in created.get(ref["name"], set()), f"{deployment} reads {ref} that no command creates"
    assert '--from-literal=password="$(openssl rand -hex 24)"' in (K8S / "kustomization.yaml").read_text()
    ops = (ROOT / "docs" / "operations.md").read_text()
    assert 'create secret generic visenc-redis --from-literal=password="$(openssl rand -hex 24)"' in ops


def test_redis_url_carries_the_password_redis_runs_with(docs):
    (c,) = docs[("Deployment", "visenc")]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in c["env"]}
    ref = env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "visenc-redis", "key": "password"}
    names = [e["name"] for e in c["env"]]
    assert names.index("REDIS_PASSWORD") < names.index("VISENC_REDIS_URL")  # Kubernetes expands earlier ones only
    url = env["VISENC_REDIS_URL"]["value"]
    assert url.startswith("redis://:$(REDIS_PASSWORD)@")  # visenc's URL carries the password Redis runs with
    host, port = url.split("@")[1].split("/")[0].split(":")
    svc = docs[("Service", host)]
    assert int(port) in {p["port"] for p in svc["spec"]["ports"]}
    spec = docs[("Deployment", "visenc-redis")]["spec"]["template"]["spec"]
    (redis,) = spec["containers"]
    assert redis["command"] == ["redis-server", "/usr/local/etc/redis/redis.conf"]
    flags = dict(zip(redis["args"][::2], redis["args"][1::2]))
    assert flags["--requirepass"] == "$(REDIS_PASSWORD)" and flags["--maxmemory"]
    redis_env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in redis["env"]}
    assert redis_env["REDIS_PASSWORD"] == ref
    assert "REDIS_PASSWORD" in " ".join(redis["readinessProbe"]["exec"]["command"])
    (mount,) = redis["volumeMounts"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert mount["mountPath"] == "/usr/local/etc/redis"
    conf = docs[("ConfigMap", volume["configMap"]["name"])]["data"]["redis.conf"]
    assert conf == (ROOT / "deploy" / "redis" / "redis.conf").read_text()  # the shipped file, unchanged


def test_visenc_pods_have_a_sized_dev_shm(docs):
    spec = docs[("Deployment", "visenc")]["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert volume["emptyDir"]["medium"] == "Memory" and volume["emptyDir"]["sizeLimit"] == "1Gi"


def test_service_monitor_scrapes_the_visenc_service(docs):
    sm = docs[("ServiceMonitor", "visenc")]
    svc = docs[("Service", "visenc")]
    assert selects(sm["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"])
    (ep,) = sm["spec"]["endpoints"]
    assert ep["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert ep["path"] == "/metrics"
    pdb = docs[("PodDisruptionBudget", "visenc")]
    assert selects(
        pdb["spec"]["selector"]["matchLabels"], docs[("Deployment", "visenc")]["spec"]["template"]["metadata"]["labels"]
    )


def test_prometheus_rule_equals_the_compose_alerts(docs):
    rules = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())
    assert docs[("PrometheusRule", "visenc")]["spec"]["groups"] == rules["groups"]


def test_kustomize_renders(docs):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (optional: the manifests are still parsed above)")
    done = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    items = [d for d in yaml.safe_load_all(done.stdout) if d]
    assert len(items) == len(docs)
    deployment = next(i for i in items if i["kind"] == "Deployment" and i["metadata"]["name"] == "visenc")
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    assert c["image"] == "visenc:cpu"  # the images transformer applied
    assert all(i["metadata"].get("namespace") == "visenc" for i in items if i["kind"] != "Namespace")
    assert [i["metadata"]["name"] for i in items if i["kind"] == "Secret"] == []  # applying writes no Secret


def test_the_compile_caches_are_on_a_volume(docs):
    """The image's inductor and Triton cache folders sit on a pod volume, so a restarted container
    reuses them."""
    text = (ROOT / "Dockerfile").read_text()
    caches = [Path(m) for m in re.findall(r"(?:TORCHINDUCTOR|TRITON)_CACHE_DIR=(\S+)", text)]
    assert len(caches) == 2
    spec = docs[("Deployment", "visenc")]["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    volumes = {v["name"] for v in spec["volumes"]}
    mounts = [(m["name"], Path(m["mountPath"])) for m in c["volumeMounts"]]
    assert any(name in volumes and all(p.is_relative_to(path) for p in caches) for name, path in mounts), mounts
