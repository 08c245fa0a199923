"""Short, bounded Locust runs through ``loadtest/run`` (loopback only).

Locust monkey-patches the process with gevent, so it only ever runs as a
subprocess (``loadtest/run`` starts ``python -m locust``); nothing here
imports it.
"""

from __future__ import annotations

import csv
import json
import os
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import msgpack
import psutil
import pytest
from harness.paths import ROOT
from harness.processes import serve_process
from PIL import Image

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PLOTS = ("latency.png", "throughput.png", "ttfc.png", "hit_ratio.png", "overview.png")
SMALL = ["--image-size", "160x96", "--chunk-tokens", "16", "--think-time", "0.05"]


def run_loadtest(out: Path, *args: str, timeout_s: float = 90.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(ROOT / "loadtest" / "run"), "--out", str(out), "--stop-timeout", "10", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, "LOADTEST_PYTHON": sys.executable},
    )


def stats(out: Path, name: str = "locust_stats.csv") -> list[dict[str, str]]:
    with (out / name).open(newline="") as f:
        return list(csv.DictReader(f))


def assert_report(out: Path) -> None:
    report = (out / "report.md").read_text()
    assert report.startswith("# Load test:") and " 0 failures" in report
    for name in PLOTS:
        data = (out / name).read_bytes()
        assert data[:8] == PNG_SIGNATURE, name
        assert len(data) > 10_000, f"{name} is only {len(data)} bytes"
        with Image.open(out / name) as im:
            im.verify()
        with Image.open(out / name) as im:
            assert im.width > 300 and im.height > 200, (name, im.size)
        assert f"]({name})" in report or name == "overview.png"


def test_agent_run_against_a_server_it_starts(tmp_path: Path) -> None:
    out = tmp_path / "agent"
    proc = run_loadtest(out, "--scenario", "agent", "-u", "2", "-r", "2", "-t", "8s", "--agent-turns", "4", *SMALL)
    assert proc.returncode == 0, proc.stdout + proc.stderr + (out / "locust.log").read_text()[-3000:]
    rows = stats(out)
    assert all(r["Failure Count"] == "0" for r in rows), rows
    count = {(r["Type"], r["Name"]): int(r["Request Count"]) for r in rows}
    assert count[("POST", "/v1/encode [hashes]")] >= 4
    assert count[("POST", "/v1/encode [upload]")] >= 4
    # chunks of 16 rows over 160x96 images (24 tokens each): several fetches a turn
    assert count[("POST", "/v1/embeddings/fetch [chunk]")] > count[("POST", "/v1/encode [hashes]")]
    assert count[("images", "hit")] > 0 and count[("images", "miss")] > 0  # earlier turns resent by hash
    assert count[("TTFC", "n=01")] >= 1 and count[("TTA", "n=01")] >= 1
    assert any(r["Type"] == "TTFC" and r["Name"] == "n=02" for r in rows)
    assert stats(out, "locust_stats_history.csv")  # full history written
    info = json.loads((out / "run.json").read_text())
    assert info["locust_rc"] == 0 and info["server_pid"] and not psutil.pid_exists(info["server_pid"])
    assert_report(out)
    metrics = (out / "metrics.csv").read_text()
    assert "visenc_cache_lookups_total" in metrics and "visenc_encoded_images_total" in metrics
    # it ends with a short table: a row per request kind as Locust counted it, then failures and hits
    table = proc.stdout.strip().splitlines()[-(len([r for r in rows if r["Type"] in ("GET", "POST", "TTFC")]) + 3) :]
    assert table[0].split() == ["request", "count", "failures", "median", "ms", "p95", "ms", "per", "s"]
    hashes = next(line for line in table if line.startswith("POST /v1/encode [hashes]"))
    assert hashes.split()[3] == str(count[("POST", "/v1/encode [hashes]")])
    assert table[-1].startswith("0 failures; hash-first hit ratio")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with serve_process("--torch-threads", "1", "--log-level", "warning", log=log) as url:
        yield url


def test_staged_mixed_run_against_a_given_url(server: str, tmp_path: Path) -> None:
    out = tmp_path / "mixed"
    proc = run_loadtest(
        out,
        "--url",
        server,
        "--scenario",
        "mixed",
        "--ramp",
        "--stages",
        "3:1:1,7:2:2",
        "--hit-ratio",
        "0.5",
        "--hot-pool",
        "4",
        "--fetch-mode",
        "get",
        *SMALL,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr + (out / "locust.log").read_text()[-3000:]
    rows = stats(out)
    assert all(r["Failure Count"] == "0" for r in rows), rows
    count = {(r["Type"], r["Name"]): int(r["Request Count"]) for r in rows}
    assert count[("images", "hit")] > 0 and count[("images", "miss")] > 0
    assert count[("GET", "/v1/embeddings/{hash}")] > 0 and ("POST", "/v1/embeddings/fetch [chunk]") not in count
    users = {int(r["User Count"]) for r in stats(out, "locust_stats_history.csv")}
    assert {1, 2} <= users  # the shape stepped from one user to two
    assert json.loads((out / "run.json").read_text())["server_pid"] is None  # not ours to stop
    assert_report(out)


# --- a service that answers 200 with wrong rows: the run must report failures ----

HIDDEN, TOKENS = 8, 4


class _WrongRows(BaseHTTPRequestHandler):
    """Encode answers are right; every fetched range is one row short of what its header claims."""

    def _send(self, body: bytes, ctype: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(200)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._send(b"" if self.path == "/metrics" else b"{}", "text/plain")

    def do_POST(self) -> None:
        body = msgpack.unpackb(self.rfile.read(int(self.headers["content-length"])))
        if self.path == "/v1/encode":
            items = [
                {
                    "hash": it["hash"],
                    "status": "ready",
                    "num_tokens": TOKENS,
                    "hidden_size": HIDDEN,
                    "dtype": "float32",
                    "grid_thw": [1, 4, 4],
                }
                for it in body["items"]
            ]
            self._send(
                msgpack.packb({"model": "fake", "items": items}),
                "application/msgpack",
                {"X-Visenc-Queue-Time": "0.004000", "X-Visenc-Encode-Time": "0.250000"},
            )
            return
        meta, rows, offset = [], b"", 0
        for r in body["ranges"]:
            n = r["end"] - r["start"]
            data = bytes(4 * HIDDEN * (n - 1))  # one row short
            meta.append(
                {
                    "hash": r["hash"],
                    "start": r["start"],
                    "end": r["end"],
                    "shape": [n, HIDDEN],
                    "dtype": "float32",
                    "offset": offset,
                    "nbytes": len(data),
                }
            )
            rows += data
            offset += len(data)
        header = msgpack.packb({"items": meta})
        self._send(struct.pack("<I", len(header)) + header + rows, "application/x-visenc-rows")

    def log_message(self, *args: object) -> None:
        pass


def test_a_200_with_wrong_rows_is_a_failure(tmp_path: Path) -> None:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _WrongRows)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        out = tmp_path / "wrong"
        proc = run_loadtest(
            out,
            "--url",
            f"http://127.0.0.1:{httpd.server_port}",
            "--scenario",
            "cold",
            "-u",
            "1",
            "-r",
            "1",
            "-t",
            "3s",
            "--images-per-request",
            "1",
            *SMALL,
        )
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    count = {(r["Type"], r["Name"]): (int(r["Request Count"]), int(r["Failure Count"])) for r in stats(out)}
    fetches, failed = count[("POST", "/v1/embeddings/fetch [chunk]")]
    assert fetches >= 1 and failed == fetches
    assert count[("POST", "/v1/encode [hashes]")][1] == 0  # the right answers passed
    assert ("TTFC", "n=01") not in count  # a failed chunk is not a first chunk
    # the server timing headers became stats entries, in ms
    assert count[("server", "queue")][0] >= 1 and count[("server", "encode")][0] >= 1
    timing = {r["Name"]: r for r in stats(out) if r["Type"] == "server"}
    assert timing["queue"]["Median Response Time"] == "4" and timing["encode"]["Median Response Time"] == "250"
    errors = " ".join(f["Error"] for f in stats(out, "locust_failures.csv"))
    assert f"bytes for {min(16, TOKENS)} rows x {HIDDEN} x float32" in errors
    assert "## Failures" in (out / "report.md").read_text()
    assert os.path.exists(out / "overview.png")
