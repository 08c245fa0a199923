"""A real ``visenc serve`` whose process the test controls (signals, exit status, log)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import ROOT, free_port, wait_ready


@contextlib.contextmanager
def server_process(*args: str, log: Path, env: dict[str, str] | None = None
                   ) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``visenc serve`` on a free loopback port; yields (url, process); terminated, then killed, after."""
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "visenc", "serve", "--host", "127.0.0.1", "--port", str(port), *args],
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "service"), str(ROOT / "clients")]),
                 **(env or {})},
            stdout=out, stderr=subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, proc)
            yield url, proc
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
