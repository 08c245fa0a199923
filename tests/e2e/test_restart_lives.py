"""A visenc killed with SIGKILL leaks nothing once it is started again, whatever its PID: each one runs as
PID 1 of its own PID namespace, as in a container, so a PID says nothing about which life made a file.

Segments belong to a life, alive while it holds its lock (``visenc.lives``); the restarted one removes the
files of the life that was killed, and two visencs sharing one ``--shm-dir`` never remove each other's."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from harness.images import png_bytes
from harness.paths import ROOT
from harness.waits import free_port, wait_ready

from visenc_client import Client, RowRange

NAMESPACE = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]


def _unshare_refused() -> str | None:
    if not os.path.isdir("/dev/shm") or shutil.which("unshare") is None:
        return "needs Linux's /dev/shm and unshare(1)"
    done = subprocess.run([*NAMESPACE, "true"], capture_output=True, text=True)
    return None if done.returncode == 0 else f"unshare --pid is refused here: {done.stderr.strip()}"


pytestmark = [
    pytest.mark.skipif(_unshare_refused() is not None, reason=str(_unshare_refused())),
    pytest.mark.timeout(900),  # three to four starts in a row (minutes on a loaded host)
]


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A folder of its own on /dev/shm, so that other processes' segments are never counted."""
    folder = Path(tempfile.mkdtemp(prefix="visenc-lives-", dir="/dev/shm"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def pid1(shm_dir: Path, log: Path, lease_s: int) -> Iterator[tuple[str, int]]:
    """``visenc serve`` as PID 1 of a new PID namespace, ready; yields (url, its PID out here)."""
    port = free_port()
    argv = ["--host", "127.0.0.1", "--port", str(port), "--torch-threads", "1"]
    argv += ["--shm-enabled", "true", "--shm-dir", str(shm_dir), "--shm-lease-s", str(lease_s)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "service"), str(ROOT / "clients"), str(ROOT)])}
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [*NAMESPACE, sys.executable, "-m", "visenc", "serve", *argv], env=env, stdout=out, stderr=out
        )
    url = f"http://127.0.0.1:{port}"
    inner = ""
    try:
        wait_ready(url, proc)
        (inner,) = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        status = Path(f"/proc/{inner}/status").read_text()
        assert [ln.split()[-1] for ln in status.splitlines() if ln.startswith("NSpid:")] == ["1"], status
        yield url, int(inner)
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(inner), signal.SIGTERM) if inner else proc.kill()  # unshare kills its child then
            proc.wait(timeout=30)


def killed(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def rows_over_shm(url: str, seeds: range) -> tuple[Client, list[np.ndarray]]:
    """Images encoded, then their rows mapped from segments (the client's leases); the client stays open."""
    vc = Client(url, shared_memory=True)
    hashes = [h.hash for h in vc.encode([png_bytes(s, 96 + 8 * s, 64) for s in seeds])]
    rows = vc.fetch_many([RowRange(h) for h in hashes])
    assert vc._segments is not None and vc._segments.views([RowRange(h) for h in hashes]) is not None  # mapped
    return vc, rows


def files(folder: Path) -> set[str]:
    return set(os.listdir(folder))


def test_a_restart_as_pid_1_removes_what_the_killed_life_left(shm_dir, tmp_path):
    log = tmp_path / "serve.log"
    with pid1(shm_dir, log, lease_s=120) as (url, pid):
        vc, held = rows_over_shm(url, range(1, 4))
        copies = [a.copy() for a in held]
        first = files(shm_dir)
        assert len([n for n in first if not n.startswith("visenc-life-")]) == 4, first  # 3 segments and the probe
        killed(pid)
    assert files(shm_dir) == first  # a kill cleans nothing up
    assert all(np.array_equal(a, c) for a, c in zip(held, copies, strict=True))  # mapped rows stay readable
    vc.close()

    with pid1(shm_dir, log, lease_s=120) as (url, _):
        assert not files(shm_dir) & first, "the previous life's segments, probe and lock are gone"
        again, rows = rows_over_shm(url, range(1, 4))
        assert all(np.array_equal(a, c) for a, c in zip(rows, copies, strict=True))
        again.close()
    assert files(shm_dir) == set(), "a clean stop leaves nothing"
    assert "removed 5 shared-memory files left by visenc processes that ended" in log.read_text()


def test_two_visencs_sharing_a_directory_never_remove_each_others_segments(shm_dir, tmp_path):
    with pid1(shm_dir, tmp_path / "a.log", lease_s=120) as (a, _):
        client_a, rows_a = rows_over_shm(a, range(1, 3))
        of_a = files(shm_dir)
        with pid1(shm_dir, tmp_path / "b.log", lease_s=120) as (b, pid_b):
            client_b, _ = rows_over_shm(b, range(3, 5))
            assert of_a <= files(shm_dir), "b's start removed none of a's"
            of_b = files(shm_dir) - of_a
            assert len(of_b) == 4, of_b  # 2 segments, a probe and a lock
            killed(pid_b)
        client_b.close()
        with pid1(shm_dir, tmp_path / "b.log", lease_s=120) as (b, _):
            assert of_a <= files(shm_dir), "the restarted one kept the live one's segments, probe and lock"
            assert not files(shm_dir) & of_b, "and removed its own previous life's"
            restarted, _ = rows_over_shm(b, range(3, 5))
            restarted.close()
        assert of_a <= files(shm_dir)
        again, rows = rows_over_shm(a, range(1, 3))  # a serves on, from the same segments
        assert all(np.array_equal(x, y) for x, y in zip(rows, rows_a, strict=True))
        assert files(shm_dir) == of_a  # b stopped cleanly: nothing of its own is left
        again.close()
        client_a.close()
