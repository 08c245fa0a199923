"""The kill-and-restart soak, short (``bench/bench_kill_soak.py`` runs the long one): two replicas on one
Redis under prefill-like load, one killed with SIGKILL at random moments and started again at once.
Every request got its rows (a retry on the other replica where it met the killed one), no row differs
from a run without faults, and nothing is left behind: the shared-memory and download folders and
Redis' claim keys are back at their level before."""

from __future__ import annotations

import sys

from harness.paths import ROOT

sys.path[:0] = [str(ROOT / "bench")]
import bench_kill_soak  # noqa: E402


def test_kills_cost_no_request_its_rows_and_leak_nothing(tmp_path):
    counts = bench_kill_soak.soak(kills=3, clients=3, images=150, seed=1, logs=tmp_path, gap_s=6.0)
    assert counts.get("killed while serving", 0) + counts.get("killed while starting", 0) == 3
    assert counts["rows right"] > 0 and counts["look-up found it missing"] > 0  # some were encoded meanwhile
    assert counts["answered on a retry"] > 0  # some met the killed replica, and a retry got their rows
    assert counts.get("rows wrong", 0) == 0
    assert counts.get("unclear error", 0) == 0
    assert counts.get("no rows after retries", 0) == 0
    assert counts["shm+download files after - before"] == 0
    assert counts["shm+download bytes after - before"] == 0
    assert counts["claim keys after - before"] == 0
