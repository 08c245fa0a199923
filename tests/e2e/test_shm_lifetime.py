"""Shared-memory segments are owned by the service: nothing leaks when clients exit or crash.

A real ``visenc serve`` with a 6 s lease; client subprocesses map segments
(seen in their ``/proc/self/maps``), one exits, one is killed with SIGKILL.
Every segment the service created is gone once its lease runs out, and all of
them are gone when the service shuts down.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from tests.conftest import ROOT, serve_process
from tests.images import png_bytes

from visenc_client import Client, RowRange

SHM_DIR = "/dev/shm"
CLIENT = textwrap.dedent("""
    import sys, time
    from visenc_client import Client, RowRange
    url, mode, hashes = sys.argv[1], sys.argv[2], sys.argv[3:]
    with Client(url, shared_memory=True) as vc:
        arrays = vc.fetch_many([RowRange(h) for h in hashes])
    total = sum(float(a.sum()) for a in arrays)  # touch every mapped page
    mapped = sorted({line.split()[-1] for line in open("/proc/self/maps") if "/dev/shm/visenc-" in line})
    print(" ".join(mapped), flush=True)
    if mode == "hang":
        time.sleep(120)  # killed by the test
""")

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs a Linux /dev/shm tmpfs")


def segments(prefix: str) -> list[str]:
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))


def start_client(url: str, mode: str, hashes: list[str]) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "clients"), str(ROOT / "service")])}
    return subprocess.Popen(
        [sys.executable, "-c", CLIENT, url, mode, *hashes], env=env, text=True, stdout=subprocess.PIPE
    )


def mapped_by(proc: subprocess.Popen[str]) -> list[str]:
    """The segment names the client process had mapped (it prints them once it has)."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"client exited with {proc.wait()} before mapping anything"
    return [os.path.basename(p) for p in line.split()]


def wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def test_no_segment_outlives_its_lease_or_the_service_when_clients_exit_or_crash(tmp_path):
    with serve_process("--shm-enabled", "true", "--shm-lease-s", "6", log=tmp_path / "serve.log") as url:
        with Client(url) as vc:
            hs = vc.encode([png_bytes(600 + i, 96 + 20 * i, 64) for i in range(3)])
        hashes = [h.hash for h in hs]

        # both start together, so their segments were handed out at about the same time
        crashed, exited = start_client(url, "hang", hashes[:2]), start_client(url, "exit", hashes[1:])
        mapped_a, mapped_b = mapped_by(crashed), mapped_by(exited)
        assert exited.wait(timeout=30) == 0
        os.kill(crashed.pid, signal.SIGKILL)
        crashed.wait(timeout=10)

        assert len(mapped_a) == 2 and len(mapped_b) == 2  # one segment per image, shared by both clients
        prefix = mapped_a[0].rsplit("-", 1)[0] + "-"
        assert set(mapped_a) | set(mapped_b) == set(segments(prefix)), "the segments live under the lease"
        assert wait_for(lambda: not segments(prefix), timeout_s=15), f"leaked: {segments(prefix)}"

        with Client(url, shared_memory=True) as vc:  # new handles, new segments
            vc.fetch_many([RowRange(h) for h in hashes])
        assert len(segments(prefix)) == 3
    # the service was terminated: it unlinked everything it still held
    assert segments(prefix) == []
