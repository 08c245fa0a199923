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
import types

import pytest
from harness.images import png_bytes
from harness.paths import ROOT
from harness.processes import serve_process
from harness.waits import wait_until

from visenc_client import BadRequestError, Client, ImagePlacement, RowRange, _shm

SHM_DIR = "/dev/shm"
CLIENT = textwrap.dedent("""
    import sys, time
    from visenc_client import BadRequestError, Client, ImagePlacement, RowRange
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
        wait_until(lambda: not segments(prefix), 15, "every segment is reaped after its lease")

        with Client(url, shared_memory=True) as vc:  # new handles, new segments
            vc.fetch_many([RowRange(h) for h in hashes])
        assert len(segments(prefix)) == 3
    # the service was terminated: it unlinked everything it still held
    assert segments(prefix) == []


def test_a_client_reads_a_known_segment_again_with_no_request(monkeypatch):
    """A segment never changes: the next chunks of an image (and the next turn's fetches) read the
    segment the client was last given, with no request, for half the lease; then, and for a range
    outside the image, the service is asked; a stopped service's segments are never read again."""
    data = png_bytes(77, 320, 240)
    ahead = [0.0]  # the client's clock moved on by this much: a busy host cannot outrun the half lease
    clock = types.SimpleNamespace(monotonic=lambda: time.monotonic() + ahead[0], sleep=time.sleep)
    monkeypatch.setattr(_shm, "time", clock)
    with serve_process("--shm-enabled", "true", "--shm-lease-s", "30") as url:
        with Client(url, shared_memory=True) as vc, Client(url) as http:
            (h,) = vc.encode([data])
            n, sent = h.num_tokens, []
            vc._http.event_hooks = {"request": [lambda request: sent.append(request.url.path)]}
            placed = [ImagePlacement.of(h, 0)]
            assert vc.fetch_chunk(placed, 0, n).tobytes() == http.fetch(h).tobytes()
            assert sent == ["/v1/embeddings/shm"]
            for start, end in [(0, 5), (3, n), (n - 1, n), (7, 7)]:
                assert vc.fetch_chunk(placed, start, end).tobytes() == http.fetch(h, start, end).tobytes()
            assert vc.fetch(h, 2, 4).tobytes() == http.fetch(h, 2, 4).tobytes()
            assert sent == ["/v1/embeddings/shm"]  # every later range from the known segment
            with pytest.raises(BadRequestError):  # outside the image: the service's own answer
                vc.fetch(h, 0, n + 1)
            assert len(sent) == 2
            ahead[0] = 14.0  # within half the 30 s lease: still no request
            assert vc.fetch(h, 0, 1).tobytes() == http.fetch(h, 0, 1).tobytes()
            assert len(sent) == 2
            ahead[0] = 15.1  # past half the lease: asked again (which renews the lease)
            assert vc.fetch(h, 0, 1).tobytes() == http.fetch(h, 0, 1).tobytes()
            assert len(sent) == 3
            known = vc._segments
            assert known is not None and known.views([RowRange(h.hash, 0, 1)]) is not None
    assert known.views([RowRange(h.hash, 0, 1)]) is None  # the service stopped: its segments are gone
