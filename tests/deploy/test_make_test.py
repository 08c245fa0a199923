"""``make test``'s two pytest runs (the main suite on workers, then the ``serial`` tests) with a stub
python: a part that selects nothing (``PYTEST_ARGS`` naming only the other part's tests) is not a
failure; nothing selected at all is, as is any failure of either part."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from harness.paths import ROOT

STUB = """#!/bin/sh
echo "$@" >> "$(dirname "$0")/../calls"
case "$*" in *"not serial"*) exit $MAIN_RC;; *) exit $SERIAL_RC;; esac
"""


def make_test(tmp_path: Path, main_rc: int, serial_rc: int) -> tuple[int, list[str]]:
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text(STUB)
    (tmp_path / "bin" / "python").chmod(0o755)
    outer = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}  # under make test
    r = subprocess.run(
        ["make", "-o", "install-test", "test", f"VENV={tmp_path}", "SUBMAKE=true", "MAKE=true"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**outer, "MAIN_RC": str(main_rc), "SERIAL_RC": str(serial_rc)},
    )
    calls = (tmp_path / "calls").read_text().splitlines() if (tmp_path / "calls").exists() else []
    return r.returncode, calls


@pytest.mark.parametrize(
    ("main_rc", "serial_rc", "passes", "runs"),
    [
        (0, 0, True, 2),
        (0, 5, True, 2),  # PYTEST_ARGS picks no serial test
        (5, 0, True, 2),  # PYTEST_ARGS picks only serial tests
        (5, 5, False, 2),  # nothing at all
        (1, 0, False, 1),  # a failure in the main part: the serial part does not run
        (0, 1, False, 2),
    ],
)
def test_each_part_may_select_nothing_but_not_both(tmp_path, main_rc, serial_rc, passes, runs):
    rc, calls = make_test(tmp_path, main_rc, serial_rc)
    assert (rc == 0) == passes, (rc, calls)
    assert len(calls) == runs, calls
