"""deploy/k8s/autoscaling: the KEDA ScaledObject and the autoscaling/v2 HPA validate against their schemas
(shipped in tests/deploy/data), scale the visenc Deployment on one query, and that query is promtool-tested."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness.paths import ROOT

AUTOSCALING = ROOT / "deploy" / "k8s" / "autoscaling"
PROMETHEUS = ROOT / "deploy" / "prometheus"
DATA = Path(__file__).with_name("data")


def load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def problems(value: Any, schema: dict[str, Any], defs: dict[str, Any], at: str = "") -> list[str]:
    """Where ``value`` breaks ``schema`` (the OpenAPI subset the schema files use); an object's unknown fields
    are refused, as ``kubectl apply --validate=strict`` refuses them."""
    if "$ref" in schema:
        return problems(value, defs[schema["$ref"]], defs, at)
    if "anyOf" in schema:
        tried = [problems(value, s, defs, at) for s in schema["anyOf"]]
        return [] if any(not t for t in tried) else [f"{at}: matches none of {schema['anyOf']}"]
    kinds = {"object": dict, "array": list, "string": str, "boolean": bool, "integer": int, "number": (int, float)}
    kind = schema.get("type")
    if kind is not None and (not isinstance(value, kinds[kind]) or (kind == "integer" and isinstance(value, bool))):
        return [f"{at}: {value!r} is not {kind}"]
    out = []
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{at}: {value!r} not in {schema['enum']}")
    if "minimum" in schema and value < schema["minimum"]:
        out.append(f"{at}: {value} < {schema['minimum']}")
    if "minLength" in schema and len(value) < schema["minLength"]:
        out.append(f"{at}: shorter than {schema['minLength']}")
    if "pattern" in schema and not re.search(schema["pattern"], value):
        out.append(f"{at}: {value!r} does not match {schema['pattern']}")
    if kind == "array":
        if len(value) < schema.get("minItems", 0):
            out.append(f"{at}: fewer than {schema['minItems']} items")
        for i, item in enumerate(value):
            out += problems(item, schema.get("items", {}), defs, f"{at}[{i}]")
    if kind == "object":
        out += [f"{at}.{k}: required" for k in schema.get("required", []) if k not in value]
        props, extra = schema.get("properties"), schema.get("additionalProperties")
        for k, v in value.items():
            if props is not None and k in props:
                out += problems(v, props[k], defs, f"{at}.{k}")
            elif extra is not None:
                out += problems(v, extra, defs, f"{at}.{k}")
            elif props is not None:
                out.append(f"{at}.{k}: unknown field")
    return out


def validate(doc: dict[str, Any], schema_file: str) -> list[str]:
    spec = load(DATA / schema_file)
    if (doc.get("apiVersion"), doc.get("kind")) != (spec["apiVersion"], spec["kind"]):
        return [f"{doc.get('apiVersion')}/{doc.get('kind')} is not {spec['apiVersion']}/{spec['kind']}"]
    found = problems(doc, spec["schema"], spec.get("defs", {}))
    if spec["kind"] == "ScaledObject":
        for trigger in doc.get("spec", {}).get("triggers", []):
            if trigger.get("type") == "prometheus":
                meta, rule = trigger.get("metadata", {}), spec["prometheusMetadata"]
                found += [f"prometheus trigger: {k} missing" for k in rule["required"] if k not in meta]
                found += [
                    f"prometheus trigger: unknown {k}" for k in meta if k not in rule["required"] + rule["optional"]
                ]
    return found


@pytest.fixture(scope="module")
def scaled_object() -> dict[str, Any]:
    return load(AUTOSCALING / "keda" / "scaledobject.yaml")


@pytest.fixture(scope="module")
def hpa() -> dict[str, Any]:
    return load(AUTOSCALING / "hpa" / "hpa.yaml")


def test_the_manifests_validate_against_their_schemas(scaled_object, hpa):
    assert validate(scaled_object, "keda_scaledobject.yaml") == []
    assert validate(hpa, "hpa_autoscaling_v2.yaml") == []


@pytest.mark.parametrize(
    ("path", "value", "said"),
    [
        (["spec", "triggers"], [], "fewer than 1 items"),
        (["spec", "maxReplicaCount"], 0, "0 < 1"),
        (["spec", "minReplicaCount"], "1", "is not integer"),
        (["spec", "scaleTargetRef", "nmae"], "visenc", "unknown field"),
        (["spec", "triggers", 0, "metadata", "threshold"], 0.8, "is not string"),
        (["spec", "triggers", 0, "metadata", "treshold"], "0.8", "unknown treshold"),
    ],
)
def test_a_broken_scaled_object_is_refused(scaled_object, path, value, said):
    """The check can fail: each manifest broken in one place is refused, naming the place."""
    broken = copy.deepcopy(scaled_object)
    node = broken
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    assert any(said in p for p in validate(broken, "keda_scaledobject.yaml"))


def test_a_broken_hpa_is_refused(hpa):
    broken = copy.deepcopy(hpa)
    del broken["spec"]["maxReplicas"]
    broken["spec"]["metrics"][0]["external"]["target"]["averageValue"] = "0.8 devices"
    found = validate(broken, "hpa_autoscaling_v2.yaml")
    assert ".spec.maxReplicas: required" in found and any("averageValue" in p for p in found)


def test_both_scale_the_deployment_on_the_recorded_demand(scaled_object, hpa):
    deployments = [d for d in yaml.safe_load_all((ROOT / "deploy/k8s/deployment.yaml").read_text()) if d]
    (visenc,) = [d for d in deployments if d["kind"] == "Deployment" and d["metadata"]["name"] == "visenc"]
    target = {"apiVersion": visenc["apiVersion"], "kind": "Deployment", "name": "visenc"}
    assert scaled_object["spec"]["scaleTargetRef"] == target and hpa["spec"]["scaleTargetRef"] == target
    (trigger,) = scaled_object["spec"]["triggers"]
    adapter = load(AUTOSCALING / "hpa" / "prometheus-adapter-rules.yaml")["external"][0]
    assert trigger["metadata"]["query"] == adapter["metricsQuery"]  # one query, both ways
    assert hpa["spec"]["metrics"][0]["external"]["metric"]["name"] == adapter["name"]["as"]
    assert (
        float(trigger["metadata"]["threshold"]) == 0.8
        and hpa["spec"]["metrics"][0]["external"]["target"]["averageValue"] == "800m"
    )
    recorded = {r["record"] for g in load(PROMETHEUS / "autoscaling.yml")["groups"] for r in g["rules"]}
    assert set(re.findall(r"visenc:[a-z_:]+", trigger["metadata"]["query"])) <= recorded


def test_the_components_and_the_rule_they_scale_on_equal_the_compose_one():
    for overlay, manifest in (("keda", "scaledobject.yaml"), ("hpa", "hpa.yaml")):
        component = load(AUTOSCALING / overlay / "kustomization.yaml")
        assert component["kind"] == "Component" and component["resources"] == [manifest]
    assert "prometheusrule-autoscaling.yaml" in load(ROOT / "deploy/k8s/kustomization.yaml")["resources"]
    rule = load(ROOT / "deploy/k8s/prometheusrule-autoscaling.yaml")
    assert rule["spec"] == load(PROMETHEUS / "autoscaling.yml")
    assert "autoscaling.yml" in load(PROMETHEUS / "prometheus.yml")["rule_files"]


@pytest.mark.parametrize("args", [["check", "rules", "autoscaling.yml"], ["test", "rules", "autoscaling_test.yml"]])
def test_promtool_checks_the_scaling_query(args):
    exe = shutil.which("promtool")
    if exe is None:
        pytest.fail("promtool is not installed (make test installs Debian's prometheus package)")
    done = subprocess.run([exe, *args], cwd=PROMETHEUS, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "SUCCESS" in done.stdout + done.stderr, done.stdout + done.stderr


@pytest.mark.parametrize("overlay", ["keda", "hpa"])
def test_kustomize_renders_deploy_k8s_with_the_component(overlay, tmp_path):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the components' files are checked above, not their rendering")
    (tmp_path / "deploy").symlink_to(ROOT / "deploy")
    mine = {"resources": ["../deploy/k8s"], "components": [f"../deploy/k8s/autoscaling/{overlay}"]}
    (tmp_path / "overlay").mkdir()
    (tmp_path / "overlay" / "kustomization.yaml").write_text(yaml.safe_dump(mine))
    done = subprocess.run([kubectl, "kustomize", str(tmp_path / "overlay")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(done.stdout) if d}
    scaler = docs[("ScaledObject" if overlay == "keda" else "HorizontalPodAutoscaler", "visenc")]
    assert scaler["metadata"]["namespace"] == docs[("Deployment", "visenc")]["metadata"]["namespace"]
    assert ("PrometheusRule", "visenc-autoscaling") in docs
