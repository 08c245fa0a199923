"""What ``bench/_spy.py`` reads from a py-spy record: each thread's busy share and hottest lines with their
text, a pool's threads as one; and a record of a real process where py-spy may attach."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import _spy  # noqa: E402


def test_the_summary_counts_busy_samples_and_names_each_hot_line(tmp_path):
    code = tmp_path / "graph.py"
    code.write_text("def call():\n    launch_kernel()\n    copy_rows()\n")
    record = tmp_path / "record.txt"
    record.write_text(
        "thread (1): visenc-device;run (device.py:10);call (graph.py:2) 60\n"
        "thread (1): visenc-device;run (device.py:10);call (graph.py:3) 20\n"
        "thread (1): visenc-device;run (device.py:9);Condition.wait (threading.py:359) 20\n"
        "thread (2): visenc-pre_0;_worker (concurrent/futures/thread.py:89) 100\n"
        "thread (3): visenc-pre_1;prep (p.py:1) 50\n"
        "thread (3): visenc-pre_1;_worker (concurrent/futures/thread.py:89) 50\n"
    )
    text = _spy.summary(record, hot=2, roots=[tmp_path])
    assert "visenc-device: busy 80% of 100 samples" in text
    assert "60.0% call (graph.py:2) | launch_kernel()" in text  # found by name under the roots
    assert "20.0% call (graph.py:3) | copy_rows()" in text
    assert "visenc-pre_*: busy 25% of 200 samples" in text  # the pool's two threads as one
    assert "Condition.wait" not in text  # waiting is not work


@pytest.mark.skipif(_spy.find_py_spy() is None, reason="py-spy is not installed (the test extra has it)")
def test_a_record_of_a_live_process_names_its_busy_thread(tmp_path):
    busy = tmp_path / "busy.py"
    busy.write_text(
        textwrap.dedent(
            """
            import threading, time
            def spin():
                end = time.monotonic() + 30
                while time.monotonic() < end:
                    sum(range(1000))
            threading.Thread(target=spin, name="visenc-device").start()
            """
        )
    )
    proc = subprocess.Popen([sys.executable, str(busy)])
    try:
        time.sleep(0.5)
        with _spy.recorded(proc.pid, tmp_path, "live"):
            time.sleep(1.5)
        record = tmp_path / "live.txt"
        if not record.exists() or not record.stat().st_size:
            pytest.skip(f"py-spy could not sample another process here (ptrace refused?, uid {os.getuid()})")
        text = _spy.summary(record)
        assert "visenc-device: busy" in text
        assert "spin (busy.py:" in text
    finally:
        proc.kill()
        proc.wait()
