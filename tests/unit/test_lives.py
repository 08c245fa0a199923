"""A life's lock: held from ``begin`` to ``end`` (or the process's end), never taken by a sweeper while
held, and a lock file left half made (a start killed before it renamed it) is swept like any other."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from harness.paths import ROOT
from tests.support.access import without_file_access

from visenc import lives

HOLD = textwrap.dedent("""
    import sys, time
    from visenc.lives import Life
    life = Life(sys.argv[1])
    life.begin()
    print(life.id, flush=True)
    time.sleep(120)
""")


def test_a_held_life_is_kept_and_a_killed_one_is_swept(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "service")}
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        held = proc.stdout.readline().strip()
        (tmp_path / f"visenc-{held}-1").write_bytes(b"x")
        half = f"visenc-life-{'0' * 16}.lock.new"
        (tmp_path / half).write_bytes(b"")
        files = [(f"visenc-{held}-1", held)]
        assert lives.sweep(str(tmp_path), "", files) == [half]
        assert sorted(os.listdir(tmp_path)) == [f"visenc-{held}-1", f"visenc-life-{held}.lock"]
    finally:
        proc.kill()
        proc.wait()
    assert sorted(lives.sweep(str(tmp_path), "", files)) == [f"visenc-{held}-1", f"visenc-life-{held}.lock"]
    assert os.listdir(tmp_path) == []


def test_end_removes_its_lock_file_and_own_is_never_swept(tmp_path):
    life = lives.Life(str(tmp_path))
    life.begin()
    lock = f"visenc-life-{life.id}.lock"
    assert os.listdir(tmp_path) == [lock]
    assert lives.sweep(str(tmp_path), life.id, [(f"visenc-{life.id}-1", life.id)]) == []
    life.end()
    assert os.listdir(tmp_path) == []


def test_a_lock_file_this_user_may_not_open_is_kept_and_the_sweep_goes_on(tmp_path):
    """Another user's lock file on a shared directory (0600, theirs): its life may run, so it and its files
    stay, and the sweep neither fails nor stops before the lives it can tell are over."""
    theirs, dead = "a" * 16, "b" * 16
    for name in (f"visenc-life-{theirs}.lock", f"visenc-{theirs}-1", f"visenc-life-{dead}.lock", f"visenc-{dead}-1"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / f"visenc-life-{theirs}.lock").chmod(0)
    sweep = textwrap.dedent("""
        import os, sys
        from visenc import lives
        d = sys.argv[1]
        files = [(n, n.split("-")[1]) for n in os.listdir(d) if not n.startswith("visenc-life-")]
        print(sorted(lives.sweep(d, "", files)))
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "service")}
    argv = [*without_file_access(), sys.executable, "-c", sweep, str(tmp_path)]
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(sorted([f"visenc-{dead}-1", f"visenc-life-{dead}.lock"]))
    assert sorted(os.listdir(tmp_path)) == [f"visenc-{theirs}-1", f"visenc-life-{theirs}.lock"]
