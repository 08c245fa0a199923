"""Partial hub files belong to the fetch that writes them, as long as it runs: a fetch killed mid-way leaves
files that the next sweep removes, whatever commit they were for; a running fetch's files are never touched."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from harness.paths import ROOT
from tests.support.access import without_file_access

from visenc.models.resume import sweep

#: takes the vision file's lock as a fetch does (``HubWeights._locked``), writes its partial files, waits
FETCH = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from huggingface_hub.utils import WeakFileLock
    folder = Path(sys.argv[1])
    with WeakFileLock(folder / "vision.lock"):
        (folder / "vision.safetensors.incomplete").write_bytes(b"x" * 4096)
        (folder / "vision.safetensors.incomplete.blocks").write_text("visenc-blocks 1 id\\n")
        print("fetching", flush=True)
        time.sleep(120)
""")


def fetching(folder) -> subprocess.Popen[str]:
    folder.mkdir(parents=True)
    proc = subprocess.Popen([sys.executable, "-c", FETCH, str(folder)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "fetching\n"
    return proc


def test_a_killed_fetch_is_swept_and_a_running_one_is_not(tmp_path):
    killed, running = tmp_path / "models--acme--a" / "c1", tmp_path / "models--acme--b" / "c2"
    done = tmp_path / "models--acme--a" / "c0"
    done.mkdir(parents=True)
    (done / "vision.safetensors").write_bytes(b"whole")
    (done / "vision.safetensors.0123.incomplete").write_bytes(b"x")  # as an earlier version named them
    victim, live = fetching(killed), fetching(running)
    try:
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=10)
        removed = sweep(tmp_path)
        assert sorted(p.relative_to(tmp_path).as_posix() for p in removed) == [
            "models--acme--a/c0/vision.safetensors.0123.incomplete",
            "models--acme--a/c1/vision.safetensors.incomplete",
            "models--acme--a/c1/vision.safetensors.incomplete.blocks",
        ]
        assert sorted(p.name for p in running.iterdir()) == [
            "vision.lock",
            "vision.safetensors.incomplete",
            "vision.safetensors.incomplete.blocks",
        ]
        assert (done / "vision.safetensors").read_bytes() == b"whole"
    finally:
        live.kill()
        live.wait(timeout=10)
    assert len(sweep(tmp_path)) == 2  # once that one has ended too
    assert sweep(tmp_path) == []


def test_locks_of_another_user_neither_fail_nor_stop_the_sweep(tmp_path):
    """A volume shared by users: a lock file only readable here (huggingface_hub makes them 0664, another
    user's) is taken as any other; one that cannot be opened at all is left, and the sweep goes on."""
    for commit in ("c0", "c1", "c2"):
        folder = tmp_path / "models--acme--a" / commit
        folder.mkdir(parents=True)
        (folder / "vision.lock").write_bytes(b"")
        (folder / "vision.safetensors.incomplete").write_bytes(b"x")
    (tmp_path / "models--acme--a" / "c0" / "vision.lock").chmod(0)
    (tmp_path / "models--acme--a" / "c1" / "vision.lock").chmod(0o444)
    script = "import sys; from pathlib import Path; from visenc.models.resume import sweep; sweep(Path(sys.argv[1]))"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "service")}
    done = subprocess.run([*without_file_access(), sys.executable, "-c", script, str(tmp_path)], env=env, text=True)
    assert done.returncode == 0
    left = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.glob("*/*/*.incomplete"))
    assert left == ["models--acme--a/c0/vision.safetensors.incomplete"]
