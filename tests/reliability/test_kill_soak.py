"""The kill-and-restart soak, short (``bench/bench_kill_soak.py --kills 20`` runs the long one): two replicas
on one Redis under a bounded Locust load of prefill-like users, one replica killed with SIGKILL (mostly
while it serves, under load) and started again at once. Every request got its rows (a retry on the other
replica where it met the killed one), no row differs from a run without faults, and nothing is left
behind: the shared-memory and download folders and Redis' claim keys are back at their level before.

Locust patches its process with gevent, so the soak runs as a script in a process of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from harness.paths import ROOT


def test_kills_cost_no_request_its_rows_and_leak_nothing(tmp_path):
    out = tmp_path / "counts.json"
    args = ["--kills", "3", "--clients", "3", "--images", "150", "--seed", "5", "--gap-s", "4"]
    args += ["--starting-share", "0.3", "--max-s", "240", "--logs", str(tmp_path), "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("service", "clients", "."))}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_kill_soak.py"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    counts = json.loads(out.read_text())
    assert counts.get("killed while serving", 0) + counts.get("killed while starting", 0) == 3, counts
    assert counts.get("killed while serving", 0) >= 2, counts  # seed 5: two kills wait for it to serve
    assert counts["users"] == 3 and counts["user exceptions"] == 0
    assert counts["most requests in flight at once"] > 1  # the users' sockets are gevent's: they overlap
    assert "stopped by the time bound" not in counts
    assert counts["rows right"] > 0 and counts["look-up found it missing"] > 0  # some were encoded meanwhile
    assert counts["look-up found it ready"] > 0  # and some read as the connector reads them
    assert counts["locust fetch shm: requests"] > 0 and counts["locust fetch http: requests"] > 0
    assert counts["answered on a retry"] > 0  # some met the killed replica, and a retry got their rows
    assert counts.get("rows wrong", 0) == 0
    assert counts.get("unclear error", 0) == 0
    assert counts.get("no rows after retries", 0) == 0
    assert counts["shm+download files after - before"] == 0
    assert counts["shm+download bytes after - before"] == 0
    assert counts["claim keys after - before"] == 0
