"""The shared-memory segment pool: leases, budget, single writes, stale sweep, shutdown."""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
import sys

import numpy as np
import pytest

from visenc import shm
from visenc.errors import Overloaded
from visenc.lives import Life
from visenc.metrics import Metrics
from visenc.shm import SegmentPool
from visenc_client.format import pack_entry


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def entry(seed: int, rows: int = 4, hidden: int = 8):
    data = np.random.default_rng(seed).standard_normal((rows, hidden)).astype(np.float32)
    return pack_entry(data, dtype="float32", grid_thw=(1, 2, 2 * rows), fingerprint="f", hash=f"{seed:064x}")


def pool(tmp_path, clock, max_bytes=1 << 20, lease_s=10.0) -> SegmentPool:
    return SegmentPool(str(tmp_path), lease_s=lease_s, max_bytes=max_bytes, metrics=Metrics(), clock=clock)


async def test_segment_holds_the_stored_value_and_lease_renews(tmp_path):
    clock = Clock()
    p = pool(tmp_path, clock)
    e = entry(1)
    a, b = await asyncio.gather(p.export("k1", e), p.export("k1", e))  # one write for both
    assert a is b and os.listdir(tmp_path) == [a.name] and a.name.startswith(p.prefix)
    assert (tmp_path / a.name).read_bytes() == bytes(e.blob)
    assert (tmp_path / a.name).stat().st_mode & 0o777 == 0o600
    clock.now += 8
    assert await p.export("k1", e) is a  # renewed: expires at 118 now
    clock.now += 8
    assert await p.reap() == 0 and (tmp_path / a.name).exists()
    clock.now += 3
    assert await p.reap() == 1 and os.listdir(tmp_path) == [] and p.bytes == 0


async def test_a_re_encoded_entry_gets_its_own_segment(tmp_path):
    p = pool(tmp_path, Clock())
    first = await p.export("k", entry(1))
    second = await p.export("k", entry(2))
    assert first.name != second.name and len(os.listdir(tmp_path)) == 2  # the old lease still runs
    await p.close()
    assert os.listdir(tmp_path) == []


async def test_budget_is_never_met_by_breaking_a_lease(tmp_path):
    clock = Clock()
    one = entry(1).nbytes
    p = pool(tmp_path, clock, max_bytes=2 * one)
    await p.export("a", entry(1))
    await p.export("b", entry(2))
    with pytest.raises(Overloaded):
        await p.export("c", entry(3))
    assert len(os.listdir(tmp_path)) == 2
    clock.now += 11  # both leases expired: the export reaps them and fits
    await p.export("c", entry(3))
    assert len(os.listdir(tmp_path)) == 1 and p.bytes == one


@pytest.fixture
def dead_pid() -> int:
    """The pid of a process that has exited."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


async def test_start_sweeps_segments_of_dead_services_only(tmp_path, dead_pid):
    dead, live = Life(str(tmp_path)), Life(str(tmp_path))
    dead.begin()
    live.begin()
    os.close(dead._fd)  # as the kernel does when a process dies: the file stays, its lock goes
    files = {
        "dead": [f"visenc-{dead.id}-3", f"visenc-{dead.id}.probe-0123abcd", f"visenc-life-{dead.id}.lock"],
        "orphan": ["visenc-00000000000000aa-1"],  # a life whose lock file is gone: it ended mid-sweep
        "legacy dead": [f"visenc-{dead_pid}-0123abcd-7"],
        "kept": [f"visenc-{live.id}-1", f"visenc-{os.getppid()}-0123abcd-1", "someone-elses-file"],
    }
    for name in (n for names in files.values() for n in names):
        if not name.endswith(".lock"):
            (tmp_path / name).write_bytes(b"x")
    p = pool(tmp_path, Clock())
    await p.start()
    try:
        own = [p.probe, f"visenc-life-{p.life.id}.lock"]
        assert sorted(os.listdir(tmp_path)) == sorted(files["kept"] + own + [f"visenc-life-{live.id}.lock"])
    finally:
        await p.close()
    assert sorted(os.listdir(tmp_path)) == sorted(files["kept"] + [f"visenc-life-{live.id}.lock"])  # none of its own
    live.end()


async def test_a_serving_pool_sweeps_lives_that_end_meanwhile(tmp_path):
    p = SegmentPool(str(tmp_path), lease_s=0.2, max_bytes=1 << 20, metrics=Metrics())
    await p.start()
    other = Life(str(tmp_path))
    other.begin()
    (tmp_path / f"visenc-{other.id}-1").write_bytes(b"x")
    try:
        await asyncio.sleep(0.3)  # reaped and swept at least once meanwhile: a live one's files stay
        assert f"visenc-{other.id}-1" in os.listdir(tmp_path)
        os.close(other._fd)  # it is killed
        for _ in range(100):
            if f"visenc-{other.id}-1" not in os.listdir(tmp_path):
                break
            await asyncio.sleep(0.05)
        assert sorted(os.listdir(tmp_path)) == sorted([p.probe, f"visenc-life-{p.life.id}.lock"])
    finally:
        await p.close()


async def test_a_start_that_fails_leaves_no_probe_and_no_lock_file(tmp_path, monkeypatch):
    def full(path: str, data: bytes) -> None:  # the directory is full: the probe is made, its bytes are not
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr(shm, "_write", full)
    p = pool(tmp_path, Clock())
    with pytest.raises(OSError):
        await p.start()
    assert os.listdir(tmp_path) == []
