"""The dashboard and the alert rules only name metrics the service really exposes; promtool accepts
the rules and the Prometheus config, and the rules' own unit tests pass."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness.images import png_bytes
from harness.paths import ROOT
from prometheus_client.parser import text_string_to_metric_families
from tests.support.api import encode_json, running_app

from visenc.models.base import VisionTower

DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "visenc.json"
PROMETHEUS = DEPLOY / "prometheus"

#: labels Prometheus attaches to every scraped series (not in the exposition)
TARGET_LABELS = {"instance", "job"}
#: series Prometheus makes itself
SYNTHETIC = {"up"}

_NAME = re.compile(r"\b(visenc_[a-z0-9_]+)\b")
_SELECTOR = re.compile(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}")
_MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)")


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        exprs.append(var["query"]["query"] if isinstance(var["query"], dict) else var["query"])
    return exprs


def rule_exprs() -> list[str]:
    exprs = []
    for name in ("alerts.yml", "autoscaling.yml"):
        rules = yaml.safe_load((PROMETHEUS / name).read_text())
        exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    return exprs


class FailingTower:
    """The tiny tower, except that the next ``fail_next`` forwards raise."""

    def __init__(self, tower: VisionTower) -> None:
        self._tower = tower
        self.fail_next = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tower, name)

    def forward(self, batch: Any) -> Any:
        if self.fail_next > 0:
            self.fail_next -= 1
            raise RuntimeError("injected forward failure")
        return self._tower.forward(batch)


@pytest.fixture(scope="module")
def exposition(tiny_tower) -> Iterator[dict[str, set[str]]]:
    """Sample name → label names, scraped from the real app after exercising every labelled metric."""
    import asyncio

    tower = FailingTower(tiny_tower)
    images = [png_bytes(700 + i, 896, 1120) for i in range(5)]  # the tower's largest: L1 must hold one
    layout = tiny_tower.layout(896, 1120)
    entry_bytes = layout.num_tokens * tiny_tower.hidden_size * 4

    async def go() -> str:
        # an L1 budget of ~2 entries so that 5 images evict
        async with running_app(tower, cache_bytes=int(entry_bytes * 2.5)) as client:  # type: ignore[arg-type]
            r = await encode_json(client, [{"data": d} for d in images])
            assert [it["status"] for it in r.json()["items"]] == ["ready"] * 5
            last = r.json()["items"][-1]["hash"]
            assert (await encode_json(client, [{"hash": last}])).json()["items"][0]["status"] == "ready"  # hit
            assert (await client.get(f"/v1/embeddings/{last}", params={"end": 2})).status_code == 200
            assert (await client.post("/v1/embeddings/fetch", json={"ranges": [{"hash": last}]})).status_code == 200
            assert (await client.get("/v1/embeddings/" + "0" * 64)).status_code == 404
            r = await encode_json(client, [{"hash": "nothex"}])
            assert r.json()["items"][0]["reason"] == "invalid_hash"
            tower.fail_next = 1
            r = await encode_json(client, [{"data": png_bytes(799, 64, 64)}])
            assert r.status_code == 503
            return (await client.get("/metrics")).text

    text = asyncio.run(go())
    samples: dict[str, set[str]] = {}
    declared: set[str] = set()
    for family in text_string_to_metric_families(text):
        declared.add(family.name)
        for s in family.samples:
            samples.setdefault(s.name, set()).update(s.labels)
    assert samples["visenc_cache_evictions_total"] == {"tier"}  # the budget above did evict
    assert "visenc_encode_failures_total" in samples
    yield {"samples": samples, "declared": declared}  # type: ignore[misc]


def test_every_metric_in_the_dashboard_and_the_rules_is_exposed(exposition):
    samples: dict[str, set[str]] = exposition["samples"]  # type: ignore[assignment]
    exprs = [("dashboard", e) for e in dashboard_exprs()] + [("alerts.yml", e) for e in rule_exprs()]
    referenced: set[str] = set()
    problems = []
    for where, expr in exprs:
        names = set(_NAME.findall(expr))
        referenced |= names
        for name in names:
            if name in samples:
                continue
            problems.append(f"{where}: {name} is not in /metrics ({expr!r})")
        for name, matchers in _SELECTOR.findall(expr):
            if name not in samples and name not in SYNTHETIC:
                problems.append(f"{where}: selector of unknown series {name}")
            known = samples.get(name)
            if known is not None:
                for label in _MATCHER.findall(matchers):
                    if label not in known | TARGET_LABELS:
                        problems.append(f"{where}: {name} has no label {label!r} ({expr!r})")
        metric_labels = set().union(*(samples.get(n, set()) for n in names)) | TARGET_LABELS | {"le"}
        for group in _GROUPING.findall(expr):
            for label in filter(None, (g.strip() for g in group.split(","))):
                if label not in metric_labels:
                    problems.append(f"{where}: grouping by {label!r}, which none of {sorted(names)} has")
    assert not problems, "\n".join(problems)
    # the dashboard covers what the issue asks for
    for needed in (
        "visenc_requests_total",
        "visenc_request_duration_seconds_bucket",
        "visenc_queue_depth",
        "visenc_batch_size_images_bucket",
        "visenc_cache_lookups_total",
        "visenc_bytes_served_total",
        "visenc_errors_total",
        "visenc_redis_errors_total",
        "visenc_encode_failures_total",
        "visenc_tenant_device_tokens_total",
        "visenc_refusals_total",
        "visenc_device_busy_ratio",
        "visenc_queued_device_seconds",
        "visenc_oldest_waiting_seconds",
    ):
        assert needed in referenced, needed


def test_dashboard_is_a_provisioned_grafana_dashboard():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    datasources = yaml.safe_load(next((DEPLOY / "grafana/provisioning/datasources").glob("*.yml")).read_text())
    uids = {d["uid"] for d in datasources["datasources"]}
    occupied: set[tuple[int, int]] = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & occupied, f"panel {p['title']!r} overlaps another"
        occupied |= cells
        if p["type"] != "row":
            assert p["targets"], p["title"]
            assert p["datasource"]["uid"] in uids
            assert all(t["datasource"]["uid"] in uids and t["refId"] for t in p["targets"])
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for word in ("latency", "queue", "batch", "hit ratio", "bytes served", "errors", "redis", "tenant", "autoscaling"):
        assert word in titles, word
    assert any("histogram_quantile" in e for e in dashboard_exprs())
    # the provider loads the folder that compose mounts the dashboard JSON into
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/visenc.yml").read_text())
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    mounts = dict(v.split(":")[:2] for v in compose["services"]["grafana"]["volumes"])
    assert mounts["./grafana/dashboards"] == provider["providers"][0]["options"]["path"]


def promtool() -> str:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.fail("promtool is not installed (make test installs Debian's prometheus package)")
    return exe


@pytest.mark.parametrize(
    "args",
    [
        ["check", "rules", "alerts.yml"],
        ["check", "config", "prometheus.yml"],
        ["test", "rules", "alerts_test.yml"],  # each alert fires on the series it was written for
    ],
    ids=lambda a: " ".join(a[:2]),
)
def test_promtool(args):
    done = subprocess.run([promtool(), *args], cwd=PROMETHEUS, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout + done.stderr


def test_alert_rules_cover_the_issue():
    rules = {
        r["alert"]: r for g in yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"] for r in g["rules"]
    }
    for name in (
        "VisencHighErrorRatio",
        "VisencQueueSaturated",
        "VisencRedisDown",
        "VisencRedisErrors",
        "VisencHitRatioCollapse",
        "VisencWorkerDown",
    ):
        assert name in rules
        assert rules[name]["labels"]["severity"] in {"warning", "critical"}
        assert rules[name]["annotations"]["summary"]
    tested = yaml.safe_load((PROMETHEUS / "alerts_test.yml").read_text())
    fired = {t["alertname"] for case in tested["tests"] for t in case["alert_rule_test"] if t["exp_alerts"]}
    assert fired >= set(rules), f"alerts without a firing unit test: {set(rules) - fired}"


def test_prometheus_scrapes_the_compose_service():
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "visenc"]
    (sd,) = job["dns_sd_configs"]
    assert sd["names"] == ["visenc"] and "visenc" in compose["services"]
    assert str(sd["port"]) in {p.split(":")[-1] for p in compose["services"]["visenc"]["ports"]}
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert Path(PROMETHEUS / config["rule_files"][0]).is_file()


async def test_every_labelled_family_has_samples_on_a_fresh_service(service):
    """Pre-initialised label values: a dashboard on a replica that has served nothing shows zeros, not "no data"."""
    text = (await service.get("/metrics")).text
    empty = []
    for family in text_string_to_metric_families(text):
        if family.name.startswith("visenc_") and not family.samples:
            empty.append(family.name)
    assert empty == []
    present = {
        (s.name, tuple(sorted(s.labels.items())))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    for name, labels in [
        ("visenc_errors_total", {"kind": "hash_mismatch"}),
        ("visenc_encode_failures_total", {"kind": "stall"}),
        ("visenc_cache_lookups_total", {"tier": "memory", "result": "miss"}),
        ("visenc_claims_total", {"outcome": "takeover"}),
        ("visenc_bytes_served_total", {"transport": "shm"}),
        ("visenc_requests_total", {"endpoint": "/v1/encode", "status": "200"}),
        ("visenc_index_up", {"tier": "memory"}),
    ]:
        assert (name, tuple(sorted(labels.items()))) in present, (name, labels)
