"""The ``tenants`` scenario: an interactive tenant beside a flooding batch tenant, on one service.

``loadtest/run --scenario tenants -u 4 -r 4 -t 60s --serve-arg=--tenant-max-images=16``: one user in four is
the interactive tenant (one new image a request), the rest flood as the batch tenant (``--images-per-request``
new images a request, no pause). Each request names its tenant (``X-Visenc-Namespace``) and class
(``X-Visenc-Priority``). A 429 is a refusal, not a failure: it is counted as ``refused`` under its tenant.
``tenants.md`` in the output folder gives each tenant's latency and refusals.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, ClassVar

from loadtest.payloads import MSGPACK, PayloadError, check_handles, derive_seed, encode_body, image_hash, parse_size
from loadtest.payloads import screenshot_png as png
from locust import FastHttpUser, events, tag, task

TENANTS = {"interactive": "interactive", "flood": "batch"}


class _TenantUser(FastHttpUser):
    abstract = True
    scenario: ClassVar[str] = "tenants"
    tenant: ClassVar[str] = ""
    network_timeout = 120.0

    def on_start(self) -> None:
        self.opts = self.environment.parsed_options
        self.size = parse_size(self.opts.image_size)
        self.key, self.counter = uuid.uuid4().hex, 0
        self.headers = {"content-type": MSGPACK, "accept": MSGPACK, "x-visenc-namespace": self.tenant}
        self.headers["x-visenc-priority"] = TENANTS[self.tenant]

    def encode(self, n: int) -> None:
        """``n`` new images with their bytes, waiting for their rows' handles."""
        images = []
        for _ in range(n):
            self.counter += 1
            images.append(png(derive_seed(self.opts.run_id, self.tenant, self.key, self.counter), *self.size))
        items = [{"hash": image_hash(d), "data": d} for d in images]
        name = f"/v1/encode [{self.tenant}]"
        with self.client.post(
            "/v1/encode", data=encode_body(items, True), headers=self.headers, name=name, catch_response=True
        ) as resp:
            if resp.status_code == 429:  # reported apart from the answers: as ("refused", tenant)
                resp.request_meta |= {"request_type": "refused", "name": self.tenant}
                resp.success()
                return
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {bytes(resp.content or b'')[:200]!r}")
                return
            try:
                check_handles(resp.content, [it["hash"] for it in items], frozenset({"ready"}))
            except PayloadError as e:
                resp.failure(str(e))


class InteractiveTenantUser(_TenantUser):
    """The interactive tenant: one new image a request, then a pause (``--think-time``)."""

    tenant = "interactive"
    weight = 1

    def wait_time(self) -> float:
        return float(self.opts.think_time)

    @tag("tenants")
    @task
    def one_image(self) -> None:
        self.encode(1)


class FloodTenantUser(_TenantUser):
    """The flooding tenant: ``--images-per-request`` new images a request, batch class, no pause."""

    tenant = "flood"
    weight = 3

    def wait_time(self) -> float:
        return 0.0

    @tag("tenants")
    @task
    def flood(self) -> None:
        self.encode(int(self.opts.images_per_request))


def tenant_table(stats: Any) -> str:
    """Each tenant's requests answered, their latency (ms), its refusals (429) and failures: markdown."""
    lines = [
        "| tenant | class | answered | p50 ms | p95 ms | refused (429) | failed |",
        "|---|---|---|---|---|---|---|",
    ]
    for tenant, priority in TENANTS.items():
        entry = stats.get(f"/v1/encode [{tenant}]", "POST")
        refused = stats.get(tenant, "refused").num_requests
        answered = entry.num_requests - entry.num_failures
        p50, p95 = entry.get_response_time_percentile(0.5), entry.get_response_time_percentile(0.95)
        lines.append(
            f"| {tenant} | {priority} | {answered} | {p50:.0f} | {p95:.0f} | {refused} | {entry.num_failures} |"
        )
    return "\n".join(lines) + "\n"


@events.quitting.add_listener
def _write_table(environment: Any, **_: Any) -> None:
    options = environment.parsed_options
    if options is None or getattr(options, "scenario", None) != "tenants" or not options.csv_prefix:
        return
    out = Path(options.csv_prefix).parent / "tenants.md"
    out.write_text(
        "# Tenants\n\nLatency counts answered requests only; a refusal is a 429.\n\n" + tenant_table(environment.stats)
    )
