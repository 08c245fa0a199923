"""The ``tenants`` Locust scenario: an interactive tenant beside a flooding one; its report gives each tenant's
latency and refusals, and only the flooding tenant, over its quota, is refused."""

from __future__ import annotations

from pathlib import Path

from tests.loadtest.test_smoke import run_loadtest, stats


def test_each_tenant_has_its_latency_and_refusals(tmp_path: Path) -> None:
    out = tmp_path / "tenants"
    args = ["--scenario", "tenants", "-u", "4", "-r", "4", "-t", "10s", "--image-size", "160x96"]
    args += ["--think-time", "0.2", "--images-per-request", "4", "--serve-arg=--tenant-max-images=8"]
    proc = run_loadtest(out, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr + (out / "locust.log").read_text()[-3000:]
    count = {(r["Type"], r["Name"]): int(r["Request Count"]) for r in stats(out)}
    assert count[("POST", "/v1/encode [interactive]")] > 0 and count[("POST", "/v1/encode [flood]")] > 0
    assert count.get(("refused", "flood"), 0) > 0  # 3 users of 4 images each against a quota of 8
    assert ("refused", "interactive") not in count
    table = (out / "tenants.md").read_text().splitlines()
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in table if "| " in line}
    # the table is written at quitting, after the CSV's last write: requests still in flight then count in it
    assert rows["interactive"][4] == "0" and int(rows["flood"][4]) >= count[("refused", "flood")]
    assert int(rows["interactive"][1]) > 0 and float(rows["interactive"][3]) > 0  # answered, with a p95
